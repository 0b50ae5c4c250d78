"""The ``rounds`` family's strategy: the Flower strategy a run builds (``strategy=``, ``dp=``),
checked against the config alone and against the partition's clients before anything is written;
the user's code the config names (strategy class, ``evaluate_fn``, mods), built and recorded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

from fedadapt.config import ConfigError, RunConfig
from fedadapt.methods.run import PreparedRun
from fedadapt.strategies.registry import is_custom


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
    checked_state(strategy, build)


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


def checked_state(strategy, rebuild: Callable, global_arrays=None,
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
    exact = cfg.fleet.exact
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
    checked_state(_built(lambda: make_strategy(cfg, prep)),
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
