"""Labels never leave a device: every reply of a tiny run of each method is inspected at the
message level (every record, whatever its name) for per-sample labels, raw features of test
data and personal tensors; server training reads only the training clients' train and val
features. The runs go through the real server and ClientApp, in process
(:func:`fedadapt.federation.simulation.inprocess.run_in_process`)."""

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import TINY_CLIP, tiny_run
from flwr.app import ArrayRecord, Message, MessageType, Metadata, MetricRecord, RecordDict

from fedadapt.adapters import load_methods
from fedadapt.adapters.bitfit import BitfitConfig
from fedadapt.adapters.exits import AccumulatorConfig, LwLinearConfig, LwMlpConfig
from fedadapt.adapters.fedclip import FedClipConfig
from fedadapt.adapters.heads import (
    FinetuneConfig,
    LinearHeadConfig,
    LocalOnlyConfig,
    MlpHeadConfig,
)
from fedadapt.adapters.ia3 import Ia3MethodConfig
from fedadapt.adapters.lora import DoraMethodConfig, LoraMethodConfig
from fedadapt.config import (
    BackboneConfig,
    DatasetConfig,
    PartitionConfig,
    SettingConfig,
    validate,
)
from fedadapt.data.sources import DataSource
from fedadapt.experiment import prepare_run, run_experiment
from fedadapt.federation.simulation.inprocess import run_in_process
from fedadapt.federation.wire.audit import Secrets, audit, leaks, secrets_of
from fedadapt.methods.plugin.iciia import IciiaConfig
from fedadapt.methods.rounds.clients import PERSONAL_KEY
from fedadapt.methods.sessions.cdc_mmpg import CdcMmpgConfig
from fedadapt.methods.sessions.duet import DuetConfig
from fedadapt.methods.sessions.train import client_sessions, train_generator, upload_key

TINY_VIT = BackboneConfig(name="tiny_vit", family="vit", image_size=32, arch=dict(
    patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
    intermediate_size=64))
SERVER = dict(max_epochs=2, patience=2, classifier_epochs=2)
SESSION_PARTITION = PartitionConfig(kind="dirichlet", num_clients=4, alpha=0.5,
                                    min_partition_size=20, val_fraction=0.2, test_fraction=0.2)


@pytest.fixture(scope="module")
def binary_data(tmp_path_factory) -> str:
    """A two-class task (scikit-learn's digits 0 and 1) as a local copy for a card whose class
    count the data decides: DUET's and CDC-MMPG's clients then report AUCs."""
    from sklearn.datasets import load_digits

    from datasets import ClassLabel, Dataset, DatasetDict, Features, Image, Value

    bunch = load_digits(n_class=2)  # the global test split: dataset.test_fraction of it
    images = (bunch.images * (255 / 16)).round().astype(np.uint8)
    features = Features({"image": Image(), "label": ClassLabel(names=["zero", "one"]),
                         "user_id": Value("string")})

    def split(idx):
        return Dataset.from_dict({"image": list(images[idx]),
                                  "label": bunch.target[idx].tolist(),
                                  "user_id": [str(i % 5) for i in idx]}, features=features)

    folder = tmp_path_factory.mktemp("binary") / "digits01"
    n = len(images)
    # one split: iNaturalist's card turns a test split into unseen test users
    DatasetDict(train=split(np.arange(n))).save_to_disk(str(folder))
    return str(folder)


def runs(cache_dir, binary_data):
    """One tiny run of every method (and the settings that keep tensors on the clients)."""
    heads = [(m, tiny_run(cache_dir, m)) for m in
             (LinearHeadConfig(), MlpHeadConfig(), FinetuneConfig(), LocalOnlyConfig())]
    exits = []
    for m, setting in ((LwLinearConfig(), SettingConfig(name="multitier")),
                       (LwMlpConfig(), SettingConfig(name="anytime")),
                       (AccumulatorConfig(), SettingConfig(name="personalization",
                                                           personalize="client_token",
                                                           epochs=1, severities=[0]))):
        cfg = tiny_run(cache_dir, m, backbone=TINY_VIT, setting=setting)
        exits.append((m, cfg))
    fedclip = [(FedClipConfig(), tiny_run(cache_dir, FedClipConfig(), backbone=TINY_CLIP))]
    # the PEFT methods: a personal LoRA (it must never leave its client), LoRA per tier
    peft = [(m, tiny_run(cache_dir, m, backbone=TINY_VIT, setting=setting)) for m, setting in (
        (LoraMethodConfig(rank=2, personal=True), SettingConfig()),
        (LoraMethodConfig(rank=2, exits=True, ffa=True), SettingConfig(name="multitier")),
        (DoraMethodConfig(rank=2), SettingConfig()), (Ia3MethodConfig(), SettingConfig()),
        (BitfitConfig(), SettingConfig()))]
    iciia = [(m, tiny_run(cache_dir, m, partition=SESSION_PARTITION)) for m in
             [IciiaConfig(images=4, min_history=1, finetune_epochs=1, **SERVER)]]
    binary = DatasetConfig(name="inaturalist", path=binary_data)
    sessions = [(m, tiny_run(cache_dir, m, dataset=binary, partition=SESSION_PARTITION))
                for m in (DuetConfig(session=4, generators=2, finetune_steps=2, **SERVER),
                          DuetConfig(session=4, generators=2, finetune_steps=2, auc_bins=32,
                                     **SERVER),
                          CdcMmpgConfig(adr_epochs=1, finetune_steps=2, auc_bins=32,
                                        **SERVER))]
    listed = heads + exits + fedclip + peft + iciia + sessions
    # a method added since (docs/adding-a-method.md) is audited with its defaults on the tiny run
    named = {m.name for m, _ in listed}
    added = [(spec.config_cls(), tiny_run(cache_dir, spec.config_cls()))
             for name, spec in sorted(load_methods().items())
             if name not in named and spec.build.__module__.startswith("fedadapt.")]
    return listed + added


def run_and_audit(cfg, run_dir: Path) -> tuple[list[str], list[tuple], Secrets]:
    prep = prepare_run(validate(cfg), quiet=True)
    spec = prep.spec
    sessions = ((lambda cid: client_sessions(spec, cid))
                if load_methods()[cfg.method.name].family == "sessions" else None)
    secrets = secrets_of(spec, sessions)
    exchanges = []

    def on_reply(sent, reply, context):
        exchanges.append((sent, reply))
        if PERSONAL_KEY in context.state.array_records:
            for name, t in context.state.array_records[PERSONAL_KEY].to_torch_state_dict() \
                    .items():
                secrets.add_personal(name, t)

    run_experiment(cfg, run_dir, config_yaml="x\n", prepared=prep,
                   execute=lambda plan, app: run_in_process(plan, app, on_reply=on_reply))
    from safetensors.torch import load_file

    for f in (run_dir / "clients").rglob("*.safetensors"):  # kept on the client's disk
        personalized = f.parent.name == "personalized"  # copies of communicated tensors
        for name, t in load_file(str(f)).items():
            secrets.add_personal(name, t, by_name=not personalized)

    def allowed(sent, record, key):  # a session plug-in's declared upload: its embeddings
        config = sent.content.config_records.get("config")
        return (config is not None and config.get("phase") == "session-upload"
                and record.split("/")[-1].startswith("session.")  # c<id>/session.<k>
                and key == upload_key(cfg.method))

    return audit(exchanges, secrets, allowed), exchanges, secrets


@pytest.mark.slow
def test_no_reply_of_any_method_carries_labels_test_features_or_personal_tensors(
        cache_dir, binary_data, tmp_path):
    seen, problems = set(), []
    for i, (method, cfg) in enumerate(runs(cache_dir, binary_data)):
        found, exchanges, secrets = run_and_audit(cfg, tmp_path / f"run{i}")
        problems += [f"{method.name}: {p}" for p in found]
        seen.add(method.name)
        kinds = {sent.metadata.message_type for sent, _ in exchanges}
        assert MessageType.QUERY in kinds and len(exchanges) > cfg.partition.num_clients
        if method.name == "local_only" or getattr(method, "personal", False):
            assert secrets.personal  # there was something to find
        if method.name == "accumulator":  # the personalized client tokens, kept on disk
            assert len(secrets.personal) >= cfg.partition.num_clients
        if method.name in ("duet", "cdc_mmpg"):
            assert secrets.num_classes == 2 and secrets.feature_rows
            predicted = [r for s, r in exchanges for m in r.content.metric_records.values()
                         if "auc_generated" in m]
            assert predicted  # the clients computed their AUCs themselves
    # every method fedadapt ships (other test modules may register their own)
    assert seen == {n for n, m in load_methods().items()
                    if m.build.__module__.startswith("fedadapt.")}
    assert problems == []


def reply_with(**records) -> Message:
    meta = Metadata(run_id=1, message_id="", src_node_id=1, dst_node_id=0,
                    reply_to_message_id="m", group_id="", created_at=0.0, ttl=60.0,
                    message_type=MessageType.EVALUATE)
    return Message(content=RecordDict(records), metadata=meta)


def test_the_inspector_finds_what_used_to_leak(cache_dir, flower_task):
    """The old binary-task reply (``scores:labels``), test features and a personal tensor are
    each found, in any record and under any name."""
    prep = prepare_run(tiny_run(cache_dir, LinearHeadConfig()), quiet=True)
    spec = prep.spec
    secrets = secrets_of(spec)
    labels, feats = spec.train_source.labels(), spec.train_source.features()
    test = np.asarray(spec.clients[1].test)
    order = np.random.default_rng(0).permutation(test)
    token = torch.randn(8)
    secrets.add_personal("head.client_token", token)
    assert leaks(reply_with(metrics=MetricRecord({"accuracy": 0.5, "n": 3})), secrets) == []
    cases = {
        "labels": reply_with(scores=ArrayRecord({"labels": torch.tensor(labels[order]).float(),
                                                 "generated": torch.rand(len(order))})),
        "renamed labels": reply_with(**{"client.1": ArrayRecord(
            {"v": torch.tensor(labels[order])})}),
        "one-hot labels": reply_with(out=ArrayRecord({"v": torch.nn.functional.one_hot(
            torch.tensor(labels[test]), spec.num_classes)})),
        "labels in a metric": reply_with(m=MetricRecord({"v": labels[test].tolist()})),
        "test features": reply_with(x=ArrayRecord({"e": torch.tensor(
            np.asarray(feats[test[:3]]))})),
        "personal tensor": reply_with(x=ArrayRecord({"w": token.clone()})),
    }
    for what, message in cases.items():
        assert leaks(message, secrets), what
    train_rows = reply_with(x=ArrayRecord({"e": torch.tensor(np.asarray(
        feats[spec.clients[1].train[:3]]))}))
    assert leaks(train_rows, secrets) == []  # only test data is secret here


@dataclasses.dataclass(frozen=True)
class WatchedSource(DataSource):
    """A feature source that records every index read through it."""

    read: list = dataclasses.field(default_factory=list, compare=False)

    def get(self, indices, device="cpu", crop=None):
        self.read.extend(np.asarray(indices).tolist())
        return super().get(indices, device, crop)


@pytest.mark.parametrize("method", [
    IciiaConfig(images=4, min_history=1, finetune_epochs=0, **SERVER),
    DuetConfig(session=4, generators=2, **SERVER),
    CdcMmpgConfig(adr_epochs=1, **SERVER),
], ids=["iciia", "duet", "cdc_mmpg"])
def test_server_training_reads_only_training_clients_train_and_val(cache_dir, method):
    from fedadapt.methods.plugin.train import train_on_server

    cfg = validate(tiny_run(cache_dir, method, partition=dataclasses.replace(
        SESSION_PARTITION, test_clients=0.25)))
    spec = prepare_run(cfg, quiet=True).spec
    src = spec.train_source
    spec.train_source = WatchedSource(**{f.name: getattr(src, f.name)
                                         for f in dataclasses.fields(DataSource)})
    (train_on_server if isinstance(method, IciiaConfig) else train_generator)(spec)
    read = set(spec.train_source.read)
    allowed = {int(i) for c in spec.clients for i in np.concatenate([c.train, c.val])}
    test = {int(i) for c in spec.clients for i in c.test}
    assert read and read <= allowed and not read & test
