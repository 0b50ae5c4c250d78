"""fedadapt-pretrain: a ViT trained from scratch is saved in the Hugging Face format, loads back
through ``backbone.weights=<dir>`` with the same weights and normalisation, and an existing
output folder is refused unless forced."""

import json
import math

import pytest
import torch

from fedadapt.backbones import build_backbone
from fedadapt.config import BackboneConfig, ConfigError
from fedadapt.entry import compose_config, to_run_config
from fedadapt.pretrain import PRETRAIN_JSON, _main, pretrain, save_backbone, train_backbone

TINY = ["backbone=tiny_vit", "dataset=digits", "dataset.max_samples=200"]
KEYS = {"dataset", "backbone", "arch", "epochs", "lr", "batch_size", "seed", "test_acc",
        "final_test_acc", "train_samples", "wall_s", "versions", "image_mean", "image_std"}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One torch thread: far faster for these tiny models on a busy 2-core machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def tiny_run(cache_dir, *extra):
    return to_run_config(compose_config([*TINY, f"cache_dir={cache_dir}", *extra]))


@pytest.fixture(scope="module")
def trained(cache_dir, tmp_path_factory):
    """(run, trained backbone, saved folder): one epoch on 200 digits."""
    run = tiny_run(cache_dir)
    backbone, info = train_backbone(run, epochs=1, lr=1e-3, batch_size=64, log=lambda m: None)
    out = save_backbone(backbone, info, tmp_path_factory.mktemp("pretrain") / "tiny_vit")
    return run, backbone, out


def test_pretrain_json_records_the_training(trained):
    _, _, out = trained
    info = json.loads((out / PRETRAIN_JSON).read_text())
    assert KEYS <= set(info)
    assert info["dataset"] == "digits" and info["backbone"] == "tiny_vit"
    assert info["epochs"] == 1 and info["train_samples"] == 200 and len(info["test_acc"]) == 1
    assert info["final_test_acc"] == info["test_acc"][-1]  # the last epoch's, not a range
    assert math.isfinite(info["final_test_acc"]) and info["final_test_acc"] > 0
    assert {"torch", "transformers"} <= set(info["versions"])
    assert [p.name for p in out.parent.iterdir()] == [out.name]  # no temporary folder left


def test_saved_weights_load_as_the_backbone(trained):
    run, backbone, out = trained
    cfg = BackboneConfig(name="tiny_vit", family="vit", weights=str(out), image_size=32)
    loaded = build_backbone(cfg)
    assert loaded.weights_id == str(out) and loaded.num_layers == backbone.num_layers
    want, got = backbone.state_dict(), loaded.state_dict()
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want)
    fresh = build_backbone(run.backbone, load_weights=False).state_dict()
    assert any(not torch.equal(fresh[k], got[k]) for k in got)  # it was trained
    assert loaded.mean == backbone.mean and loaded.std == backbone.std
    config = json.loads((out / "config.json").read_text())
    assert config["image_mean"] == list(backbone.mean)
    assert config["image_std"] == list(backbone.std)
    x = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(loaded(x), backbone(x))


def test_cli_writes_once_and_refuses_an_existing_out(cache_dir, tmp_path):
    out = tmp_path / "vit"
    args = [*TINY, f"cache_dir={cache_dir}", "--epochs", "1", "--batch-size", "64",
            "--out", str(out)]
    assert _main(args) == 0
    assert (out / PRETRAIN_JSON).is_file() and (out / "config.json").is_file()
    stamp = (out / PRETRAIN_JSON).stat().st_mtime_ns
    with pytest.raises(ConfigError, match="exists already; pass --force"):
        _main(args)
    assert (out / PRETRAIN_JSON).stat().st_mtime_ns == stamp
    assert _main([*args, "--force"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["vit"]


@pytest.mark.parametrize("extra,kwargs,needle", [
    ([], {"epochs": 0}, "--epochs=0 is invalid"),
    ([], {"lr": 0.0}, "--lr=0.0 is invalid"),
    ([], {"lr": float("nan")}, "--lr=nan is invalid"),
    (["backbone=small_cnn"], {}, "backbone.family='small_cnn' is invalid"),
])
def test_bad_options_fail_naming_the_option(cache_dir, tmp_path, extra, kwargs, needle):
    run = tiny_run(cache_dir, *extra)
    opts = {"epochs": 1, "lr": 1e-3, "batch_size": 64, **kwargs}
    with pytest.raises(ConfigError, match=needle):
        pretrain(run, out=tmp_path / "vit", **opts)
    assert not any(tmp_path.iterdir())


def test_altered_weights_are_refused_naming_the_file(trained, tmp_path):
    """The saved folder is sealed: a weight file changed in place (same size) is refused on
    load with one line naming it, before any run uses it."""
    import shutil

    from fedadapt.data.integrity import SEAL, CacheIntegrityError

    _, _, out = trained
    assert (out / SEAL).is_file()
    copy = shutil.copytree(out, tmp_path / "tiny_vit")
    weights = copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0xFF
    weights.write_bytes(bytes(data))
    cfg = BackboneConfig(name="tiny_vit", family="vit", weights=str(copy), image_size=32)
    with pytest.raises(CacheIntegrityError, match="model.safetensors: content differs"):
        build_backbone(cfg)


def test_pretraining_again_gives_the_same_weights(trained):
    """The same run pretrains the same bytes: a backbone in the cache can be made again; and
    evaluating on fewer test samples (``test_samples``) changes what is recorded, not what is
    trained."""
    run, backbone, out = trained
    again, info = train_backbone(run, epochs=1, lr=1e-3, batch_size=64, test_samples=7,
                                 log=lambda m: None)
    want, got = backbone.state_dict(), again.state_dict()
    assert all(torch.equal(want[k], got[k]) for k in want)
    assert info["test_samples"] == 7 < json.loads((out / PRETRAIN_JSON).read_text())["test_samples"]
    assert round(info["final_test_acc"] * 7, 9) == int(round(info["final_test_acc"] * 7))


def test_a_run_records_which_weights_it_read(trained, cache_dir):
    """``backbone_weights`` in the summary is a hash of the weights themselves: the pretrained
    folder and the random init it started from differ, the same folder read twice does not."""
    from fedadapt.data.cache import backbone_fingerprint
    from fedadapt.experiment import prepare_run

    _, backbone, out = trained
    common = ["method=linear_head", "method.use_cache=false", "partition.num_clients=2"]
    loaded = prepare_run(tiny_run(cache_dir, *common, f"backbone.weights={out}"), quiet=True)
    assert loaded.backbone_weights == backbone_fingerprint(backbone)
    again = prepare_run(tiny_run(cache_dir, *common, f"backbone.weights={out}"), quiet=True)
    assert again.backbone_weights == loaded.backbone_weights
    fresh = prepare_run(tiny_run(cache_dir, *common), quiet=True)
    assert fresh.backbone_weights != loaded.backbone_weights
