"""One-line diagnostics for a ``fedadapt`` command line that would fail: a launcher plugin not
installed, an option or key that does not exist, a value Hydra cannot parse, a sweep point
whose values are refused. Each names the argument at fault and what works instead; ``main``
(:mod:`fedadapt.cli`) prints it and exits before Hydra starts."""

from __future__ import annotations

from typing import Optional

from omegaconf import DictConfig

from fedadapt.config import FedadaptError
from fedadapt.entry import (
    compose_config,
    config_groups,
    job_configs,
    nearest,
    register_configs,
    undeclared_keys,
)

#: Hydra launchers that come from a plugin: ``hydra/launcher=NAME`` -> (module, pip package).
LAUNCHER_PLUGINS = {
    "joblib": ("hydra_plugins.hydra_joblib_launcher", "hydra-joblib-launcher"),
    "slurm": ("hydra_plugins.hydra_submitit_launcher", "hydra-submitit-launcher"),
    "submitit_slurm": ("hydra_plugins.hydra_submitit_launcher", "hydra-submitit-launcher"),
    "submitit_local": ("hydra_plugins.hydra_submitit_launcher", "hydra-submitit-launcher"),
    "ray": ("hydra_plugins.hydra_ray_launcher", "hydra-ray-launcher"),
    "rq": ("hydra_plugins.hydra_rq_launcher", "hydra-rq-launcher"),
}
#: fedadapt's optional extra that installs a launcher plugin.
LAUNCHER_EXTRAS = {"hydra-joblib-launcher": "joblib", "hydra-submitit-launcher": "slurm"}


def missing_launcher(argv: list[str], installed=None) -> str | None:
    """The one-line error for a ``hydra/launcher=NAME`` whose plugin is not installed, or None.

    ``installed(module) -> bool`` defaults to an import-system lookup (nothing is imported).
    """
    import importlib.util

    def found(module: str) -> bool:
        try:
            return importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):  # a parent package missing, or blocked
            return False

    installed = installed or found
    for arg in argv:
        key, _, name = arg.partition("=")
        if key.lstrip("+~") != "hydra/launcher" or name not in LAUNCHER_PLUGINS:
            continue
        module, package = LAUNCHER_PLUGINS[name]
        if not installed(module):
            extra = LAUNCHER_EXTRAS.get(package)
            hint = f" (or pip install 'fedadapt[{extra}]')" if extra else ""
            return (f"hydra/launcher={name} needs the Hydra plugin {package}, which is not "
                    f"installed: pip install {package}{hint}")
    return None


def config_problem(argv: list[str]) -> str | None:
    """One line for a command line Hydra cannot compose: an option a group does not have
    (``strategy=fedfoo``), a key no schema declares (``strategy.bogus=1``), a value of the wrong
    type (``strategy.eta=abc``); None when it composes, and for flags and sweeps (``-m``,
    ``--cfg``, ...), which go to Hydra as they are, except a flag Hydra does not have
    (:func:`flag_problem`)."""
    import re

    from hydra.errors import HydraException, MissingConfigException
    from omegaconf.errors import OmegaConfBaseException

    if any(a.startswith("-") for a in argv):
        return flag_problem(argv)
    for arg in argv:
        key, eq, value = arg.partition("=")
        if key.startswith("~"):
            return (f"{arg}: deleting a setting is not supported (every key has a default); set "
                    f"it instead, e.g. {key.lstrip('~')}.<key>=<value> or {key.lstrip('~')}="
                    f"<option>")
        if eq and key.lstrip("+") in ("hydra.run.dir", "hydra.sweep.dir", "output_dir") \
                and not value.strip():
            return f"{key.lstrip('+')} is empty: name a folder (or leave it out for the default)"
    try:
        composed = compose_config(argv, default_experiment="quickstart")
        for key, _, _ in undeclared_keys(composed):  # +trian.lr=0.1: composes, declared nowhere
            return _unknown_key(argv, key)
        return compare_problem(argv, composed)
    except MissingConfigException as err:
        text = str(err)
        found = re.search(r"Could not find '([^']+)/([^']+)'", text)
        if not found:
            return text.splitlines()[0]
        group, option = found.groups()
        options = re.findall(r"^\t(\S+)$", text.split("Available options", 1)[-1], re.M)
        return (f"{group}={option} is not an option of {group}"
                f"{nearest(option, options)} (options: {', '.join(options)})")
    except (HydraException, OmegaConfBaseException) as err:
        cause = err.__cause__ if err.__cause__ is not None else err
        text = f"{err}\n{cause}"
        full_key = re.search(r"full_key: (\S+)", text)
        unknown = re.search(r"Could not override '([^']+)'", text) if not full_key or \
            re.search(r"Key '[^']+' (is )?not in", text) is None else full_key
        if unknown:
            return _unknown_key(argv, unknown.group(1))
        first = str(cause).splitlines()[0] if str(cause) else type(cause).__name__
        return _explained(argv, full_key.group(1) if full_key else None, first, text)


def flag_problem(argv: list[str]) -> Optional[str]:
    """One line for a ``--name`` that is none of Hydra's flags (``--rounds 5``): settings are
    ``key=value`` overrides (``rounds=5``); None when every ``--`` flag is Hydra's (or the start of
    one, as argparse takes it)."""
    import re

    from hydra._internal.utils import get_args_parser

    known = re.findall(r"--[a-z][\w-]*", get_args_parser().format_usage())
    for i, arg in enumerate(argv):
        flag, eq, value = arg.partition("=")
        if not flag.startswith("--") or any(k.startswith(flag) for k in known):
            continue
        following = argv[i + 1] if i + 1 < len(argv) else ""
        if not eq and following and not following.startswith("-") and "=" not in following:
            arg, value = f"{arg} {following}", following
        return (f"{arg}: settings are key=value overrides, not flags: write "
                f"{flag[2:]}={value or '<value>'}")
    return None


def compare_problem(argv: list[str], composed: DictConfig) -> Optional[str]:
    """One line for a ``compare`` entry (``method`` or ``method@backbone``) that names no
    option of its group; None when each does (or ``method=`` on the command line runs one)."""
    if any(a.split("=")[0].lstrip("+~") == "method" for a in argv):
        return None
    groups = config_groups()
    for entry in composed.get("compare") or []:
        name, _, backbone = str(entry).partition("@")
        for group, option in (("method", name), ("backbone", backbone)):
            if option and option not in groups[group]:
                return (f"compare entry {entry!r}: {group}={option} is not an option of "
                        f"{group}{nearest(option, groups[group])} (options: "
                        f"{', '.join(groups[group])})")
    return None


#: Hydra's and OmegaConf's messages for an override it cannot take, and what to do instead.
_UNPARSABLE = ("LexerNoViableAltException", "Error parsing override", "mismatched input",
               "extraneous input", "no viable alternative", "token recognition error")


def _explained(argv: list[str], key: str | None, first: str, text: str) -> str:
    """One line for a command line that names real keys but does not compose: the argument at
    fault, what Hydra said, and what works."""
    import re

    if any(marker in text for marker in _UNPARSABLE):
        bad = next((a for a in argv if a in text or a.split("=")[0] in text), None)
        if bad is not None and "=" not in bad:
            return (f"{bad!r} is not KEY=VALUE: a value with spaces needs quotes around the "
                    f"whole override, e.g. 'dataset.path=\"my folder\"'")
        shown = bad or first
        k, _, v = shown.partition("=")
        return (f"{shown}: Hydra cannot parse this value; quote it ({k}='\"{v}\"' in the "
                f"shell) when it holds spaces, non-ASCII letters or symbols such as = : [ ] ,")
    if "Ambiguous value for argument" in text:
        arg = re.search(r"argument '([^']+)'", text)
        shown = arg.group(1) if arg else first
        return (f"{shown}: several values sweep a setting only with -m (fedadapt -m {shown}); "
                f"a value holding commas needs quotes")
    where = f"{key}: " if key else ""
    if key and "is not a subclass of" in first:
        return f"{key} is a group of settings, not a value: set its keys ({key}.<key>=<value>)"
    if key and "is not a ListConfig" in first:
        value = next((a.partition("=")[2] for a in argv if a.split("=")[0].lstrip("+") == key),
                     "...")
        return f"{key}={value} is invalid: a list is expected, e.g. {key}=[{value}]"
    return f"{where}{first}"


def _unknown_key(argv: list[str], key: str) -> str:
    """``strategy.bogus is not a key of strategy=fedadam (its keys: ...)``: the first part of
    ``key`` the config lacks, against the node it was meant for (composed without it)."""
    from hydra.errors import HydraException
    from omegaconf import DictConfig, OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    def about_key(arg: str) -> bool:
        name = arg.split("=")[0].lstrip("+~")
        return name == key or name.startswith(key + ".")

    try:
        node = compose_config([a for a in argv if not about_key(a)],
                              default_experiment="quickstart")
    except (HydraException, OmegaConfBaseException):
        return f"{key} is not a key of the config"
    parts, parent = key.split("."), []
    while len(parts) > 1 and isinstance(node, DictConfig) and parts[0] in node:
        parent.append(parts.pop(0))
        node = OmegaConf.select(node, parent[-1])
    keys = [str(k) for k in node.keys()] if isinstance(node, DictConfig) else []
    missing, where = ".".join(parent + parts[:1]), ".".join(parent)
    elsewhere = _methods_with(parts[0]) if where == "method" else []
    if where and "name" in keys:
        where = f"{where}={node.get('name')}"
    hint = (f" (it is a key of method={', '.join(elsewhere[:6])}"
            f"{', ...' if len(elsewhere) > 6 else ''})" if elsewhere
            else nearest(parts[0], keys))
    return (f"{missing} is not a key of {where or 'the config'}{hint}"
            + (f" (its keys: {', '.join(keys)})" if keys else ""))


def _methods_with(key: str) -> list[str]:
    """The methods whose settings include ``key`` (``rank``: lora, dora, ...)."""
    import dataclasses

    from fedadapt.adapters import load_methods

    return sorted(name for name, spec in load_methods().items()
                  if key in {f.name for f in dataclasses.fields(spec.config_cls)})



#: The flags a sweep checked whole (:func:`sweep_problem`) may carry; with any other flag the
#: command line goes to Hydra as it is.
SWEEP_FLAGS = ("-m", "--multirun")


def sweep_points(argv: list[str]) -> Optional[list[tuple[str, list[str]]]]:
    """The points of a ``-m`` sweep as Hydra's basic sweeper runs them, in its order: ``(label,
    overrides)``, the label naming the point's number (its folder's prefix) and swept values;
    None when it is no such sweep (no ``-m``, another flag, a search's sweeper)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    flags = [a for a in argv if a.startswith("-")]
    if not flags or any(f not in SWEEP_FLAGS for f in flags):
        return None
    task = [a for a in argv if not a.startswith("-")
            and not a.lstrip("+~").startswith(("hydra.", "hydra/"))]
    if any(a.lstrip("+").split("=")[0] in ("search", "resume") for a in task):
        return None  # a search's sweeper draws its own points; a resume replays a sweep
    parsed = OverridesParser.create().parse_overrides(task)
    swept = {o.get_key_element() for o in parsed if o.is_sweep_override()}
    points = [p for batch in BasicSweeper.split_arguments(parsed, None) for p in batch]
    return [(f"{i} ({', '.join(o for o in point if o.split('=')[0] in swept)})", point)
            for i, point in enumerate(points)]


def sweep_problem(argv: list[str]) -> Optional[str]:
    """One line for the first point of a ``-m`` sweep whose config does not compose or whose
    values are refused (every method of a compare job checked), naming the point and the key;
    None when every point is sound (or it is no sweep this checks: :func:`sweep_points`)."""
    from hydra import compose, initialize_config_module
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from fedadapt.paths import CONF_MODULE

    try:
        points = sweep_points(argv)
    except (HydraException, OmegaConfBaseException):
        return None  # Hydra's own parse error says it (config_problem's forms do not sweep)
    if not points:
        return None
    bad = None
    register_configs()  # the schemas the points' presets extend
    with initialize_config_module(config_module=CONF_MODULE, version_base=None):
        for label, point in points:
            try:
                cfg = compose(config_name="config", overrides=point)
                if undeclared_keys(cfg):
                    bad = (label, point, "")
                    break
                job_configs(cfg, point)  # every method's values, as the job checks them
            except FedadaptError as err:
                bad = (label, point, str(err))
                break
            except (HydraException, OmegaConfBaseException) as err:
                bad = (label, point, str(err).splitlines()[0])
                break
    if bad is None:
        return None
    label, point, why = bad  # composition: config_problem's line (it composes on its own)
    return f"sweep point {label}: {config_problem(point) or why}"

