"""One run: prepare data and features, then hand the run to its method's family.

:func:`prepare_run` does everything before Flower starts (and fails fast on bad input, before
anything is written); :func:`run_experiment` hands the prepared run to the family of its method
(:mod:`fedadapt.methods`), which trains, serves and writes the run directory with the helpers
of :mod:`fedadapt.methods.run` (the run directory's partition, tracker, summary head and tail,
the simulation's nodes).
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Callable, Optional

from fedadapt.adapters import method_spec
from fedadapt.config import ConfigError, RunConfig
from fedadapt.data.partition import Partition
from fedadapt.federation.client.training import RunSpec, SpecRef
from fedadapt.log import log
from fedadapt.methods import Family, family_of
from fedadapt.methods.run import PreparedRun
from fedadapt.pfl.kinds import client_rule
from fedadapt.strategies.checks import check_strategy
from fedadapt.strategies.registry import sample_level


def prepare_run(cfg: RunConfig, *, quiet: bool = False) -> PreparedRun:
    """Load and partition the data, build the backbone and (if used) the feature cache."""
    from fedadapt.backbones import build_backbone
    from fedadapt.data.cache import backbone_fingerprint, cached_features
    from fedadapt.data.catalogue import load_card
    from fedadapt.data.loading import prepare_dataset
    from fedadapt.data.partition import cached_partition, format_stats
    from fedadapt.data.sources import DataSource, input_source
    from fedadapt.devices import resolve_precision, run_device, setup
    from fedadapt.federation.client.training import build_run_model
    from fedadapt.progress import quiet_libraries
    from fedadapt.tracking import check_available

    check_available(cfg.tracking)
    quiet_libraries()
    dev = run_device(cfg.federation.num_gpus)
    precision = resolve_precision(cfg.train.precision, dev)
    setup(dev, cfg.train.deterministic)  # before any work on the device (features, phases)
    card = load_card(cfg.dataset.name)
    family = family_of(cfg.method)  # looked up once: the checks, the phases and the run read it
    _check_method_settings(cfg, card, family)
    prepared = prepare_dataset(cfg.dataset, cfg.cache_dir, cfg.seed)
    partition = cached_partition(prepared, cfg.partition, card, cfg.seed, cfg.cache_dir)
    if not quiet:
        log(f"[data] {card.name}: {prepared.num_train} train / {prepared.num_test} test samples, "
            f"{prepared.num_classes} classes | {format_stats(partition.stats)}")
    backbone = build_backbone(cfg.backbone)
    class_text = _class_text(cfg, backbone, prepared.class_names)

    def images(split: str) -> DataSource:  # decoded once into the store, transformed on device
        return input_source(card, backbone, prepared, split, cfg.cache_dir,
                            backbone_name=cfg.backbone.name)

    def source(split: str) -> DataSource:
        if cfg.method.use_cache:
            path = cached_features(backbone, images(split), cfg.cache_dir, device=dev,
                                   precision=precision, weights=weights)
            return DataSource(prepared, split, features_path=path)
        return images(split)

    original = None
    if cfg.original.train_backbone:  # the papers' original model: a server-side phase first
        original = _original_phase(cfg, family, backbone, images("train"), partition,
                                   prepared, dev)
        backbone = build_backbone(original.backbone)  # the trained one: its features are cached
    weights = backbone_fingerprint(backbone)  # hashed once: the summary and the feature keys
    spec = RunSpec(run_id=uuid.uuid4().hex, method=cfg.method,
                   backbone=original.backbone if original else cfg.backbone,
                   train=cfg.train, seed=cfg.seed, rounds=cfg.rounds,
                   num_classes=prepared.num_classes, embed_dim=backbone.embed_dim,
                   train_source=source("train"),
                   # server-trained methods serve the clients' own test splits only
                   test_source=source("test") if family.clients_train else None,
                   clients=partition.clients, faults=cfg.faults, setting=cfg.setting,
                   class_text=class_text,
                   evaluate_val=cfg.federation.select == "best_val" or cfg.objective is not None,
                   device=dev, precision=precision,
                   compile=resolve_compile(cfg.federation.compile, dev),
                   client_threads=max(1, int(cfg.federation.num_cpus or 1)),
                   pfl=cfg.pfl, rule=client_rule(cfg))
    model = build_run_model(spec, backbone)
    spec.dpsgd = _dpsgd_plan(cfg, spec, model)
    counts = {
        "backbone_params": backbone.num_params(),
        "trainable_params": model.count(model.trainable_names()),
        "communicated_params": model.count(model.communicated_names()),
    }
    prep = PreparedRun(spec=spec, partition=partition, model=model, counts=counts,
                       backbone_weights=weights, method_family=family)
    family.prepare(cfg, prep, backbone=backbone, images=images, original=original)
    return prep


def _dpsgd_plan(cfg: RunConfig, spec: RunSpec, model):
    """``dp=dpsgd``'s plan of each client's noise and delta (its trained modules checked
    first, and Opacus's per-sample gradients tried on two examples); None without it."""
    from fedadapt.strategies.privacy import dpsgd_plan
    from fedadapt.strategies.registry import sample_level

    if not sample_level(cfg.dp):
        return None
    from fedadapt.federation.client.dpsgd import probe, refuse_untrainable

    refuse_untrainable(model, cfg.method.name)
    probe(model, spec.train_source, spec.clients[0].train, cfg.method.name)
    return dpsgd_plan(cfg.dp, [len(c.train) for c in spec.clients],
                      batch_size=cfg.train.batch_size, local_epochs=cfg.train.local_epochs,
                      rounds=cfg.rounds)


def _class_text(cfg: RunConfig, backbone, class_names):
    """The class prompts through a CLIP backbone's frozen text tower, for methods registered
    with ``uses_text``; None for the others."""
    from fedadapt.backbones.clip import class_text

    if not method_spec(cfg.method).uses_text:
        return None
    return class_text(backbone, class_names, cfg.method.prompt)


def _check_method_settings(cfg: RunConfig, card, family: Family) -> None:
    """Settings that hold only for some methods (before anything is loaded)."""
    # also checked where the config is validated (fedadapt.config.validate); here for runs
    # built in Python
    check_strategy(cfg)
    if card.personalize_only and not (cfg.setting.kind.personal_phase
                                      and cfg.setting.init_from):
        raise ConfigError(f"dataset={card.name} holds personalization clients only: it needs "
                          f"setting=personalization with setting.init_from=<a multi-tier run "
                          f"directory> (the model is federated on another data set, e.g. "
                          f"experiment=acc_speech_multitier)")
    if sample_level(cfg.dp) and not family.clients_train:
        raise ConfigError(f"dp={cfg.dp.name} is invalid for method={cfg.method.name}: DP-SGD "
                          f"runs in the clients' local training of the rounds, and this "
                          f"method's clients train none")
    if cfg.secagg.name != "none" and not family.clients_train:
        raise ConfigError(f"secagg={cfg.secagg.name} is invalid for method={cfg.method.name}: "
                          f"it aggregates the rounds of a method the clients train "
                          f"(linear_head, lora, ...), and this one has none")
    if (cfg.pfl.keeps or cfg.pfl.norms or client_rule(cfg) is not None) \
            and not family.clients_train:
        raise ConfigError(f"pfl={cfg.pfl.name} / strategy={cfg.strategy.name} is invalid for "
                          f"method={cfg.method.name}: it changes the clients' local training in "
                          f"the rounds, and this method's clients train none")
    family.check(cfg, card)
    _check_clients_without_training(cfg, card, family)
    if cfg.federation.select == "best_val" and cfg.partition.val_fraction == 0:
        raise ConfigError("federation.select=best_val picks the round by the clients' "
                          "validation accuracy: it needs partition.val_fraction > 0")


def _check_clients_without_training(cfg: RunConfig, card, family: Family) -> None:
    """Clients with no training data (unseen test clients, validation clients, a data set's
    held-out test users) only server-trained methods serve; a validation objective needs
    clients that train."""
    if cfg.partition.test_clients > 0 and family.clients_train:
        raise ConfigError(f"partition.test_clients={cfg.partition.test_clients} is invalid for "
                          f"method={cfg.method.name}: unseen test clients have no training "
                          f"data, only server-trained methods (iciia_b, duet, cdc_mmpg, ...) can "
                          f"serve them")
    if cfg.partition.val_clients > 0 and family.clients_train:
        raise ConfigError(f"partition.val_clients={cfg.partition.val_clients} is invalid for "
                          f"method={cfg.method.name}: validation clients have no training data, "
                          f"only server-trained methods (iciia_b, duet, cdc_mmpg, ...) use them")
    if card.test_split_clients and family.clients_train:
        raise ConfigError(f"dataset={card.name} is invalid for method={cfg.method.name}: its "
                          f"test split is held-out users (unseen clients without training "
                          f"data), which only server-trained methods (iciia_b, duet, cdc_mmpg, "
                          f"...) can serve")
    if cfg.objective is not None and not family.clients_train:
        raise ConfigError(f"objective={cfg.objective} is invalid for method={cfg.method.name}: "
                          f"a validation objective is measured on the clients' validation "
                          f"splits during the rounds; this method is trained on the server")


def _original_phase(cfg: RunConfig, family: Family, backbone, images, partition: Partition,
                    prepared, device):
    """``original.train_backbone``: the backbone and its classifier trained on the training
    clients' pooled images (:mod:`fedadapt.federation.server.original`), once per data and
    settings."""
    from fedadapt.federation.server.original import original_model

    if family.clients_train:
        raise ConfigError(f"original.train_backbone=true is invalid for method="
                          f"{cfg.method.name}: it trains the original model of the "
                          f"server-trained methods (iciia_b, iciia_t, duet, cdc_mmpg, ...)")
    return original_model(backbone, cfg.backbone, images, partition.clients, cfg.original,
                          num_classes=prepared.num_classes, seed=cfg.seed,
                          cache_dir=cfg.cache_dir, device=device)


def run_experiment(cfg: RunConfig, run_dir: Path, *, config_yaml: str,
                   prepared: Optional[PreparedRun] = None, label: Optional[str] = None,
                   execute: Optional[Callable] = None, resume: bool = False) -> dict:
    """Run ``cfg`` with its method's family (:mod:`fedadapt.methods`) and write its run
    directory; return the summary.

    ``execute(plan, client_app) -> ServerState`` runs the federation; the default is Flower's
    simulation engine (:func:`fedadapt.federation.simulation.launch.run_simulation`) with workers as
    nodes. The deployment engine passes one that executes the plan on its own grid, one node per
    client. With ``resume``, a run in rounds continues from the run directory's last checkpoint
    (or starts over when it has none).
    """
    from fedadapt import cores
    from fedadapt.clients.app import make_client_app

    label = label or cfg.method.name
    t0 = time.time()
    prep = prepared or prepare_run(cfg)
    try:
        return prep.method_family.run(cfg, run_dir, prep, config_yaml=config_yaml, label=label,
                                      client_app=make_client_app(SpecRef(prep.spec)),
                                      execute=execute, resume=resume, t0=t0)
    finally:  # the next run's free cores are counted from here, without this run's Ray workers
        cores.mark()


def resolve_compile(value: str, device: str) -> bool:
    """``federation.compile``: ``auto`` captures the grouped step on a GPU only."""
    text = str(value).strip().lower()
    return device == "cuda" if text == "auto" else text == "true"


