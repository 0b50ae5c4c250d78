"""The ``rounds`` family's run: federated rounds driven by the run's Flower strategy.

:func:`run_rounds` writes the run directory as the rounds go (``config.yaml``, the partition,
``metrics.jsonl`` after every round, checkpoints, the tracker) and, after the last round, the
per-client metrics, personalization, ``table.md``, the curves and ``summary.json`` (last).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional

from fedadapt import progress
from fedadapt.adapters import AdaptedModel
from fedadapt.config import ConfigError, RunConfig
from fedadapt.federation.client.training import RunSpec
from fedadapt.log import log
from fedadapt.methods.run import (
    Background,
    PreparedRun,
    node_layout,
    run_tracker,
    simulation,
    write_partition,
)
from fedadapt.strategies.registry import capabilities_of, is_custom

if TYPE_CHECKING:  # pragma: no cover
    from flwr.clientapp import ClientApp
from fedadapt.methods.rounds.strategy import (
    checked_state,
    evaluate_fn,
    make_strategy,
    record_user_files,
)
from fedadapt.methods.rounds.summary import finish_rounds


def apply_setting(cfg: RunConfig, spec: RunSpec, model: AdaptedModel) -> None:
    """Fill the spec's exits, tiers and corruptions for the setting; fail on a mismatch."""
    from fedadapt.data.corruptions import check_kinds
    from fedadapt.settings import assign_client_corruptions, client_tiers, part_names

    st = cfg.setting
    if not st.kind.exits:
        return
    if not model.has_exits and st.kind.personal_phase:
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
    if not model.has_exits:
        raise ConfigError(f"setting={st.name} needs a method with early exits (lw_linear, "
                          f"lw_mlp, accumulator, or a PEFT method with method.exits=true) on a "
                          f"ViT backbone, not method={cfg.method.name} "
                          f"on backbone={cfg.backbone.name}")
    spec.num_exits = model.num_exits
    spec.client_exits = client_tiers(st, spec.num_clients, spec.num_exits, cfg.seed)
    if st.tiers_from == "fleet":  # each client the deepest tier its device trains in time
        from fedadapt.federation.simulation.fleet import tiers_from_fleet

        spec.client_exits = tiers_from_fleet(cfg, spec, model)
    if st.kind.personal_phase:
        part_names(model, st.personalize)  # fails early for a part the method lacks
        if spec.train_source.kind != "images":
            raise ConfigError("setting=personalization corrupts images: it needs "
                              "method.use_cache=false")
        if any(sev > 0 for sev in st.severities):
            check_kinds(st.corruptions, spec.train_source.modality, cfg.dataset.name)
        spec.client_corruptions = assign_client_corruptions(st, spec.num_clients, cfg.seed)


def _init_from(run_dir: str, model: AdaptedModel) -> dict:
    """The communicated tensors of ``run_dir``'s last checkpoint, checked against ``model``."""
    from fedadapt.federation.server.checkpoint import (
        CheckpointError,
        latest_checkpoint,
        load_checkpoint,
    )

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
        if row.get("epsilon") is not None:  # fixed-clipping DP: the guarantee so far
            acc += f" | epsilon {row['epsilon']:.2f} at delta {row['delta']:.3g}"
        info = (f"loss {loss}{acc} | up {row['bytes_up'] / 1e3:.1f} kB down "
                f"{row['bytes_down'] / 1e3:.1f} kB | {row['round_s']:.2f} s")
        if bar is not None:
            bar.update(completed=state.server_round, info=info)
        else:
            log(f"[{label}] round {state.server_round}/{total} | {info}")

    return on_round


def _resume_point(run_dir: Path, config_yaml: str, config_sha: str
                  ) -> Optional[tuple[dict, dict]]:
    """``(arrays, state)`` of the run directory's last checkpoint, or None if it has none.

    Refuses when the run directory's ``config.yaml`` is not the config being resumed.
    """
    from fedadapt.federation.server.checkpoint import latest_checkpoint, load_checkpoint

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


def run_rounds(cfg: RunConfig, run_dir: Path, prep: PreparedRun, *, config_yaml: str, label: str,
               client_app: "ClientApp", execute: Optional[Callable] = None,
               resume: bool = False, t0: Optional[float] = None) -> dict:
    """Federate ``cfg`` in rounds driven by its Flower strategy, its clients served by
    ``client_app``, and write the run directory; return the summary. With ``resume``, the run
    continues from the run directory's last checkpoint (or starts over when it has none)."""
    import hashlib

    t0 = time.time() if t0 is None else t0
    config_sha = hashlib.sha256(config_yaml.encode()).hexdigest()
    point = _resume_point(run_dir, config_yaml, config_sha) if resume else None
    # personalization of a finished run's model: no FL rounds (checked before writing anything)
    start = _init_from(cfg.setting.init_from, prep.model) if cfg.setting.init_from else None
    num_rounds = 0 if start is not None else cfg.rounds
    _write_run_start(cfg, run_dir, prep, config_yaml)
    initial, resume_state = _initial_arrays(cfg, run_dir, prep.model, point, start, label)
    resumed_round = resume_state["round"] if resume_state else 0
    tracker = run_tracker(cfg, run_dir, config_yaml, label, resumed_round)
    try:
        state = _federate(cfg, run_dir, prep, initial, num_rounds, execute=execute,
                          client_app=client_app, tracker=tracker, config_sha=config_sha,
                          label=label, resume_state=resume_state)
        summary = finish_rounds(cfg, run_dir, prep, state, label=label, t0=t0,
                                 num_rounds=num_rounds, resume_state=resume_state)
    except BaseException:
        tracker.close(run_dir, failed=True)
        raise
    tracker.close(run_dir)
    return summary


def _write_run_start(cfg: RunConfig, run_dir: Path, prep: PreparedRun, config_yaml: str
                     ) -> None:
    """What the run directory holds before round 1: ``config.yaml``, the user's files, the
    partition's statistics, the fleet's devices; the clients' state folder set."""
    from fedadapt.files import atomic_write

    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write(run_dir / "config.yaml", lambda fh: fh.write(config_yaml))
    record_user_files(cfg, run_dir)
    write_partition(run_dir, cfg, prep, plot=False)
    if prep.fleet is not None:  # the devices, so a run can be reread (and resumed: same seed)
        from fedadapt.results.store import write_json

        write_json(run_dir / "fleet.json", prep.fleet.describe())
    prep.spec.state_dir = str(run_dir / "clients")


def _initial_arrays(cfg: RunConfig, run_dir: Path, model: AdaptedModel,
                    point: Optional[tuple[dict, dict]], start: Optional[dict], label: str
                    ) -> tuple[dict, Optional[dict]]:
    """The global arrays round 1 starts from (a checkpoint's when resuming, ``init_from``'s, or
    the model's), in the model's order, and the checkpoint's state (None without);
    ``metrics.jsonl`` as it was at the checkpoint, or none."""
    from fedadapt.results.store import METRICS, write_jsonl

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
    initial = {**{n: initial[n] for n in model.communicated_names()}, **folded_updates(
        cfg, model, initial)}
    if start is not None:
        log(f"[{label}] personalizing the final model of {cfg.setting.init_from}")
    return initial, resume_state


def _federate(cfg: RunConfig, run_dir: Path, prep: PreparedRun, initial: dict, num_rounds: int,
              *, execute: Optional[Callable], client_app: "ClientApp", tracker,
              config_sha: str, label: str, resume_state: Optional[dict]):
    """The rounds: the plan, executed under the round bar (the partition's plot drawn beside
    them); the server's final state."""
    from flwr.app import ArrayRecord

    resumed_round = resume_state["round"] if resume_state else 0
    show = [None]  # the round bar's hook, set once the bar exists (below)
    plan = _rounds_plan(cfg, prep, ArrayRecord(initial), num_rounds, execute,
                        on_round=_round_hook(
                            cfg, run_dir, config_sha, tracker, show, lambda: prep.layout or {},
                            # the user's strategy: its state after round 1 checked too
                            (lambda: make_strategy(cfg, prep))
                            if is_custom(cfg.strategy) else None),
                        resume=resume_state)
    with progress.task(f"[{label}] round", total=max(num_rounds, 1), interval=0,
                       for_job=True) as bar:
        if resumed_round:  # the bar starts where the checkpoint left off
            bar.update(completed=resumed_round)
        show[0] = _progress(label, cfg.rounds, bar)
        # the partition's plot beside the rounds (importing matplotlib and drawing 1,000
        # clients took 3.4 s before round 1, 2.3 s after the last for 10 clients)
        with Background(lambda: write_partition(run_dir, cfg, prep, stats=False)):
            state = (execute or simulation(cfg))(plan, client_app)
    from fedadapt.federation.client.worker import release_process_caches

    release_process_caches()  # in process, the workers' model and mappings
    return state


def _global_eval(prep: PreparedRun) -> Callable:
    """The server's evaluation of the global tensors: the global test split (every exit of a
    model with exits; the headline is their mean, the paper's "mean performance") and the
    held-out domain."""
    from fedadapt.federation.client.training import evaluate, evaluate_exits

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


def _round_hook(cfg: RunConfig, run_dir: Path, config_sha: str, tracker, show: list,
                layout: Callable[[], dict], rebuild: Optional[Callable] = None) -> Callable:
    """After each round: the metrics row, progress (``show[0]``, the round bar's hook), the
    tracker, a word if the round ran far slower than the first ones while other processes used
    the cores (:class:`fedadapt.cores.SlowdownWatch`), and every ``checkpoint_every`` rounds
    (and after the last) a checkpoint, which keeps the workers' threads (``layout()``'s); after
    the first round this process runs, when it writes no checkpoint, the strategy's state saved
    and loaded into ``rebuild()`` as a checkpoint would (what a hook made refused then)."""
    from fedadapt.cores import SlowdownWatch, evaluated_round
    from fedadapt.federation.server.checkpoint import save_checkpoint
    from fedadapt.results.store import METRICS, append_jsonl

    every = cfg.federation.checkpoint_every
    checked = [False]
    watch: list = []

    def on_round(state) -> None:
        row = state.history[-1]
        append_jsonl(run_dir / METRICS, row)
        show[0](state)
        tracker.log_round(row)
        if not watch:
            watch.append(SlowdownWatch(int(layout().get("threads") or 1)))
        if state.server_round and "round_s" in row:
            said = watch[0].round(state.server_round, row["round_s"], evaluated_round(row))
            if said:
                log(f"[federation] {said}")
        rnd = state.server_round
        checkpoint = bool(rnd and ((every and rnd % every == 0) or rnd == state.num_rounds))
        if rnd and not checked[0] and not checkpoint and rebuild is not None:
            # the state after the first round (attributes a hook made) saved and loaded now,
            # not at the first checkpoint, rounds later
            checked_state(state.strategy, rebuild, state.arrays, f"after round {rnd}")
        checked[0] = checked[0] or bool(rnd)
        if checkpoint:
            strategy, strategy_arrays = state.strategy_checkpoint()
            save_checkpoint(run_dir, server_round=rnd,
                            arrays=dict(state.arrays.to_torch_state_dict()),
                            state={"history": state.history, "cum_bytes": state.cum_bytes,
                                   "strategy": strategy,
                                   "client_metrics": state.client_metrics,
                                   "wall_s": state.history[-1]["wall_s"],
                                   "threads": layout().get("threads"),
                                   "workers": layout().get("workers")},
                            config_sha=config_sha, strategy_arrays=strategy_arrays)
            state.checkpoint_round = rnd

    return on_round


def folded_updates(cfg: RunConfig, model, arrays: dict) -> dict:
    """Under FLoRA, FedEx-LoRA and FlexLoRA (``strategy=flora|fedex_lora|flexlora``; FlexLoRA's
    for the server's model only) the global model also holds
    each LoRA layer's folded update ``X.base_delta`` (the frozen weight's shape): ``arrays``'
    own (a checkpoint's), else zero; {} under any other strategy. In float32 whatever the
    frozen weight's precision (bf16 holds it in bf16; what is communicated stays float32)."""
    if not capabilities_of(cfg.strategy).global_fold:
        return {}
    import torch

    return {n: arrays[n] if n in arrays else torch.zeros(layer.get_base_layer().weight.shape)
            for n, layer in model.lora_layers().items()}


def _rounds_plan(cfg: RunConfig, prep: PreparedRun, initial, num_rounds: int,
                 execute: Optional[Callable], *, on_round: Callable, resume):
    """The plan of a client-trained run's rounds (see :class:`ServerPlan`)."""
    from fedadapt.federation.client.training import lr_at
    from fedadapt.federation.client.worker import sent_names
    from fedadapt.federation.server.loop import ServerPlan
    from fedadapt.federation.server.secagg import secagg_round

    spec, model = prep.spec, prep.model
    sampled = min(spec.num_clients, max(1, int(spec.num_clients * cfg.partition.fraction_fit)))
    return ServerPlan(
        num_clients=spec.num_clients,
        make_strategy=lambda: make_strategy(cfg, prep),
        seed=cfg.seed,
        initial_arrays=initial,
        num_rounds=num_rounds,
        phases=[personalization_phase] if cfg.setting.kind.personal_phase else [],
        lr_at=lambda r: lr_at(cfg.train, r, cfg.rounds),
        eval_every=cfg.federation.eval_every,
        global_eval=(_global_eval(prep) if model.federated and cfg.federation.global_eval
                     else None),
        evaluate_fn=evaluate_fn(cfg),
        eval_round0=cfg.federation.eval_round0,
        counts={k: prep.counts[k] for k in ("trainable_params", "communicated_params")},
        # with a fleet, federation.round_timeout is the simulated deadline, not a wall clock's
        timeout=cfg.federation.round_timeout if prep.fleet is None else None,
        fleet=prep.fleet,
        min_reply_fraction=cfg.federation.min_reply_fraction,
        on_round=on_round,
        resume=resume,
        sent_names=lambda cid: sent_names(spec, cid, model),
        client_work=lambda cid: len(spec.clients[cid].train),
        sent_shape=_rank_shape(spec.client_ranks,
                               capabilities_of(cfg.strategy).prunes_rank),
        **node_layout(cfg, prep, execute, sampled, resume),
        secagg=secagg_round(cfg, max(len(c.train) for c in spec.clients),
                            cfg.federation.round_timeout),
    )


def _rank_shape(ranks: list[int], prunes: bool) -> Optional[Callable]:
    """The shape a client's LoRA factor has in its reply: its own rank (at most: HetLoRA's
    clients may prune), ``sent_shape`` of the plan; None without ``method.ranks``."""
    if not ranks:
        return None

    def shape(cid: int, name: str, global_shape: tuple) -> tuple:
        parts = name.split(".")
        axis = 0 if "lora_A" in parts else 1 if "lora_B" in parts else None
        if axis is None:
            return global_shape
        out = list(global_shape)
        out[axis] = -ranks[cid] if prunes else ranks[cid]
        return tuple(out)

    return shape


def assign_client_ranks(cfg: RunConfig, spec: RunSpec) -> None:
    """``method.ranks``: each client's LoRA rank into the spec (by tier in multitier)."""
    if getattr(cfg.method, "ranks", None) is None:
        return
    from fedadapt.adapters.lora import assign_ranks

    tiers = spec.client_exits if cfg.setting.kind.rank_by_tier else []
    speeds = None
    if cfg.fleet.simulated and not tiers:  # a fleet: the slowest devices the smallest rank
        from fedadapt.federation.simulation.fleet import profiles

        speeds = [p.compute for p in profiles(cfg.fleet, spec.num_clients, cfg.seed)]
    spec.client_ranks = assign_ranks(cfg.method, spec.num_clients, tiers, cfg.seed,
                                     speeds=speeds)


def personalization_phase(grid, state, plan) -> None:
    """After the rounds (``setting=personalization``): every client personalizes the final
    model on its own data and keeps what it trained; the replies carry metrics only. One row
    per client that answered lands in ``state.personalized``."""
    from flwr.app import ConfigRecord, MessageType, RecordDict

    from fedadapt.federation.server.loop import ask_every_client

    server_round = state.num_rounds + 1
    grid.trained = plan.sent_names
    shared = RecordDict({"arrays": state.arrays, "config": ConfigRecord(
        {"phase": "personalize", "server-round": server_round})})
    rows, down, up = ask_every_client(grid, plan, shared, MessageType.TRAIN,
                                      "personalization", server_round)
    state.cum_bytes += down + up
    state.personalized = [{k: (int(v) if k in ("tier", "severity") else v) for k, v in r.items()}
                          for r in rows]
