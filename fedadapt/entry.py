"""Shared plumbing of the entry points (``fedadapt`` and the other tools): the schemas registered
with Hydra, config composition, the typed run config, and one-line errors.

Tools import this module and the library; the library never imports a tool."""

from __future__ import annotations

import sys
from typing import Callable

from omegaconf import DictConfig, OmegaConf

from fedadapt.config import ConfigError, RunConfig, validate

#: ConfigStore group of the schemas (never a group the root config selects).
SCHEMA_GROUP = "schema"


def register_configs() -> None:
    """Register the schemas with Hydra's ConfigStore (every entry point calls this first).

    The group schemas live in their own group ``schema/`` (``schema/dataset``,
    ``schema/method/<name>``, ...), which the root config never selects: a group's options (what
    ``method=`` accepts, what Hydra lists for an unknown value, what ``glob(*)`` sweeps) are its
    YAML presets only. Each preset extends its schema with ``- /schema/<group>[/<name>]@_here_``.
    """
    from hydra.core.config_store import ConfigStore

    from fedadapt.adapters import load_methods
    from fedadapt.config import (
        BackboneConfig,
        DatasetConfig,
        PartitionConfig,
        SecAggConfig,
        SettingConfig,
        StrategyCustomConfig,
    )
    from fedadapt.federation.simulation.fleet.kinds import fleet_kinds
    from fedadapt.pfl.kinds import pfl_kinds
    from fedadapt.strategies.registry import CUSTOM, dp_schemas, strategy_schemas

    register_resolvers()
    cs = ConfigStore.instance()
    cs.store(name="run_schema", node=RunConfig)
    cs.store(group=SCHEMA_GROUP, name="dataset", node=DatasetConfig)
    cs.store(group=SCHEMA_GROUP, name="backbone", node=BackboneConfig)
    cs.store(group=SCHEMA_GROUP, name="partition", node=PartitionConfig)
    cs.store(group=SCHEMA_GROUP, name="setting", node=SettingConfig)
    cs.store(group=SCHEMA_GROUP, name="secagg", node=SecAggConfig)
    for name, spec in load_methods().items():
        cs.store(group=f"{SCHEMA_GROUP}/method", name=name, node=spec.config_cls)
    for name, schema in strategy_schemas().items():
        cs.store(group=f"{SCHEMA_GROUP}/strategy", name=name, node=schema)
    for name, schema in fleet_kinds().items():
        cs.store(group=f"{SCHEMA_GROUP}/fleet", name=name, node=schema)
    for name, schema in pfl_kinds().items():
        cs.store(group=f"{SCHEMA_GROUP}/pfl", name=name, node=schema)
    # strategy=custom: the constructor's keys are the user's class's, so the node takes any key
    # (to_run_config checks them against the class's signature)
    custom = OmegaConf.structured(StrategyCustomConfig)
    OmegaConf.set_struct(custom, False)
    cs.store(group=f"{SCHEMA_GROUP}/strategy", name=CUSTOM, node=custom)
    for name, schema in dp_schemas().items():
        cs.store(group=f"{SCHEMA_GROUP}/dp", name=name, node=schema)


def register_resolvers() -> None:
    """OmegaConf resolvers of the shipped config: ``${unique_dir:PATH}`` claims a new run or
    sweep folder (see :mod:`fedadapt.rundir`); cached, so a sweep claims one.
    ``${point_dir:NUM,OVERRIDES}`` names a sweep point's folder, cut to a length every file
    system takes."""
    from fedadapt.rundir import claim_new_dir, point_dir

    if not OmegaConf.has_resolver("unique_dir"):
        OmegaConf.register_new_resolver("unique_dir", claim_new_dir, use_cache=True)
    if not OmegaConf.has_resolver("point_dir"):
        OmegaConf.register_new_resolver("point_dir", point_dir)


def to_run_config(cfg: DictConfig) -> RunConfig:
    """Typed, validated :class:`RunConfig` from a composed Hydra config (with the method's own
    ``method.train`` and ``method.strategy`` applied: :func:`with_method_train`). A key that
    no schema declares (``+trian.lr=0.1``, ``+strategy.bogus=1``) is refused, not ignored."""
    from fedadapt.config import ConfigError

    for key, node, known in undeclared_keys(cfg):
        raise ConfigError(f"{key} is not a key of {node}{nearest(key.rsplit('.', 1)[-1], known)}"
                          f" (its keys: {', '.join(known)})")
    from fedadapt.strategies import checks  # noqa: F401 - registers the strategy's checks
    from fedadapt.strategies.registry import CUSTOM

    cfg = with_method_train(cfg)
    if cfg.strategy.get("name") == CUSTOM and OmegaConf.is_missing(cfg.strategy, "target"):
        raise ConfigError("strategy=custom needs strategy.target=pkg.module.Class (your Flower "
                          "strategy), e.g. strategy.target=mystrat.HalfStepFedAvg")
    run = OmegaConf.to_object(cfg)
    if run.strategy.name == CUSTOM:  # the user's class: its keys checked by its signature
        from fedadapt.strategies.custom import custom_config

        run.strategy = custom_config(cfg.strategy)
    return validate(run)


def run_config_from(data) -> RunConfig:
    """A :class:`RunConfig` from a run directory's ``config.yaml`` (a path) or its plain
    mapping: each polymorphic group (method, strategy, dp, fleet, pfl) typed by its own
    schema."""
    import dataclasses

    from fedadapt.adapters import load_methods
    from fedadapt.config import ConfigError, validate
    from fedadapt.federation.simulation.fleet.kinds import fleet_kinds
    from fedadapt.pfl.kinds import pfl_kinds
    from fedadapt.strategies import checks  # noqa: F401 - registers the strategy's checks
    from fedadapt.strategies.registry import CUSTOM, dp_schemas, strategy_schemas

    loaded = OmegaConf.load(data) if not isinstance(data, (dict, DictConfig)) else \
        OmegaConf.create(data)
    typed = OmegaConf.structured(RunConfig)
    custom = loaded.get("strategy", {}).get("name") == CUSTOM
    fleet = dict(loaded.get("fleet") or {"name": "none"})
    kind = fleet_kinds().get(fleet.get("name"))
    if kind is not None:  # an older run directory holds every fleet kind's keys: its kind's
        own = {f.name for f in dataclasses.fields(kind)}
        loaded.fleet = {k: v for k, v in fleet.items() if k in own}
    for group, schemas in (("method", {n: s.config_cls for n, s in load_methods().items()}),
                           ("strategy", strategy_schemas()), ("dp", dp_schemas()),
                           ("fleet", fleet_kinds()), ("pfl", pfl_kinds())):
        if group == "pfl" and group not in loaded:  # a run directory older than pfl=
            continue
        name = loaded.get(group, {}).get("name")
        if group == "strategy" and custom:
            continue
        if name not in schemas:
            raise ConfigError(f"{group}.name={name!r} is unknown to this fedadapt")
        typed[group] = OmegaConf.structured(schemas[name])
    if custom:  # the user's class: typed by its own signature
        from fedadapt.strategies.custom import custom_config

        strategy = custom_config(loaded.strategy)
        loaded = loaded.copy()
        del loaded["strategy"]
        run = OmegaConf.to_object(OmegaConf.merge(typed, loaded))
        run.strategy = strategy
        return validate(run)
    return validate(OmegaConf.to_object(OmegaConf.merge(typed, loaded)))


def undeclared_keys(cfg: DictConfig, prefix: str = "") -> list[tuple[str, str, list[str]]]:
    """``(key, where, valid keys)`` of every key under a schema-typed node that its dataclass
    does not declare (free-form dict fields, e.g. ``backbone.arch``, take any key)."""
    import dataclasses

    from fedadapt.config import StrategyCustomConfig

    out = []
    schema = cfg._metadata.object_type
    if not dataclasses.is_dataclass(schema) or schema is StrategyCustomConfig:
        return out  # strategy=custom: its keys are checked against the user's class
    known = [f.name for f in dataclasses.fields(schema)]
    where = (f"{prefix.rstrip('.')}={cfg.get('name')}" if prefix and "name" in known
             else prefix.rstrip(".") or "the config")
    for key in cfg.keys():
        if key not in known:
            out.append((f"{prefix}{key}", where, known))
        elif OmegaConf.is_dict(cfg._get_node(key)):
            out += undeclared_keys(cfg._get_node(key), f"{prefix}{key}.")
    return out


def nearest(word: str, candidates: list[str]) -> str:
    """`` (did you mean train?)`` for a misspelt key, or nothing."""
    import difflib

    close = difflib.get_close_matches(word, candidates, n=1)
    return f" (did you mean {close[0]}?)" if close else ""


def with_method_train(cfg: DictConfig) -> DictConfig:
    """``cfg`` with ``method.train``'s keys over ``train`` and ``method.strategy`` in place of
    ``strategy``, and ``method.share=a`` under ``strategy=fedsa_lora`` (a copy; ``cfg`` itself
    when none applies). A key that is not a
    ``train`` key, or not the pinned strategy's, fails, named ``method.<key>``."""
    from fedadapt.config import ConfigError

    method = cfg.get("method")
    own = method.get("train") if method is not None else None
    pinned = method.get("strategy") if method is not None else None
    from fedadapt.strategies.registry import CAPABILITIES, strategy_schemas

    caps = CAPABILITIES.get((cfg.get("strategy") or {}).get("name"))
    if caps and caps.shares_only_a and method is not None and method.get("share") == "both":
        cfg = cfg.copy()  # FedSA-LoRA keeps each client's B on the client: the run says so
        cfg.method.share = "a"
    if not own and not isinstance(pinned, DictConfig):
        return cfg
    from omegaconf.errors import OmegaConfBaseException

    out = cfg.copy()
    try:
        if own:
            out.train = OmegaConf.merge(cfg.train, own)
    except OmegaConfBaseException as err:
        raise ConfigError(f"method.train={OmegaConf.to_container(own)} is invalid for "
                          f"method={method.get('name')}: {str(err).splitlines()[0]} (its keys "
                          f"are train.* keys)") from err
    if isinstance(pinned, DictConfig):
        schema = strategy_schemas().get(str(pinned.get("name")))
        try:
            if schema is None:
                raise ValueError(f"no strategy {pinned.get('name')!r}")
            out.strategy = OmegaConf.merge(OmegaConf.structured(schema), pinned)
            out.method.strategy = None  # applied: the run's config shows it as `strategy`
        except (OmegaConfBaseException, ValueError) as err:
            raise ConfigError(f"method.strategy={OmegaConf.to_container(pinned)} is invalid for "
                              f"method={method.get('name')}: {str(err).splitlines()[0]} (a "
                              f"strategy= option with its keys)") from err
    return out


def compose_config(overrides: list[str], *, default_experiment: str = "custom") -> DictConfig:
    """Compose ``conf/config.yaml`` with command-line style ``overrides``.

    Unless the overrides name an experiment, ``default_experiment`` is used (``custom``: no
    preset, so e.g. ``backbone=deit_small`` keeps DeiT-S's own image size).
    """
    from hydra import compose, initialize_config_module

    from fedadapt.paths import CONF_MODULE

    register_configs()
    if not any(o.split("=")[0].lstrip("+~") == "experiment" for o in overrides):
        overrides = [f"experiment={default_experiment}", *overrides]
    with initialize_config_module(config_module=CONF_MODULE, version_base=None):
        return compose(config_name="config", overrides=overrides)


def config_groups() -> dict[str, list[str]]:
    """The config groups users choose from (``group=option``) and their options."""
    from fedadapt.paths import conf_file

    return {g.name: sorted(f.name[:-5] for f in g.iterdir() if f.name.endswith(".yaml"))
            for g in sorted(conf_file().iterdir(), key=lambda g: g.name)
            if g.is_dir() and g.name not in ("hydra", "__pycache__")}


def tool_help(doc: str) -> str:
    """A Hydra-configured tool's ``--help``: its module docstring, then the groups."""
    groups = "\n".join(f"  {g}: {', '.join(opts)}" for g, opts in config_groups().items())
    return (f"{doc.strip()}\n\nOverrides as for fedadapt (group=option, key=value); the "
            f"groups:\n{groups}\n\nEvery key and default: docs/configuration.md.")


def run_cli(fn: Callable[[list[str]], int], argv: list[str] | None = None) -> None:
    """Run ``fn(argv)``; turn config and missing-asset errors into one clear line, exit 2."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from fedadapt.config import FedadaptError
    from fedadapt.progress import configure_output

    configure_output()  # bars on a terminal, plain lines without escape codes elsewhere
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print(tool_help(sys.modules[fn.__module__].__doc__ or ""))
        sys.exit(0)
    try:
        sys.exit(fn(argv))
    except (FedadaptError, HydraException, OmegaConfBaseException) as err:
        print(f"{sys.argv[0].rsplit('/', 1)[-1]}: error: {err}", file=sys.stderr)
        sys.exit(2)


def job_configs(cfg: DictConfig, overrides: list[str]) -> list[tuple[str, RunConfig, str]]:
    """``(method, RunConfig, resolved yaml)`` for each run of this job, all validated up front,
    the user's code of each built and checked (:meth:`fedadapt.methods.Family.check_code`)."""
    from fedadapt.methods import family_of

    out = _job_configs(cfg, overrides)
    for _, run, _ in out:
        family_of(run.method).check_code(run)
    return out


def _job_configs(cfg: DictConfig, overrides: list[str]) -> list[tuple[str, RunConfig, str]]:
    from hydra import compose
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    chosen = [o.split("=", 1)[1] for o in overrides if o.split("=")[0].lstrip("+~") == "method"]
    names = [] if chosen else list(cfg.compare)
    if not names:  # one run, labelled by the preset named (fedavg_clip, not its schema fedclip)
        run = to_run_config(cfg)
        return [(chosen[-1] if chosen else run.method.name, run,
                 OmegaConf.to_yaml(with_method_train(cfg), resolve=True))]
    out = []
    for entry in names:  # "method" or "method@backbone" (a row on another backbone)
        name, _, backbone = entry.partition("@")
        extra = [f"method={name}"] + ([f"backbone={backbone}"] if backbone else [])
        try:
            sub = compose(config_name="config", overrides=overrides + extra)
        except (HydraException, OmegaConfBaseException) as err:  # one line, not Hydra's list
            raise ConfigError(f"compare entry {entry!r}: {str(err).splitlines()[0]}") from err
        out.append((name, to_run_config(sub),
                    OmegaConf.to_yaml(with_method_train(sub), resolve=True)))
    return out

