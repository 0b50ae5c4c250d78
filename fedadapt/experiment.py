"""One run: prepare data and features, federate, write the run directory.

:func:`prepare_run` does everything before Flower starts (and fails fast on bad input, before
anything is written); :func:`run_experiment` launches the simulation and writes the results.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from fedadapt import progress
from fedadapt.adapters import AdaptedModel, method_spec
from fedadapt.config import ConfigError, RunConfig
from fedadapt.data.partition import Partition
from fedadapt.federation.training import RunSpec, SpecRef
from fedadapt.log import log


@dataclass
class PreparedRun:
    spec: RunSpec
    partition: Partition
    model: AdaptedModel  # server-side copy with the seeded initial weights
    counts: dict


def prepare_run(cfg: RunConfig, *, quiet: bool = False) -> PreparedRun:
    """Load and partition the data, build the backbone and (if used) the feature cache."""
    import datasets
    from fedadapt.backbones import build_backbone
    from fedadapt.data.cache import cached_features
    from fedadapt.data.catalogue import load_card
    from fedadapt.data.loading import prepare_dataset
    from fedadapt.data.partition import format_stats, partition_dataset
    from fedadapt.data.sources import DataSource, input_source
    from fedadapt.devices import resolve_precision, run_device
    from fedadapt.federation.training import build_run_model
    from fedadapt.tracking import check_available

    check_available(cfg.tracking)
    datasets.disable_progress_bars()
    dev = run_device(cfg.federation.num_gpus)
    precision = resolve_precision(cfg.train.precision, dev)
    card = load_card(cfg.dataset.name)
    _check_method_settings(cfg, card)
    prepared = prepare_dataset(cfg.dataset, cfg.cache_dir, cfg.seed)
    partition = partition_dataset(prepared.load()["train"], cfg.partition, card, cfg.seed)
    if not quiet:
        log(f"[data] {card.name}: {prepared.num_train} train / {prepared.num_test} test samples, "
            f"{prepared.num_classes} classes | {format_stats(partition.stats)}")
    backbone = build_backbone(cfg.backbone)
    class_text, query_feature = _text_inputs(cfg, backbone, prepared.class_names)

    def images(split: str) -> DataSource:  # decoded once into the store, transformed on device
        return input_source(card, backbone, prepared, split, cfg.cache_dir,
                            backbone_name=cfg.backbone.name)

    def source(split: str) -> DataSource:
        if cfg.method.use_cache:
            path = cached_features(backbone, images(split), cfg.cache_dir, device=dev,
                                   precision=precision)
            return DataSource(prepared, split, features_path=path)
        return images(split)

    original = None
    if cfg.original.train_backbone:  # the papers' original model: a server-side phase first
        original = _original_phase(cfg, backbone, images("train"), partition, prepared, dev)
        backbone = build_backbone(original.backbone)  # the trained one: its features are cached
    spec = RunSpec(run_id=uuid.uuid4().hex, method=cfg.method,
                   backbone=original.backbone if original else cfg.backbone,
                   train=cfg.train, seed=cfg.seed, rounds=cfg.rounds,
                   num_classes=prepared.num_classes, embed_dim=backbone.embed_dim,
                   train_source=source("train"),
                   # server-trained methods serve the clients' own test splits only
                   test_source=(source("test") if method_spec(cfg.method).trainer == "clients"
                                else None),
                   clients=partition.clients, faults=cfg.faults, setting=cfg.setting,
                   class_text=class_text,
                   evaluate_val=cfg.federation.select == "best_val" or cfg.objective is not None,
                   image_source=(images("train")
                                 if getattr(cfg.method, "upload", None) == "samples" else None),
                   query_feature=query_feature, device=dev, precision=precision,
                   client_threads=max(1, int(cfg.federation.num_cpus or 1)),
                   original_classifier=original.classifier if original else None)
    model = build_run_model(spec, backbone)
    _apply_setting(cfg, spec, model)
    spec.train_mods, spec.evaluate_mods = _client_mods(cfg)
    counts = {
        "backbone_params": backbone.num_params(),
        "trainable_params": model.count(model.trainable_names()),
        "communicated_params": model.count(model.communicated_names()),
    }
    prep = PreparedRun(spec=spec, partition=partition, model=model, counts=counts)
    _check_strategy(cfg, prep)
    return prep


def _client_mods(cfg: RunConfig) -> tuple[list[str], list[str]]:
    """The ClientApp mods of training and evaluation replies: ``dp=client_*``'s clipping mod
    first (outermost: it clips what the other mods left), then ``federation.*_mods``; each
    imported once here, so a wrong name fails before anything runs."""
    from fedadapt.federation.mods import resolve
    from fedadapt.strategies.zoo import DP_MODS

    train = ([DP_MODS[cfg.dp.name]] if cfg.dp.name in DP_MODS else []) + \
        list(cfg.federation.train_mods)
    for key, names in (("federation.train_mods", cfg.federation.train_mods),
                       ("federation.evaluate_mods", cfg.federation.evaluate_mods)):
        for name in names:
            resolve(name, key)
    return train, list(cfg.federation.evaluate_mods)


def _text_inputs(cfg: RunConfig, backbone, class_names) -> tuple:
    """What goes through a CLIP backbone's text tower once: the class prompts (methods that
    use them) and CDC-MMPG's text query (``method.query``); None where unused."""
    from fedadapt.backbones.clip import class_text as clip_class_text

    class_text = query_feature = None
    if method_spec(cfg.method).uses_text:  # the class prompts through the frozen text tower
        class_text = clip_class_text(backbone, class_names, cfg.method.prompt)
    if getattr(cfg.method, "query", None):  # CDC-MMPG's text query, through the text tower
        if not hasattr(backbone, "encode_prompts"):
            raise ConfigError(f"method.query={cfg.method.query!r} is invalid for "
                              f"backbone={cfg.backbone.name}: a text query needs a backbone with "
                              f"a text tower (backbone=clip_vit_b32)")
        import torch

        with torch.no_grad():
            query_feature = backbone.encode_prompts([cfg.method.query])[0].float().cpu()
    return class_text, query_feature


def _check_method_settings(cfg: RunConfig, card) -> None:
    """Settings that hold only for some methods (before anything is loaded)."""
    if card.personalize_only and not (cfg.setting.name == "personalization"
                                      and cfg.setting.init_from):
        raise ConfigError(f"dataset={card.name} holds personalization clients only: it needs "
                          f"setting=personalization with setting.init_from=<a multi-tier run "
                          f"directory> (the model is federated on another data set, e.g. "
                          f"experiment=acc_speech_multitier)")
    if cfg.partition.test_clients > 0 and method_spec(cfg.method).trainer == "clients":
        raise ConfigError(f"partition.test_clients={cfg.partition.test_clients} is invalid for "
                          f"method={cfg.method.name}: unseen test clients have no training "
                          f"data, only server-trained methods (iciia_b, duet, cdc_mmpg, ...) can "
                          f"serve them")
    if cfg.partition.val_clients > 0 and method_spec(cfg.method).trainer == "clients":
        raise ConfigError(f"partition.val_clients={cfg.partition.val_clients} is invalid for "
                          f"method={cfg.method.name}: validation clients have no training data, "
                          f"only server-trained methods (iciia_b, duet, cdc_mmpg, ...) use them")
    if card.test_split_clients and method_spec(cfg.method).trainer == "clients":
        raise ConfigError(f"dataset={card.name} is invalid for method={cfg.method.name}: its "
                          f"test split is held-out users (unseen clients without training "
                          f"data), which only server-trained methods (iciia_b, duet, cdc_mmpg, "
                          f"...) can serve")
    if cfg.objective is not None and method_spec(cfg.method).trainer != "clients":
        raise ConfigError(f"objective={cfg.objective} is invalid for method={cfg.method.name}: "
                          f"a validation objective is measured on the clients' validation "
                          f"splits during the rounds; this method is trained on the server")
    if cfg.federation.select == "best_val" and cfg.partition.val_fraction == 0:
        raise ConfigError("federation.select=best_val picks the round by the clients' "
                          "validation accuracy: it needs partition.val_fraction > 0")


def _original_phase(cfg: RunConfig, backbone, images, partition: Partition, prepared, device):
    """``original.train_backbone``: the backbone and its classifier trained on the training
    clients' pooled images (:mod:`fedadapt.federation.original`), once per data and settings."""
    from fedadapt.federation.original import original_model

    if method_spec(cfg.method).trainer == "clients":
        raise ConfigError(f"original.train_backbone=true is invalid for method="
                          f"{cfg.method.name}: it trains the original model of the "
                          f"server-trained methods (iciia_b, iciia_t, duet, cdc_mmpg, ...)")
    return original_model(backbone, cfg.backbone, images, partition.clients, cfg.original,
                          num_classes=prepared.num_classes, seed=cfg.seed,
                          cache_dir=cfg.cache_dir, device=device)


def _apply_setting(cfg: RunConfig, spec: RunSpec, model: AdaptedModel) -> None:
    """Fill the spec's exits, tiers and corruptions for the setting; fail on a mismatch."""
    from fedadapt.data.corruptions import check_kinds
    from fedadapt.settings import assign_client_corruptions, client_exits, part_names, uses_exits

    if cfg.train.crop_scale is not None and spec.train_source.kind != "images":
        raise ConfigError("train.crop_scale augments images: it needs method.use_cache=false "
                          "(cached features cannot be cropped)")
    st = cfg.setting
    if not uses_exits(st):
        return
    if not hasattr(model, "exit_logits") and st.name == "personalization":
        # a model without exits: FL, then local fine-tuning at its own output
        part_names(model, st.personalize)
        if any(sev > 0 for sev in st.severities):
            if spec.train_source.kind != "images":
                raise ConfigError("setting=personalization with corruptions (setting.severities "
                                  "> 0) needs method.use_cache=false; setting.severities=[0] "
                                  "fine-tunes on the clients' clean data")
            check_kinds(st.corruptions, spec.train_source.modality, cfg.dataset.name)
            spec.client_corruptions = assign_client_corruptions(st, spec.num_clients, cfg.seed)
        return
    if not hasattr(model, "exit_logits"):
        raise ConfigError(f"setting={st.name} needs a method with early exits (lw_linear, "
                          f"lw_mlp, accumulator) on a ViT backbone, not method={cfg.method.name} "
                          f"on backbone={cfg.backbone.name}")
    spec.num_exits = model.num_exits
    spec.client_exits = client_exits(st, spec.num_clients, spec.num_exits, cfg.seed)
    if st.name == "personalization":
        part_names(model, st.personalize)  # fails early for a part the method lacks
        if spec.train_source.kind != "images":
            raise ConfigError("setting=personalization corrupts images: it needs "
                              "method.use_cache=false")
        if any(sev > 0 for sev in st.severities):
            check_kinds(st.corruptions, spec.train_source.modality, cfg.dataset.name)
        spec.client_corruptions = assign_client_corruptions(st, spec.num_clients, cfg.seed)


def _init_from(run_dir: str, model: AdaptedModel) -> dict:
    """The communicated tensors of ``run_dir``'s last checkpoint, checked against ``model``."""
    from fedadapt.federation.checkpoint import CheckpointError, latest_checkpoint, load_checkpoint

    folder = latest_checkpoint(Path(run_dir)) if Path(run_dir).is_dir() else None
    if folder is None:
        raise ConfigError(f"setting.init_from={run_dir!r} is invalid: no run directory with a "
                          f"checkpoint there (point it at a finished multitier run)")
    arrays, _ = load_checkpoint(folder)
    expected = {n: tuple(t.shape) for n, t in model.tensors(model.communicated_names()).items()}
    got = {n: tuple(t.shape) for n, t in arrays.items()}
    if got != expected:
        diff = sorted(set(got) ^ set(expected))[:3] or [n for n in got if got[n] != expected[n]][:3]
        raise CheckpointError(f"setting.init_from={run_dir!r}: its checkpoint holds another "
                              f"model's tensors (e.g. {diff}); use a run of the same method, "
                              f"backbone and dataset")
    return arrays


def select_round(evals: list[dict], how: str) -> Optional[dict]:
    """The evaluated round the summary reports: the last, or the one with the best mean
    validation accuracy of the clients (ties: the earliest)."""
    if not evals:
        return None
    if how == "best_val":
        scored = [r for r in evals if r.get("val_acc") is not None]
        if scored:
            return max(scored, key=lambda r: r["val_acc"])
    return evals[-1]


def domain_summary(row: Optional[dict], partition: Partition,
                   client_metrics: dict[str, dict[str, dict]]) -> Optional[dict]:
    """FedCLIP's three numbers at the reported round of a domain partition: generalization
    (the held-out domain), personalization (each participating domain's test split) and
    overall (the mean over all four)."""
    if row is None or partition.unseen is None or row.get("unseen_acc") is None:
        return None
    accs = {c: m.get("accuracy") for c, m in client_metrics.get(str(row["round"]), {}).items()}
    pers = {name: accs.get(str(i)) for i, name in enumerate(partition.names)}
    known = [v for v in pers.values() if v is not None]
    return {
        "holdout": partition.unseen_name,
        "clients": list(partition.names),
        "selected_round": row["round"],
        "generalization": row["unseen_acc"],
        "personalization": pers,
        "personalization_mean": sum(known) / len(known) if known else None,
        "overall": (row["unseen_acc"] + sum(known)) / (1 + len(known)),
    }


def _tier_counts(exits: list[int]) -> Optional[dict[str, int]]:
    """``{exit: clients}`` of a multi-tier run (None when every client uses the last exit)."""
    if not exits:
        return None
    return {str(e): exits.count(e) for e in sorted(set(exits))}


def _progress(label: str, total: int, bar: Optional[progress.Bar] = None):
    """The round hook's progress part: the round bar's text (loss, accuracies, bytes, time), or
    a status line per round without a bar."""
    def on_round(state) -> None:
        row = state.history[-1]
        acc = ""
        if row["global_acc"] is not None:
            acc += f" | global {100 * row['global_acc']:.1f}%"
        if row["client_acc"] is not None:
            acc += f" | client-mean {100 * row['client_acc']:.1f}%"
        loss = f"{row['train_loss']:.3f}" if row["train_loss"] is not None else "—"
        info = (f"loss {loss}{acc} | up {row['bytes_up'] / 1e3:.1f} kB down "
                f"{row['bytes_down'] / 1e3:.1f} kB | {row['round_s']:.2f} s")
        if bar is not None:
            bar.update(completed=state.server_round, info=info)
        else:
            log(f"[{label}] round {state.server_round}/{total} | {info}")

    return on_round


def _write_partition(run_dir: Path, cfg: RunConfig, prep: PreparedRun) -> None:
    """``partition.json`` (statistics) and ``partition.png`` (classes per client)."""
    from fedadapt.results.plots import write_partition_plot
    from fedadapt.results.store import write_json

    write_json(run_dir / "partition.json", prep.partition.stats)
    source = prep.spec.train_source
    write_partition_plot(cfg, prep.partition, source.labels(), run_dir / "partition.png",
                         class_names=list(source.prepared.class_names))


def _open_tracker(cfg: RunConfig, run_dir: Path, config_yaml: str, label: str,
                  resume_round: int = 0):
    """The run's :class:`fedadapt.tracking.Tracker` (no-op unless ``tracking.*`` is on)."""
    from fedadapt.results.store import git_commit
    from fedadapt.tracking import open_tracker

    if not (cfg.tracking.tensorboard or cfg.tracking.mlflow):
        return open_tracker(cfg.tracking, run_dir=run_dir, config_yaml=config_yaml, name=label,
                            experiment=cfg.experiment, output_dir=cfg.output_dir)
    tags = {"fedadapt.method": label, "fedadapt.dataset": cfg.dataset.name,
            "fedadapt.backbone": cfg.backbone.name, "fedadapt.seed": str(cfg.seed),
            "fedadapt.git_commit": git_commit() or "none"}
    return open_tracker(cfg.tracking, run_dir=run_dir, config_yaml=config_yaml,
                        name=f"{label} seed={cfg.seed}", experiment=cfg.experiment,
                        output_dir=cfg.output_dir, tags=tags, resume_round=resume_round)


def _resume_point(run_dir: Path, config_yaml: str, config_sha: str
                  ) -> Optional[tuple[dict, dict]]:
    """``(arrays, state)`` of the run directory's last checkpoint, or None if it has none.

    Refuses when the run directory's ``config.yaml`` is not the config being resumed.
    """
    from fedadapt.federation.checkpoint import latest_checkpoint, load_checkpoint

    saved = run_dir / "config.yaml"
    old_yaml = saved.read_text() if saved.is_file() else config_yaml
    if old_yaml != config_yaml:
        old, new = old_yaml.splitlines(), config_yaml.splitlines()
        diff = next((f"{a!r} became {b!r}" for a, b in zip(old, new) if a != b),
                    "their lengths differ")
        raise ConfigError(f"resume: {saved} differs from the config composed now ({diff}: conf/ "
                          f"files edited, or FEDADAPT_CACHE / HOME changed?); refusing to mix "
                          f"them")
    folder = latest_checkpoint(run_dir)
    if folder is None:
        return None
    return load_checkpoint(folder, config_sha=config_sha)


def run_experiment(cfg: RunConfig, run_dir: Path, *, config_yaml: str,
                   prepared: Optional[PreparedRun] = None, label: Optional[str] = None,
                   execute: Optional[Callable] = None, resume: bool = False) -> dict:
    """Federate ``cfg`` and write its run directory; return the summary.

    ``execute(plan, client_app) -> ServerState`` runs the federation; the default is Flower's
    simulation engine (:func:`fedadapt.federation.launch.run_simulation`) with workers as nodes.
    The deployment engine passes one that executes the plan on its own grid, one node per
    client. With ``resume``, the run continues from the run directory's last checkpoint (or
    starts over when it has none).
    """
    import hashlib

    from flwr.app import ArrayRecord

    from fedadapt.clients.app import make_client_app
    from fedadapt.results.store import METRICS, atomic_write, write_jsonl

    label = label or cfg.method.name
    t0 = time.time()
    prep = prepared or prepare_run(cfg)
    if method_spec(cfg.method).trainer == "sessions":
        return run_session_experiment(cfg, run_dir, prep, config_yaml=config_yaml, label=label,
                                      execute=execute, t0=t0)
    if method_spec(cfg.method).trainer == "server":
        return run_plugin_experiment(cfg, run_dir, prep, config_yaml=config_yaml, label=label,
                                     execute=execute, t0=t0)
    spec, model = prep.spec, prep.model
    config_sha = hashlib.sha256(config_yaml.encode()).hexdigest()
    point = _resume_point(run_dir, config_yaml, config_sha) if resume else None
    # personalization of a finished run's model: no FL rounds (checked before writing anything)
    start = _init_from(cfg.setting.init_from, model) if cfg.setting.init_from else None
    num_rounds = 0 if start is not None else cfg.rounds
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write(run_dir / "config.yaml", lambda fh: fh.write(config_yaml))
    _write_partition(run_dir, cfg, prep)
    spec.state_dir = str(run_dir / "clients")
    metrics_path = run_dir / METRICS
    resume_state = None
    if point is not None:  # metrics.jsonl as it was at the checkpoint; rounds after it rerun
        initial, resume_state = point
        write_jsonl(metrics_path, resume_state["history"])
        log(f"[{label}] resuming after round {resume_state['round']} from "
            f"{run_dir / 'checkpoints'}")
    else:
        initial = start if start is not None else model.tensors(model.communicated_names())
        metrics_path.unlink(missing_ok=True)
    # in the model's order (a checkpoint's file has its own): Flower's strategies pair the
    # global arrays with the replies' by position
    initial = {n: initial[n] for n in model.communicated_names()}
    if start is not None:
        log(f"[{label}] personalizing the final model of {cfg.setting.init_from}")
    resumed_round = resume_state["round"] if resume_state else 0
    tracker = _open_tracker(cfg, run_dir, config_yaml, label, resumed_round)
    show = [None]  # the round bar's hook, set once the bar exists (below)
    try:
        plan = _rounds_plan(cfg, prep, ArrayRecord(initial), num_rounds, execute,
                            on_round=_round_hook(cfg, run_dir, config_sha, tracker, show),
                            resume=resume_state)
        with progress.task(f"[{label}] round", total=max(num_rounds, 1), interval=0,
                           for_job=True) as bar:
            if resumed_round:  # the bar starts where the checkpoint left off
                bar.update(completed=resumed_round)
            show[0] = _progress(label, cfg.rounds, bar)
            state = (execute or _simulation(cfg))(plan, make_client_app(SpecRef(spec)))
        summary = _finish_rounds(cfg, run_dir, prep, state, label=label, t0=t0,
                                 num_rounds=num_rounds, resume_state=resume_state)
    except BaseException:
        tracker.close(run_dir, failed=True)
        raise
    tracker.close(run_dir)
    return summary


def _global_eval(prep: PreparedRun) -> Callable:
    """The server's evaluation of the global tensors: the global test split (every exit of a
    model with exits; the headline is their mean, the paper's "mean performance") and the
    held-out domain."""
    from fedadapt.federation.training import evaluate, evaluate_exits

    spec, model, unseen = prep.spec, prep.model, prep.partition.unseen

    def global_eval(arrays) -> dict:
        model.load_tensors(dict(arrays.to_torch_state_dict()))
        out = {}
        if unseen is not None:  # generalization: the held-out domain, never trained on
            out["unseen_acc"] = evaluate(model, spec.train_source, unseen,
                                         precision=spec.precision)[1]
        if len(spec.test_source.labels()) == 0:  # no global test split (dataset.test_fraction=0)
            return out
        if not spec.num_exits:
            loss, acc, _ = evaluate(model, spec.test_source, precision=spec.precision)
            return {**out, "global_acc": acc, "global_loss": loss}
        losses, accs, _ = evaluate_exits(model, spec.test_source, list(range(spec.num_exits)),
                                         precision=spec.precision)
        return {**out, "global_acc": sum(accs) / len(accs),
                "global_loss": sum(losses) / len(losses), "global_acc_last": accs[-1],
                "exit_acc": accs}

    return global_eval


def _round_hook(cfg: RunConfig, run_dir: Path, config_sha: str, tracker, show: list) -> Callable:
    """After each round: the metrics row, progress (``show[0]``, the round bar's hook), the
    tracker, and every ``checkpoint_every`` rounds (and after the last) a checkpoint."""
    from fedadapt.federation.checkpoint import save_checkpoint
    from fedadapt.results.store import METRICS, append_jsonl

    every = cfg.federation.checkpoint_every

    def on_round(state) -> None:
        append_jsonl(run_dir / METRICS, state.history[-1])
        show[0](state)
        tracker.log_round(state.history[-1])
        rnd = state.server_round
        if (every and rnd % every == 0) or rnd == state.num_rounds:
            strategy, strategy_arrays = state.strategy_checkpoint()
            save_checkpoint(run_dir, server_round=rnd,
                            arrays=dict(state.arrays.to_torch_state_dict()),
                            state={"history": state.history, "cum_bytes": state.cum_bytes,
                                   "strategy": strategy,
                                   "client_metrics": state.client_metrics,
                                   "wall_s": state.history[-1]["wall_s"]},
                            config_sha=config_sha, strategy_arrays=strategy_arrays)
            state.checkpoint_round = rnd

    return on_round


def _node_layout(cfg: RunConfig, prep: PreparedRun, execute: Optional[Callable],
                 sampled: int) -> dict:
    """The plan's nodes: on the deployment engine (``execute`` given) one per client; in
    simulation the workers, their Ray resources and the clients each trains side by side."""
    from fedadapt.federation.sizing import announce, measure_group_memory, size_simulation

    spec = prep.spec
    if execute is not None and getattr(execute, "nodes", "clients") == "clients":
        return {"nodes": "clients", "num_nodes": spec.num_clients, "group_size": 1}
    measure = (lambda: measure_group_memory(spec, prep.model)) if spec.device == "cuda" \
        else None
    backbone_trained = prep.model.count([n for n in prep.model.trainable_names()
                                         if n.startswith("backbone.")])
    sizing = size_simulation(cfg.federation, spec.device, sampled, cfg.train.batch_size,
                             measure, trains_whole=backbone_trained
                             >= prep.counts["backbone_params"] / 2)
    announce(sizing)
    spec.client_threads = max(1, int(sizing.num_cpus))  # each worker's torch threads
    return {"nodes": "workers", "num_nodes": sizing.workers, "group_size": sizing.group_size,
            "resources": {"num_cpus": sizing.num_cpus, "num_gpus": sizing.num_gpus}}


def _rounds_plan(cfg: RunConfig, prep: PreparedRun, initial, num_rounds: int,
                 execute: Optional[Callable], *, on_round: Callable, resume):
    """The plan of a client-trained run's rounds (see :class:`ServerPlan`)."""
    from fedadapt.federation.server import ServerPlan
    from fedadapt.federation.training import lr_at
    from fedadapt.federation.worker import sent_names

    spec, model = prep.spec, prep.model
    sampled = min(spec.num_clients, max(1, int(spec.num_clients * cfg.partition.fraction_fit)))
    return ServerPlan(
        num_clients=spec.num_clients,
        make_strategy=lambda: make_strategy(cfg, prep),
        seed=cfg.seed,
        initial_arrays=initial,
        num_rounds=num_rounds,
        personalize=cfg.setting.name == "personalization",
        lr_at=lambda r: lr_at(cfg.train, r, cfg.rounds),
        eval_every=cfg.federation.eval_every,
        global_eval=_global_eval(prep) if model.federated else None,
        counts={k: prep.counts[k] for k in ("trainable_params", "communicated_params")},
        timeout=cfg.federation.round_timeout,
        min_reply_fraction=cfg.federation.min_reply_fraction,
        on_round=on_round,
        resume=resume,
        sent_names=lambda pid: sent_names(spec, pid, model),
        **_node_layout(cfg, prep, execute, sampled),
    )


def make_strategy(cfg: RunConfig, prep: PreparedRun):
    """The run's Flower strategy (``strategy=``, wrapped by ``dp=``; see
    :mod:`fedadapt.strategies.zoo`)."""
    from fedadapt.strategies.zoo import build_strategy

    p = cfg.partition
    return build_strategy(cfg.strategy, cfg.dp, num_clients=prep.spec.num_clients,
                          fraction_train=p.fraction_fit, fraction_evaluate=p.fraction_evaluate,
                          weighting=cfg.method.weighting, lr=cfg.train.lr,
                          federated=prep.model.federated)


def _check_strategy(cfg: RunConfig, prep: PreparedRun) -> None:
    """The strategy against the partition's real client count and what the clients send
    (before anything is written): refuses a strategy that needs every client to send every
    tensor where some do not, and builds it once (Flower's own checks of its values)."""
    from fedadapt.federation.worker import sent_names
    from fedadapt.strategies.zoo import check_counts, check_every_tensor, sample_size

    spec, model = prep.spec, prep.model
    if method_spec(cfg.method).trainer != "clients" or not model.federated:
        return
    check_counts(cfg.strategy, cfg.dp, num_clients=spec.num_clients,
                 sampled=sample_size(spec.num_clients, cfg.partition.fraction_fit))
    every = model.communicated_names()
    partial = [c for c in range(spec.num_clients) if len(sent_names(spec, c, model)) < len(every)]
    if partial:
        check_every_tensor(cfg.strategy, cfg.dp, f"method={cfg.method.name}: client "
                                                 f"{partial[0]} trains "
                                                 f"{len(sent_names(spec, partial[0], model))} of "
                                                 f"the {len(every)} communicated tensors")
    make_strategy(cfg, prep)


def _finish_rounds(cfg: RunConfig, run_dir: Path, prep: PreparedRun, state, *, label: str,
                   t0: float, num_rounds: int, resume_state: Optional[dict]) -> dict:
    """The run directory of a client-trained run after its rounds: per-client metrics,
    personalization, the summary and its table and curves (``summary.json`` last)."""
    from fedadapt.results.plots import plot_curves
    from fedadapt.results.store import SUMMARY, atomic_write, write_json, write_jsonl
    from fedadapt.results.tables import run_tables

    spec, history = prep.spec, state.history
    write_jsonl(run_dir / CLIENTS_FILE, [{"round": int(r), "client": int(c), **m}
                                         for r, per in state.client_metrics.items()
                                         for c, m in per.items()])
    evals = [r for r in history if r["global_acc"] is not None or r["client_acc"] is not None]

    def best(key):
        vals = [r[key] for r in evals if r[key] is not None]
        return max(vals) if vals else None

    final = evals[-1] if evals else (history[-1] if history else {})
    selected = select_round(evals, cfg.federation.select)
    summary = {
        **_summary_head(cfg, label, prep, rounds=num_rounds, setting=cfg.setting.name),
        "final": {k: final.get(k) for k in ("round", "global_acc", "client_acc",
                                            "client_acc_weighted", "train_loss",
                                            "global_acc_last", "exit_acc", "tier_acc",
                                            "val_acc")},
        "selection": cfg.federation.select,
        "selected": ({k: selected.get(k) for k in ("round", "val_acc", "global_acc", "client_acc",
                                                   "unseen_acc")} if selected else None),
        "domains": domain_summary(selected, prep.partition, state.client_metrics),
        "tiers": _tier_counts(spec.client_exits),
        "personalization": _personalization(cfg, run_dir, spec, state.personalized),
        "best": {"global_acc": best("global_acc"), "client_acc": best("client_acc")},
        "params": prep.counts,
        "strategy": _strategy_summary(cfg, state.strategy),
        "privacy": _privacy_summary(cfg, state.strategy),
        "total_bytes": state.cum_bytes,
        "client_failures": sum(r.get("clients_failed", 0) for r in history),
        "resumed_after_round": resume_state["round"] if resume_state else None,
        "bytes_up": sum(r["bytes_up"] for r in history),
        "bytes_down": sum(r["bytes_down"] for r in history),
        # this process's time, plus the interrupted process's rounds when resumed
        "wall_s": time.time() - t0 + (resume_state or {}).get("wall_s", 0.0),
        "seconds_per_round": (sum(r["round_s"] for r in history) / len(history)
                              if history else None),
        **_summary_tail(prep),
    }
    table = run_tables([summary], title=f"## {cfg.experiment}: {label} on {cfg.dataset.name}")
    atomic_write(run_dir / "table.md", lambda fh: fh.write(table))
    if history:
        plot_curves({label: history}, run_dir / "curves.png",
                    title=f"{label} | {cfg.dataset.name} | alpha {cfg.partition.alpha}")
    write_json(run_dir / SUMMARY, summary)  # last: marks the run directory complete
    return summary


def _strategy_summary(cfg: RunConfig, strategy) -> dict:
    """Which Flower strategy ran, with its keys (``strategy=`` / ``dp=``)."""
    from dataclasses import asdict

    from fedadapt.strategies.zoo import describe

    return {"class": describe(strategy), "strategy": asdict(cfg.strategy),
            "dp": asdict(cfg.dp)}


def _privacy_summary(cfg: RunConfig, strategy) -> Optional[dict]:
    """``dp=``'s guarantee at the end: epsilon at delta (fixed clipping with accounting), the
    noise multiplier and the final clipping norm; None without DP."""
    from fedadapt.strategies.zoo import privacy_spent

    if cfg.dp.name == "none":
        return None
    return {"dp": cfg.dp.name, "noise_multiplier": float(strategy.noise_multiplier),
            "clipping_norm": float(strategy.clipping_norm),
            **(privacy_spent(strategy) or {"epsilon": None, "accounting": None})}


#: Per-client evaluation results of a run, one line per (round, client), written at its end.
CLIENTS_FILE = "clients.jsonl"


def _personalization(cfg: RunConfig, run_dir: Path, spec: RunSpec, rows: list[dict]
                     ) -> Optional[dict]:
    if not rows:
        return None
    from fedadapt.results.store import write_json
    from fedadapt.settings import summarize_personalization

    rows = [{**r, "corruption": (spec.client_corruptions[r["client"]][0]
                                 if spec.client_corruptions else "none")} for r in rows]
    write_json(run_dir / "personalization.json", rows)
    return {"part": cfg.setting.personalize, "epochs": cfg.setting.epochs,
            **summarize_personalization(rows)}


def _simulation(cfg: RunConfig) -> Callable:
    """The default ``execute``: Flower's simulation engine with ``cfg.federation``."""
    from fedadapt.federation.launch import run_simulation

    return lambda plan, client_app: run_simulation(plan, client_app, cfg.federation)


def _summary_head(cfg: RunConfig, label: str, prep: PreparedRun, *, rounds: int,
                  setting: str) -> dict:
    """The fields that say which run a summary is (first in every ``summary.json``)."""
    p = cfg.partition
    return {"method": label, "experiment": cfg.experiment, "dataset": cfg.dataset.name,
            "backbone": cfg.backbone.name,
            "partition": {"kind": p.kind, "num_clients": prep.spec.num_clients,
                          "alpha": p.alpha, "fraction_fit": p.fraction_fit},
            "seed": cfg.seed, "rounds": rounds, "setting": setting}


def _summary_tail(prep: PreparedRun) -> dict:
    """The partition's statistics and where the run ran (last in every ``summary.json``)."""
    from fedadapt.results.store import git_commit, versions

    return {"partition_stats": {k: prep.partition.stats[k] for k in
                                ("num_clients", "samples_per_client", "classes_per_client")},
            "versions": versions(), "git_commit": git_commit(), "device": prep.spec.device,
            "precision": prep.spec.precision, "reproducibility": reproducibility(prep.spec)}


def reproducibility(spec) -> dict:
    """What, besides the config and seed, decides a run's numbers to the last bit: the CPU
    kernels torch dispatches to (its instruction set), torch's thread counts (the server's
    evaluation; each client's, pinned to ``federation.num_cpus``), the GPU and whether its
    kernels were deterministic (``train.deterministic``: cuDNN convolutions and some backward
    passes are not by default), and the precision. Two runs whose metrics differ can be
    compared here; dropped clients are in ``metrics.jsonl`` (``failures``)."""
    import os

    import torch

    out = {"cpu_capability": torch.backends.cpu.get_cpu_capability(),
           "torch_threads_server": torch.get_num_threads(),
           "torch_threads_client": spec.client_threads,
           "omp_num_threads_env": os.environ.get("OMP_NUM_THREADS"),
           "device": spec.device, "precision": spec.precision,
           "deterministic": bool(spec.train.deterministic)}
    if spec.device == "cuda":
        out.update(gpu=torch.cuda.get_device_name(), cuda=torch.version.cuda,
                   cudnn=torch.backends.cudnn.version())
    return out


def _server_run(cfg: RunConfig, run_dir: Path, prep: PreparedRun, config_yaml: str,
                execute: Optional[Callable], **plan_extra):
    """A server-trained method after its training: write the run directory's config and
    partition, then run its one phase with every client (``plan_extra``: what the server sends
    them); returns the final server state."""
    from flwr.app import ArrayRecord

    from fedadapt.clients.app import make_client_app
    from fedadapt.federation.server import ServerPlan
    from fedadapt.results.store import atomic_write

    spec = prep.spec
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write(run_dir / "config.yaml", lambda fh: fh.write(config_yaml))
    _write_partition(run_dir, cfg, prep)
    plan = ServerPlan(
        num_clients=spec.num_clients,
        make_strategy=None, seed=cfg.seed, initial_arrays=ArrayRecord({}), num_rounds=0,
        lr_at=lambda r: 0.0, eval_every=1,
        global_eval=None, counts={}, timeout=cfg.federation.round_timeout,
        min_reply_fraction=cfg.federation.min_reply_fraction,
        **_node_layout(cfg, prep, execute, spec.num_clients), **plan_extra)
    return (execute or _simulation(cfg))(plan, make_client_app(SpecRef(spec)))


def _finish_server_run(cfg: RunConfig, run_dir: Path, prep: PreparedRun, state, *, label: str,
                       t0: float, setting: str, results: dict, params: dict,
                       client_acc: Optional[dict]) -> dict:
    """The summary of a server-trained method's run (``results``: its result sections), its
    ``table.md``, and ``summary.json`` last."""
    from fedadapt.results.store import SUMMARY, atomic_write, write_json
    from fedadapt.results.tables import run_tables

    summary = {
        **_summary_head(cfg, label, prep, rounds=0, setting=setting),
        **results,
        "final": {"round": 1, "global_acc": None,
                  "client_acc": client_acc["client_mean"] if client_acc else None},
        "best": {"global_acc": None, "client_acc": None},
        "params": {**prep.counts, **params},
        "total_bytes": state.cum_bytes,
        "bytes_down": state.history[-1]["bytes_down"],
        "bytes_up": state.history[-1]["bytes_up"],
        "wall_s": time.time() - t0,
        "seconds_per_round": None,
        **_summary_tail(prep),
    }
    table = run_tables([summary], title=f"## {cfg.experiment}: {label} on {cfg.dataset.name}")
    atomic_write(run_dir / "table.md", lambda fh: fh.write(table))
    write_json(run_dir / SUMMARY, summary)  # last: marks the run directory complete
    tracker = _open_tracker(cfg, run_dir, (run_dir / "config.yaml").read_text(), label)
    for row in state.history:  # its one phase with the clients
        tracker.log_round(row)
    tracker.close(run_dir)
    return summary


def run_plugin_experiment(cfg: RunConfig, run_dir: Path, prep: PreparedRun, *, config_yaml: str,
                          label: str, execute: Optional[Callable] = None,
                          t0: Optional[float] = None) -> dict:
    """A server-trained plug-in (ICIIA): train it on the server from the clients' cached
    features, deliver it to every client in one Flower round, collect their recognition
    accuracies; write the run directory like any run (``summary.json`` last)."""
    from flwr.app import ArrayRecord

    from fedadapt.federation.plugin import client_arrays, summarize_recognition, train_on_server
    from fedadapt.results.store import write_json

    t0 = time.time() if t0 is None else t0
    spec = prep.spec  # cached features: the method's builder refused method.use_cache=false
    log(f"[{label}] training on the server from {spec.num_clients} clients' cached features")
    trained = train_on_server(spec)
    log(f"[{label}] delivering the module to {spec.num_clients} clients (one Flower round)")
    state = _server_run(cfg, run_dir, prep, config_yaml, execute,
                        plugin_arrays=lambda pid: ArrayRecord(client_arrays(trained, pid)))
    rows = sorted(state.delivered, key=lambda r: r["client"])
    write_json(run_dir / "recognition.json", rows)
    module_params = sum(t.numel() for t in trained["module"].parameters())
    layer_params = module_params - sum(t.numel() for t in trained["module"].classifier.parameters())
    recognition = summarize_recognition(rows)
    return _finish_server_run(
        cfg, run_dir, prep, state, label=label, t0=t0, setting="server-trained plug-in",
        results={"recognition": recognition, "server_training": trained["log"]},
        params={"module_params": layer_params}, client_acc=recognition.get("acc_stream"))


def run_session_experiment(cfg: RunConfig, run_dir: Path, prep: PreparedRun, *,
                           config_yaml: str, label: str, execute: Optional[Callable] = None,
                           t0: Optional[float] = None) -> dict:
    """A session plug-in (DUET, CDC-MMPG): train the generator on the server from the clients'
    cached features, then converse with every client (uploads up, generated parameters down,
    metrics back); write the run directory like any run (``summary.json`` last)."""
    from fedadapt.federation.sessions import (
        SessionServer,
        generator_summary,
        summarize_sessions,
        train_generator,
    )
    from fedadapt.results.store import write_json, write_jsonl

    t0 = time.time() if t0 is None else t0
    spec = prep.spec
    log(f"[{label}] training on the server from {spec.num_clients} clients' cached features")
    trained = train_generator(spec)
    server = SessionServer(spec, trained)
    log(f"[{label}] serving every test session of {spec.num_clients} clients")
    state = _server_run(cfg, run_dir, prep, config_yaml, execute, sessions=server)
    rows = sorted(state.delivered, key=lambda r: r["client"])
    scores = [r.pop("scores") for r in rows if "scores" in r]
    write_json(run_dir / "sessions.json", rows)
    write_jsonl(run_dir / "session_payloads.jsonl", server.records)
    sessions = summarize_sessions(rows, server.records, scores)
    sessions.update(generator_summary(spec.method, trained["generator"]))
    generator_params = sum(p.numel() for p in trained["generator"].parameters())
    return _finish_server_run(
        cfg, run_dir, prep, state, label=label, t0=t0,
        setting="server-trained session plug-in",
        results={"sessions": sessions, "server_training": trained["log"]},
        params={"generator_params": generator_params},
        client_acc=sessions.get("acc_generated"))
