"""Speech Commands v2 (Accumulator paper, SpeechCmdV2): the 12-class data from a generated
archive-shaped folder and a hub-shaped copy, speaker-disjoint splits, the natural partition by
speaker, spectrograms through the real ASTFeatureExtractor, background-noise corruption, and the
Accumulator on a tiny random AST end to end. Nothing touches the network."""

import json
import wave
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from fedadapt.adapters.exits import AccumulatorConfig
from fedadapt.config import (
    BackboneConfig,
    ConfigError,
    DatasetConfig,
    FederationConfig,
    PartitionConfig,
    RunConfig,
    SettingConfig,
    TrainConfig,
    validate,
)
from fedadapt.data.catalogue import load_card
from fedadapt.data.loading import prepare_dataset
from fedadapt.data.speech import CLASS_NAMES, load_archive, load_speech_commands, read_wav

#: Frequency of each word's tone; bed and visual are outside the ten words (-> _unknown_).
TONES = {"yes": 300, "no": 500, "up": 700, "go": 900, "bed": 1100, "visual": 1300}
SPEAKERS = {"train": ["aa000001", "aa000002", "aa000003", "aa000004"],
            "validation": ["bb000001", "bb000002"], "test": ["cc000001", "cc000002"]}
TINY_AST = BackboneConfig(name="tiny_ast", family="ast", image_size=128, arch=dict(
    hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
    patch_size=16, frequency_stride=10, time_stride=10, max_length=128, num_mel_bins=128))


def write_wav(path: Path, x: np.ndarray, rate: int = 16_000) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(np.clip(np.round(x * 32767), -32768, 32767).astype("<i2").tobytes())


def make_archive(root: Path) -> Path:
    """A Speech-Commands-shaped folder: <word>/<speaker>_nohash_0.wav (tones, 1 s or 0.8 s),
    the two lists, and two background recordings (3.5 s and 2.3 s)."""
    rng = np.random.default_rng(0)
    listed = {"validation": [], "test": []}
    for split, speakers in SPEAKERS.items():
        for s in speakers:
            for j, (word, hz) in enumerate(TONES.items()):
                n = 16_000 if j % 2 == 0 else 12_800
                t = np.arange(n) / 16_000
                rel = f"{word}/{s}_nohash_0.wav"
                write_wav(root / rel, 0.3 * np.sin(2 * np.pi * hz * t)
                          + 0.01 * rng.standard_normal(n))
                if split in listed:
                    listed[split].append(rel)
    (root / "validation_list.txt").write_text("\n".join(listed["validation"]) + "\n")
    (root / "testing_list.txt").write_text("\n".join(listed["test"]) + "\n")
    write_wav(root / "_background_noise_" / "white_noise.wav", 0.1 * rng.standard_normal(56_000))
    write_wav(root / "_background_noise_" / "running_tap.wav", 0.05 * rng.standard_normal(36_800))
    return root


@pytest.fixture(scope="module")
def speech_root(tmp_path_factory) -> Path:
    return make_archive(tmp_path_factory.mktemp("speech_commands_v0.02"))


def speech_run(cache_dir: str, root: Path, **kw) -> RunConfig:
    cfg = RunConfig(
        dataset=DatasetConfig(name="speech_commands", path=str(root)), backbone=TINY_AST,
        method=AccumulatorConfig(head_hidden=[16], parallel_adapter=True, adapter_bottleneck=4),
        partition=PartitionConfig(kind="natural", num_clients=4, fraction_fit=0.5,
                                  val_fraction=0.0, test_fraction=0.25),
        setting=SettingConfig(name="multitier"), train=TrainConfig(lr=0.05, batch_size=4),
        federation=FederationConfig(eval_every=1), rounds=2, cache_dir=cache_dir)
    for key, value in kw.items():
        setattr(cfg, key, value)
    return validate(cfg)


def label_of(ds, file: str) -> str:
    return CLASS_NAMES[ds["label"][ds["file"].index(file)]]


def test_archive_twelve_classes_silence_and_speaker_disjoint_splits(speech_root):
    dsd = load_archive(str(speech_root))
    assert dsd["train"].features["label"].names == list(CLASS_NAMES)
    assert len(CLASS_NAMES) == 12 and CLASS_NAMES[-2:] == ("_unknown_", "_silence_")
    train = dsd["train"]
    assert label_of(train, "yes/aa000001_nohash_0.wav") == "yes"
    assert label_of(train, "go/aa000002_nohash_0.wav") == "go"
    for word in ("bed", "visual"):  # every other word is unknown
        assert label_of(train, f"{word}/aa000003_nohash_0.wav") == "_unknown_"
    silence = CLASS_NAMES.index("_silence_")
    # one-second clips of the background recordings: white noise (3.5 s) trains,
    # running_tap (2.3 s) validates; none in the test split
    counts = {s: int(np.sum(np.asarray(dsd[s]["label"]) == silence)) for s in
              ("train", "validation", "test")}
    assert counts == {"train": 3, "validation": 2, "test": 0}
    assert (len(train), len(dsd["validation"]), len(dsd["test"])) == (24 + 3, 12 + 2, 12)
    speakers = {s: set(dsd[s]["speaker_id"]) for s in ("train", "validation", "test")}
    assert speakers == {s: set(v) for s, v in SPEAKERS.items()}  # silence has a split speaker
    assert not (speakers["train"] & speakers["validation"]) and not (
        speakers["train"] & speakers["test"]) and not (speakers["validation"] & speakers["test"])
    assert sorted(dsd["noise"]["file"]) == ["_background_noise_/running_tap.wav",
                                            "_background_noise_/white_noise.wav"]
    clip = train[train["file"].index(f"{'_background_noise_'}/white_noise.wav#0")]["audio"]
    assert len(read_wav(clip["bytes"], "silence clip")) == 16_000


def test_prepared_data_and_natural_partition_by_speaker(speech_root, cache_dir):
    from fedadapt.data.partition import partition_dataset

    prepared = prepare_dataset(DatasetConfig(name="speech_commands", path=str(speech_root)),
                               cache_dir, seed=0)
    assert (prepared.num_train, prepared.num_test, prepared.num_classes) == (27, 12, 12)
    assert prepared.columns == ("audio", "label", "client")
    dsd = prepared.load()
    assert sorted(dsd) == ["noise", "test", "train"]
    assert dsd["train"][0]["audio"]["bytes"][:4] == b"RIFF"  # embedded: no link to the folder
    part = partition_dataset(dsd["train"], PartitionConfig(kind="natural", num_clients=4,
                                                           val_fraction=0, test_fraction=0),
                             load_card("speech_commands"), seed=0)
    assert sorted(part.names) == SPEAKERS["train"]
    clients = np.asarray(dsd["train"]["client"])
    for name, split in zip(part.names, part.clients):
        assert set(clients[split.train]) == {name}
    assert sum(len(c) for c in part.clients) == 27  # silence clips belong to speakers too


def hub_copy(path: Path, archive: Path) -> Path:
    """google/speech_commands v0.02 as the hub has it (37 label names, long background rows
    labelled _silence_ without a speaker, the test set's one-second _silence_ clips), built
    from the generated archive and saved with save_to_disk."""
    from datasets import Audio, ClassLabel, Dataset, DatasetDict, Features, Value

    names = [*CLASS_NAMES[:10], "zero", "bed", "visual", "_unknown_", "_silence_"]
    features = Features({"file": Value("string"),
                         "audio": {"bytes": Value("binary"), "path": Value("string")},
                         "label": ClassLabel(names=names), "is_unknown": Value("bool"),
                         "speaker_id": Value("string"), "utterance_id": Value("int8")})

    def split(files: list[str], extra: list[tuple[str, Path]] = ()):
        rows = [(f, archive / f, f.split("/")[0], f.split("/")[1].split("_")[0]) for f in files]
        rows += [(f, p, "_silence_", None) for f, p in extra]
        ds = Dataset.from_dict({
            "file": [r[0] for r in rows],
            "audio": [{"bytes": r[1].read_bytes(), "path": r[0]} for r in rows],
            "label": [names.index(r[2]) for r in rows],
            "is_unknown": [r[2] not in CLASS_NAMES[:10] for r in rows],
            "speaker_id": [r[3] for r in rows], "utterance_id": [0] * len(rows)},
            features=features)
        return ds.cast_column("audio", Audio(sampling_rate=16_000))

    lists = {s: (archive / f"{s}_list.txt").read_text().split() for s in ("validation",
                                                                           "testing")}
    every = sorted(p.relative_to(archive).as_posix() for p in archive.glob("[!_]*/*.wav"))
    train = [f for f in every if f not in lists["validation"] and f not in lists["testing"]]
    bg = archive / "_background_noise_"
    one_second = path.parent / "silence_0.wav"
    write_wav(one_second, 0.02 * np.random.default_rng(1).standard_normal(16_000))
    DatasetDict(
        train=split(train, [("_background_noise_/white_noise.wav", bg / "white_noise.wav")]),
        validation=split(lists["validation"], [("_background_noise_/running_tap.wav",
                                                bg / "running_tap.wav")]),
        test=split(lists["testing"], [("_silence_/0.wav", one_second)])).save_to_disk(str(path))
    return path


def test_hub_copy_gives_the_same_twelve_class_form(speech_root, tmp_path):
    saved = hub_copy(tmp_path / "hub", speech_root)
    dsd = load_speech_commands(load_card("speech_commands"), str(saved))
    archive = load_archive(str(speech_root))
    for s in ("train", "validation"):
        assert sorted(zip(dsd[s]["file"], dsd[s]["label"], dsd[s]["speaker_id"])) == sorted(
            zip(archive[s]["file"], archive[s]["label"], archive[s]["speaker_id"]))
    test = dsd["test"]
    assert label_of(test, "_silence_/0.wav") == "_silence_"  # a one-second clip stays whole
    assert test["speaker_id"][test["file"].index("_silence_/0.wav")] in SPEAKERS["test"]
    assert len(dsd["noise"]) == 2


def test_bad_input_fails_with_one_line_naming_the_setting(speech_root, tmp_path, cache_dir):
    empty = tmp_path / "empty"
    (empty / "yes").mkdir(parents=True)
    for name in ("validation_list.txt", "testing_list.txt"):
        (empty / name).write_text("")
    with pytest.raises(ConfigError, match=r"dataset.path=.*no \.wav files"):
        load_archive(str(empty))
    with pytest.raises(ConfigError, match="validation_list.txt / testing_list.txt"):
        load_archive(str(tmp_path))
    with pytest.raises(ConfigError, match="no such folder"):
        load_archive(str(tmp_path / "missing"))
    saved = hub_copy(tmp_path / "hub", speech_root)
    from datasets import load_from_disk

    bad = load_from_disk(str(saved))
    bad["train"] = bad["train"].remove_columns(["speaker_id"])
    bad.save_to_disk(str(tmp_path / "hub_bad"))
    with pytest.raises(ConfigError, match=r"dataset.path=.*lacks column\(s\) \['speaker_id'\]"):
        load_speech_commands(load_card("speech_commands"), str(tmp_path / "hub_bad"))
    with pytest.raises(ConfigError, match="not a readable WAV file"):
        read_wav(b"RIFF....not a wav", "yes/x.wav")
    stereo = tmp_path / "stereo.wav"
    with wave.open(str(stereo), "wb") as w:
        w.setnchannels(2)
        w.setsampwidth(2)
        w.setframerate(16_000)
        w.writeframes(b"\0" * 400)
    with pytest.raises(ConfigError, match="stereo.wav is 16-bit, 2 channel"):
        read_wav(stereo.read_bytes(), str(stereo))


def test_modalities_must_match_and_personal_clients_need_a_model(speech_root, cache_dir):
    from fedadapt.experiment import prepare_run

    tiny_vit = BackboneConfig(name="tiny_vit", family="vit", image_size=32, arch=dict(
        patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64))
    with pytest.raises(ConfigError, match="backbone=tiny_vit is invalid for "
                                          "dataset=speech_commands: the data are audio"):
        prepare_run(speech_run(cache_dir, speech_root, backbone=tiny_vit), quiet=True)
    digits = DatasetConfig(name="digits", max_samples=50)
    with pytest.raises(ConfigError, match="backbone=tiny_ast is invalid for dataset=digits"):
        prepare_run(speech_run(cache_dir, speech_root, dataset=digits,
                               partition=PartitionConfig(kind="iid", num_clients=2)), quiet=True)
    personal = DatasetConfig(name="speech_commands_personal", path=str(speech_root),
                             test_fraction=0.0)
    with pytest.raises(ConfigError, match="setting.init_from"):
        prepare_run(speech_run(cache_dir, speech_root, dataset=personal), quiet=True)
    image_kinds = SettingConfig(name="personalization", init_from="x")
    with pytest.raises(ConfigError, match=r"setting.corruptions=.*background_noise"):
        prepare_run(speech_run(cache_dir, speech_root, setting=image_kinds), quiet=True)


@pytest.mark.filterwarnings("ignore:At least one mel filter")  # AST's 128 bins, 512-point FFT
def test_spectrograms_through_the_real_extractor_once(speech_root, cache_dir):
    from transformers import ASTFeatureExtractor

    from fedadapt.backbones import build_backbone
    from fedadapt.data.audio import AudioPreprocess, spectrogram_store, store_key, waveforms
    from fedadapt.data.integrity import sidecar

    prepared = prepare_dataset(DatasetConfig(name="speech_commands", path=str(speech_root)),
                               cache_dir, seed=0)
    pre = AudioPreprocess.for_backbone(build_backbone(TINY_AST))
    assert (pre.num_mel_bins, pre.max_length, pre.mean, pre.std) == (128, 128, -6.845978,
                                                                     5.5654526)
    store = spectrogram_store(prepared, "train", pre, cache_dir)
    rows = store.array()
    assert rows.shape == (27, 128, 128) and rows.dtype == np.float16
    assert Path(sidecar(store.path)).is_file()  # sealed with its SHA-256
    waves = waveforms(prepared.path, "train", range(3), 16_000)
    ref = ASTFeatureExtractor(num_mel_bins=128, max_length=128, mean=-6.845978, std=5.5654526)(
        waves, sampling_rate=16_000, return_tensors="np")["input_values"]
    np.testing.assert_allclose(rows[:3].astype(np.float32), ref, rtol=2e-3, atol=2e-3)
    mtime = Path(store.path).stat().st_mtime_ns
    assert Path(spectrogram_store(prepared, "train", pre, cache_dir).path).stat(
    ).st_mtime_ns == mtime  # built once
    assert store_key(prepared, "train", replace(pre, mean=-4.27)) != store_key(
        prepared, "train", pre)


def test_background_noise_is_seeded_per_client_and_reaches_the_spectrogram(speech_root,
                                                                           cache_dir):
    from fedadapt.data.corruptions import assign_corruptions, mix_background_noise
    from fedadapt.experiment import prepare_run

    noise = [np.linspace(-0.5, 0.5, 40_000, dtype=np.float32)]
    clip = [np.zeros(16_000, np.float32)]
    mixed = mix_background_noise(clip, "background_noise", 3, seed=1, indices=[5], noise=noise)
    again = mix_background_noise(clip, "background_noise", 3, seed=1, indices=[5], noise=noise)
    other = mix_background_noise(clip, "background_noise", 3, seed=2, indices=[5], noise=noise)
    start = int(np.flatnonzero(np.isclose(noise[0], mixed[0][0] / 0.6, atol=1e-6))[0])
    np.testing.assert_allclose(mixed[0], 0.6 * noise[0][start:start + 16_000], atol=1e-6)
    assert np.array_equal(mixed[0], again[0]) and not np.array_equal(mixed[0], other[0])
    assert assign_corruptions(3, 0, kinds=["background_noise"], severities=[3]) == [
        ("background_noise", 3)] * 3
    src = prepare_run(speech_run(cache_dir, speech_root), quiet=True).spec.train_source
    assert src.modality == "audio"
    idx = np.arange(5)
    clean, _ = src.get(idx)
    noisy = src.corrupted("background_noise", 3, seed=7)
    a, _ = noisy.get(idx)
    assert a.shape == clean.shape == (5, 128, 128)
    assert torch.equal(a, noisy.get(idx)[0]) and not torch.equal(a, clean)
    assert not torch.equal(a, src.corrupted("background_noise", 3, seed=8).get(idx)[0])
    assert torch.equal(src.corrupted("background_noise", 0, seed=7).get(idx)[0], clean)


def test_spectrogram_crop_is_seeded(speech_root, cache_dir):
    from fedadapt.experiment import prepare_run

    src = prepare_run(speech_run(cache_dir, speech_root), quiet=True).spec.train_source
    idx = np.arange(4)
    clean, _ = src.get(idx)

    def cropped(seed):
        return src.get(idx, crop=((0.05, 1.0), np.full(len(idx), seed, np.uint64)))[0]

    a = cropped(1)
    assert a.shape == clean.shape and not torch.equal(a, clean)
    assert torch.equal(a, cropped(1)) and not torch.equal(a, cropped(2))
    whole = src.get(idx, crop=((1.0, 1.0), np.zeros(len(idx), np.uint64)))[0]
    torch.testing.assert_close(whole, clean, atol=1e-3, rtol=1e-3)  # the full box: unchanged


@pytest.mark.slow
def test_accumulator_on_a_tiny_ast_end_to_end(speech_root, cache_dir, tmp_path):
    from fedadapt.experiment import run_experiment
    from fedadapt.federation.simulation.inprocess import run_in_process

    cfg = speech_run(cache_dir, speech_root, setting=SettingConfig(name="multitier"))
    cfg.train.crop_scale = [0.05, 1.0]
    summary = run_experiment(cfg, tmp_path / "mt", config_yaml="mt\n", execute=run_in_process)
    final = summary["final"]
    assert len(final["exit_acc"]) == 2 and summary["tiers"] == {"0": 2, "1": 2}
    assert summary["partition_stats"]["num_clients"] == 4
    # Table 4's protocol: the validation speakers personalize that model on noisy clips
    personal = replace(cfg, dataset=DatasetConfig(name="speech_commands_personal",
                                                  path=str(speech_root), test_fraction=0.0),
                       partition=PartitionConfig(kind="natural", num_clients=2,
                                                 val_fraction=0.0, test_fraction=0.5),
                       setting=SettingConfig(name="personalization", personalize="client_token",
                                             epochs=1, corruptions=["background_noise"],
                                             severities=[3], init_from=str(tmp_path / "mt")))
    s2 = run_experiment(validate(personal), tmp_path / "pers", config_yaml="p\n",
                        execute=run_in_process)
    assert s2["personalization"]["clients"] == 2
    rows = json.loads((tmp_path / "pers" / "personalization.json").read_text())
    assert {(r["corruption"], r["severity"]) for r in rows} == {("background_noise", 3)}
    names = json.loads((tmp_path / "pers" / "partition.json").read_text())["per_client"]
    assert sorted(c["name"] for c in names) == SPEAKERS["validation"]


def test_speech_presets_follow_the_paper():
    from fedadapt.entry import compose_config, to_run_config

    rounds = {"conventional": 500, "anytime": 1500, "multitier": 1500}
    for setting, n in rounds.items():
        run = to_run_config(compose_config([f"experiment=acc_speech_{setting}"]))
        p, t = run.partition, run.train
        assert (run.dataset.name, run.backbone.name, run.setting.name) == (
            "speech_commands", "ast_deit_small", setting)
        assert (p.kind, p.num_clients, p.fraction_fit, run.rounds) == ("natural", 2112, 0.01, n)
        assert (t.optimizer, t.lr, t.batch_size, t.local_epochs, t.cosine) == (
            "sgd", 0.005, 10, 1, True)
        assert (p.val_fraction, p.test_fraction, p.fraction_evaluate) == (0, 0, 0)
    run = to_run_config(compose_config(["experiment=acc_speech_personalization"]))
    st = run.setting
    assert (run.dataset.name, run.partition.num_clients, run.partition.test_fraction) == (
        "speech_commands_personal", 256, 0.5)
    assert (st.corruptions, st.severities, st.personal_split, st.epochs) == (
        ["background_noise"], [3], "train", 10)


def test_prefetch_names_what_it_fetches(monkeypatch):
    import datasets
    import fedadapt.backbones as backbones
    from fedadapt.entry import compose_config, to_run_config
    from fedadapt.prefetch import prefetch

    calls = []
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: calls.append((a, k)))
    monkeypatch.setattr(backbones, "build_backbone", lambda cfg, load_weights: calls.append(
        cfg.weights))
    run = to_run_config(compose_config(["dataset=speech_commands", "backbone=ast_deit_small"]))
    lines = prefetch(run)
    assert calls == [(("google/speech_commands", "v0.02"), {"revision": "refs/pr/5"}),
                     "facebook/deit-small-patch16-224"]
    assert "google/speech_commands (config v0.02, revision refs/pr/5)" in lines[0]
    assert "facebook/deit-small-patch16-224" in lines[1] and "AST" in lines[1]
