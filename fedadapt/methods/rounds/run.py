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
from fedadapt.data.partition import Partition
from fedadapt.federation.client.training import RunSpec
from fedadapt.log import log
from fedadapt.methods.run import (
    Background,
    PreparedRun,
    node_layout,
    run_tracker,
    simulation,
    summary_head,
    summary_tail,
    write_partition,
)
from fedadapt.strategies.registry import capabilities_of, is_custom

if TYPE_CHECKING:  # pragma: no cover
    from flwr.clientapp import ClientApp


def client_mods(cfg: RunConfig) -> tuple[list, list]:
    """The ClientApp mods of training and evaluation: ``dp=client_*``'s clipping mod first
    (outermost: it clips what the other mods left; ``dp=dpsgd``'s accounting), then
    ``federation.*_mods``; each made once here, so a wrong name or argument fails before
    anything runs, and a ``file.py`` named by its absolute path (a Ray worker's working
    directory may differ)."""
    from fedadapt.federation.client.mods import resolve
    from fedadapt.strategies.registry import dp_mod
    from fedadapt.userimport import absolute

    def portable(entry):
        if isinstance(entry, dict):
            return {**entry, "_target_": absolute(entry["_target_"])} \
                if entry.get("_target_") else entry
        return absolute(str(entry))

    out = []
    for key, names in (("federation.train_mods", cfg.federation.train_mods),
                       ("federation.evaluate_mods", cfg.federation.evaluate_mods)):
        for entry in names:
            resolve(entry, key)
        out.append([portable(e) for e in names])
    train, evaluate = out
    first = dp_mod(cfg.dp)
    return ([first] if first is not None else []) + train, evaluate


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
        summary = _finish_rounds(cfg, run_dir, prep, state, label=label, t0=t0,
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
    from fedadapt.cores import SlowdownWatch
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
            said = watch[0].round(state.server_round, row["round_s"], "client_acc" in row)
            if said:
                log(f"[federation] {said}")
        rnd = state.server_round
        checkpoint = bool(rnd and ((every and rnd % every == 0) or rnd == state.num_rounds))
        if rnd and not checked[0] and not checkpoint and rebuild is not None:
            # the state after the first round (attributes a hook made) saved and loaded now,
            # not at the first checkpoint, rounds later
            _checked_state(state.strategy, rebuild, state.arrays, f"after round {rnd}")
        checked[0] = checked[0] or bool(rnd)
        if checkpoint:
            strategy, strategy_arrays = state.strategy_checkpoint()
            save_checkpoint(run_dir, server_round=rnd,
                            arrays=dict(state.arrays.to_torch_state_dict()),
                            state={"history": state.history, "cum_bytes": state.cum_bytes,
                                   "strategy": strategy,
                                   "client_metrics": state.client_metrics,
                                   "wall_s": state.history[-1]["wall_s"],
                                   "threads": layout().get("threads")},
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


def evaluate_fn(cfg: RunConfig) -> Optional[Callable]:
    """``federation.evaluate_fn``, loaded (Flower's ``evaluate_fn(server_round, arrays)``) and
    its signature checked: one that cannot be called with those two arguments is refused in
    one line."""
    name = cfg.federation.evaluate_fn
    if not name:
        return None
    import inspect

    from fedadapt.userimport import load

    fn = load(name, "federation.evaluate_fn")
    if not callable(fn) or isinstance(fn, type):
        raise ConfigError(f"federation.evaluate_fn={name!r} is not a function "
                          f"evaluate_fn(server_round, arrays) -> MetricRecord | None")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: called as it is
        return fn
    try:
        signature.bind(0, object())
    except TypeError as err:
        raise ConfigError(f"federation.evaluate_fn={name!r} takes {signature}, not Flower's "
                          f"(server_round, arrays) -> MetricRecord | None ({err})") from err
    return fn


def user_code_names(cfg: RunConfig) -> list[tuple[str, str]]:
    """``(key, name)`` of each object of the user's that the config names: the strategy class,
    the ``evaluate_fn``, the mods."""
    out = [("strategy.target", cfg.strategy.target)] if is_custom(cfg.strategy) else []
    if cfg.federation.evaluate_fn:
        out.append(("federation.evaluate_fn", cfg.federation.evaluate_fn))
    for key, entries in (("federation.train_mods", cfg.federation.train_mods),
                         ("federation.evaluate_mods", cfg.federation.evaluate_mods)):
        for entry in entries:
            name = entry.get("_target_") if hasattr(entry, "keys") else entry
            if name:
                out.append((key, str(name)))
    return out


def record_user_files(cfg: RunConfig, run_dir: Path) -> None:
    """``user_files.json`` in the run directory: each of the user's files the config names, by
    absolute path and SHA-256 (:func:`fedadapt.userimport.file_record`), which a resume reads
    (from any folder) before it composes the config again."""
    from fedadapt.results.store import write_json
    from fedadapt.userimport import USER_FILES, file_record

    rows = []
    for key, name in user_code_names(cfg):
        try:
            rec = file_record(name)
        except Exception:  # noqa: BLE001 - a record the run cannot make never stops it
            rec = None
        if rec is not None:
            rows.append(dict(rec, key=key))
    path = run_dir / USER_FILES
    if rows:
        write_json(path, {"files": rows})
    else:
        path.unlink(missing_ok=True)


def check_code(cfg: RunConfig) -> None:
    """The user's code a run names, built and checked from the config alone (no data): the
    strategy built with its keys (a key its constructor, or the class it passes ``**kwargs``
    on to, does not take), its state saved and loaded as a checkpoint does
    (:func:`fedadapt.strategies.state.check_checkpointable`), the mods made and the
    ``evaluate_fn`` loaded, their signatures checked. A sweep runs this for every point before
    the first; :func:`check_strategy_with_clients` builds the strategy again with the real
    client count."""
    evaluate_fn(cfg)
    client_mods(cfg)
    if not is_custom(cfg.strategy):
        return  # fedadapt's and Flower's strategies: check_strategy_with_clients, with the data

    def build():
        return _built(lambda: _make(cfg, cfg.partition.num_clients))

    try:
        strategy = build()
    except ConfigError as err:  # a value Flower's constructors refuse: the count may matter
        if "is not a parameter of" in str(err):
            raise
        return
    _checked_state(strategy, build)


def _built(make: Callable):
    """``make()``; an exception raised inside the user's constructor in one line naming it,
    then their frames."""
    from fedadapt.config import FedadaptError
    from fedadapt.userimport import user_error

    try:
        return make()
    except FedadaptError:
        raise
    except Exception as err:
        raised = user_error(err, "when it was built (before round 1)")
        if raised is None:
            raise
        raise raised from err


def _checked_state(strategy, rebuild: Callable, global_arrays=None,
                   when: str = "before round 1") -> None:
    """:func:`~fedadapt.strategies.state.check_checkpointable`, an exception raised inside the
    user's ``state_dict()`` / ``load_state_dict()`` in one line naming it."""
    from fedadapt.config import FedadaptError
    from fedadapt.strategies.state import StrategyStateError, check_checkpointable
    from fedadapt.userimport import user_error

    try:
        check_checkpointable(strategy, rebuild, global_arrays)
    except StrategyStateError as err:
        if when == "before round 1":
            raise
        raise StrategyStateError(f"{err} (found {when}; the first checkpoint would have "
                                 f"refused it)") from err
    except FedadaptError:
        raise
    except Exception as err:
        raised = user_error(err, f"when its state was saved and loaded ({when})")
        if raised is None:
            raise
        raise raised from err


def _make(cfg: RunConfig, num_clients: int, federated: bool = True, ranks=None,
          sizes: Optional[list[int]] = None):
    from fedadapt.federation.wire.grid import NODE_BASE
    from fedadapt.strategies.build import build_strategy

    p = cfg.partition
    global_rank = getattr(cfg.method, "global_rank", None)
    ranks = ranks or [global_rank] * num_clients
    # fleet.fedscale_semantics=exact: the fleet over-selects as FedScale does (Fleet.select)
    # and the strategy trains every client it is offered
    exact = cfg.fleet.name == "fedscale" and cfg.fleet.fedscale_semantics == "exact"
    return build_strategy(cfg.strategy, cfg.dp, num_clients=num_clients,
                          fraction_train=1.0 if exact else p.fraction_fit,
                          fraction_evaluate=p.fraction_evaluate,
                          weighting=cfg.method.weighting, lr=cfg.train.lr,
                          federated=federated,
                          rank_of=lambda node: ranks[node - NODE_BASE], seed=cfg.seed,
                          sample_available=cfg.fleet.simulated, train=cfg.train,
                          examples_of=(None if sizes is None else
                                       lambda node: sizes[node - NODE_BASE]))


def make_strategy(cfg: RunConfig, prep: PreparedRun):
    """The run's Flower strategy (``strategy=``, wrapped by ``dp=``; see
    :mod:`fedadapt.strategies.build`)."""
    return _make(cfg, prep.spec.num_clients, prep.model.federated, prep.spec.client_ranks,
                 [len(client.train) for client in prep.spec.clients])


def check_rounds_config(cfg: RunConfig) -> None:
    """The rounds family's refusals of config values, from the config alone (before any data
    is loaded; the strategy's are its kind's, :mod:`fedadapt.strategies.checks`): the training
    settings that need the clients' images; ``federation.evaluate_fn`` loaded (a wrong name
    fails before any data is loaded)."""
    evaluate_fn(cfg)
    if cfg.train.crop_scale is not None and cfg.method.use_cache:
        raise ConfigError("train.crop_scale augments images: it needs method.use_cache=false "
                          "(cached features cannot be cropped)")


def check_strategy_with_clients(cfg: RunConfig, prep: PreparedRun) -> None:
    """The strategy against the partition's real client count and what the clients send
    (before anything is written): refuses a strategy that needs every client to send every
    tensor where some do not, and builds it once (Flower's own checks of its values)."""
    from fedadapt.federation.client.worker import sent_names
    from fedadapt.strategies.build import sample_size
    from fedadapt.strategies.checks import check_counts, check_every_tensor

    spec, model = prep.spec, prep.model
    if not model.federated:
        return
    check_counts(cfg.strategy, cfg.dp, num_clients=spec.num_clients,
                 sampled=sample_size(spec.num_clients, cfg.partition.fraction_fit))
    every = model.communicated_names()
    partial = [c for c in range(spec.num_clients) if len(sent_names(spec, c, model)) < len(every)]
    if cfg.secagg.name != "none":
        _check_secagg(cfg, prep, partial, len(every))
    if partial:
        check_every_tensor(cfg.strategy, cfg.dp, f"method={cfg.method.name}: client "
                                                 f"{partial[0]} trains "
                                                 f"{len(sent_names(spec, partial[0], model))} of "
                                                 f"the {len(every)} communicated tensors")
    # a checkpoint's save and load, done now: what the first checkpoint would refuse fails here
    _checked_state(_built(lambda: make_strategy(cfg, prep)),
                   lambda: _built(lambda: make_strategy(cfg, prep)))


def _check_secagg(cfg: RunConfig, prep: PreparedRun, partial: list[int], every: int) -> None:
    """``secagg=secaggplus`` against the clients: SecAgg+ sums one vector of every global
    tensor from each (a client that trains a subset, or LoRA factors of its own rank, cannot
    join it), and the sum of the sampled clients' quantised values must stay below the masks'
    modulus."""
    from fedadapt.federation.client.worker import sent_names
    from fedadapt.strategies.build import sample_size

    sa, spec = cfg.secagg, prep.spec
    if partial or spec.client_ranks and len(set(spec.client_ranks)) > 1:
        what = (f"client {partial[0]} trains {len(sent_names(spec, partial[0], prep.model))} "
                f"of the {every} communicated tensors" if partial
                else f"the clients' LoRA ranks differ ({sorted(set(spec.client_ranks))})")
        raise ConfigError(f"secagg={sa.name} is invalid for method={cfg.method.name}: it sums "
                          f"every global tensor from every client, and {what}")
    sampled = sample_size(spec.num_clients, cfg.partition.fraction_fit)
    if sampled < 2:
        raise ConfigError(f"partition.fraction_fit={cfg.partition.fraction_fit} is invalid "
                          f"with secagg={sa.name}: SecAgg+ needs at least 2 clients a round "
                          f"({sampled} sampled of {spec.num_clients})")
    if sampled * sa.quantization_range >= sa.modulus_range:
        raise ConfigError(f"secagg.quantization_range={sa.quantization_range} is invalid with "
                          f"{sampled} clients a round: their quantised sum wraps around "
                          f"secagg.modulus_range={sa.modulus_range} (needs clients x "
                          f"quantization_range < modulus_range)")


def _finish_rounds(cfg: RunConfig, run_dir: Path, prep: PreparedRun, state, *, label: str,
                   t0: float, num_rounds: int, resume_state: Optional[dict]) -> dict:
    """The run directory of a client-trained run after its rounds: per-client metrics,
    personalization, the summary and its table and curves (``summary.json`` last)."""
    from fedadapt.results.store import write_jsonl

    write_jsonl(run_dir / CLIENTS_FILE, [{"round": int(r), "client": int(c), **m}
                                         for r, per in state.client_metrics.items()
                                         for c, m in per.items()])
    summary = {
        **summary_head(cfg, label, prep, rounds=num_rounds, setting=cfg.setting.name),
        **_accuracy_summary(cfg, run_dir, prep, state),
        "params": prep.counts,
        "strategy": _strategy_summary(cfg, state.strategy),
        "privacy": _privacy_summary(cfg, state.strategy, state.history, prep.spec.dpsgd),
        **_cost_summary(prep, state, t0, resume_state),
        **summary_tail(prep),
    }
    _write_run_end(cfg, run_dir, label, summary, state.history)
    return summary


def _accuracy_summary(cfg: RunConfig, run_dir: Path, prep: PreparedRun, state) -> dict:
    """The summary's accuracies: the final evaluated round, the reported one
    (``federation.select``), the domains and tiers, personalization (its file written) and
    the best of each accuracy."""
    history = state.history
    evals = [r for r in history if r["global_acc"] is not None or r["client_acc"] is not None]

    def best(key):
        vals = [r[key] for r in evals if r[key] is not None]
        return max(vals) if vals else None

    final = evals[-1] if evals else (history[-1] if history else {})
    selected = select_round(evals, cfg.federation.select)
    return {
        "final": {k: final.get(k) for k in ("round", "global_acc", "client_acc",
                                            "client_acc_weighted", "train_loss",
                                            "global_acc_last", "exit_acc", "tier_acc",
                                            "val_acc")},
        "selection": cfg.federation.select,
        "selected": ({k: selected.get(k) for k in ("round", "val_acc", "global_acc", "client_acc",
                                                   "unseen_acc")} if selected else None),
        "domains": domain_summary(selected, prep.partition, state.client_metrics),
        "tiers": _tier_counts(prep.spec.client_exits),
        "personalization": _personalization(cfg, run_dir, prep.spec, state.personalized),
        "best": {"global_acc": best("global_acc"), "client_acc": best("client_acc")},
    }


def _cost_summary(prep: PreparedRun, state, t0: float, resume_state: Optional[dict]) -> dict:
    """The summary's costs: bytes, the simulated clock, dropped clients, wall time."""
    history = state.history
    trained = [r for r in history if r["round"] >= 1]  # round 0: the initial model's evaluation
    return {
        "total_bytes": state.cum_bytes,
        # a simulated fleet's clock at the end (fleet=): fedadapt-report's "simulated hours"
        **({"simulated_s": state.sim_time} if prep.fleet is not None else {}),
        "client_failures": sum(r.get("clients_failed", 0) for r in history),
        "resumed_after_round": resume_state["round"] if resume_state else None,
        "bytes_up": sum(r["bytes_up"] for r in history),
        "bytes_down": sum(r["bytes_down"] for r in history),
        # this process's time, plus the interrupted process's rounds when resumed
        "wall_s": time.time() - t0 + (resume_state or {}).get("wall_s", 0.0),
        "seconds_per_round": (sum(r["round_s"] for r in trained) / len(trained)
                              if trained else None),
    }


def _write_run_end(cfg: RunConfig, run_dir: Path, label: str, summary: dict,
                   history: list[dict]) -> None:
    """``table.md``, ``curves.png`` and ``summary.json`` (last: it marks the run directory
    complete)."""
    from fedadapt.files import atomic_write
    from fedadapt.results.plots import plot_curves
    from fedadapt.results.store import SUMMARY, write_json
    from fedadapt.results.tables import run_tables

    table = run_tables([summary], title=f"## {cfg.experiment}: {label} on {cfg.dataset.name}")
    atomic_write(run_dir / "table.md", lambda fh: fh.write(table))
    if history:
        plot_curves({label: history}, run_dir / "curves.png",
                    title=f"{label} | {cfg.dataset.name} | alpha {cfg.partition.alpha}")
    write_json(run_dir / SUMMARY, summary)  # last: marks the run directory complete


def _strategy_summary(cfg: RunConfig, strategy) -> dict:
    """Which Flower strategy ran, with its keys (``strategy=`` / ``dp=``)."""
    from dataclasses import asdict

    from fedadapt.strategies.build import describe

    return {"class": describe(strategy),
            "strategy": {**asdict(cfg.strategy), **getattr(cfg.strategy, "kwargs", {})},
            "dp": asdict(cfg.dp)}


def _privacy_summary(cfg: RunConfig, strategy, history: list[dict], dpsgd=None
                     ) -> Optional[dict]:
    """``dp=``'s guarantee at the end: epsilon at delta (fixed clipping with accounting; with
    ``dp=dpsgd`` the largest a client spent, at the largest client delta), the noise multiplier
    (DP-SGD: the smallest client's) and the final clipping norm; None without DP."""
    from fedadapt.strategies.privacy import privacy_spent

    if dpsgd is not None:
        spent = [r[DPSGD_WORST] for r in history if r.get(DPSGD_WORST) is not None]
        return {"dp": cfg.dp.name, "noise_multiplier": min(dpsgd.noise),
                "clipping_norm": dpsgd.max_grad_norm, "epsilon": max(spent, default=None),
                "delta": max(dpsgd.delta), "accounting": f"opacus {dpsgd.accountant}"}
    if cfg.dp.name == "none" or not hasattr(strategy, "noise_multiplier"):
        return None  # no DP, or a method that is not federated (local_only): nothing released
    return {"dp": cfg.dp.name, "noise_multiplier": float(strategy.noise_multiplier),
            "clipping_norm": float(strategy.clipping_norm),
            **(privacy_spent(strategy) or {"epsilon": None, "accounting": None})}


#: The row's largest client epsilon of ``dp=dpsgd`` (its clients' metrics, aggregated).
DPSGD_WORST = "strategy/train/dpsgd_epsilon_max"


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
