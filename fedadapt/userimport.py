"""The researcher's own code, named in the config: a strategy class, an ``evaluate_fn``, a mod.

A name is ``pkg.module.attr``, ``pkg.module:attr``, or ``path/to/file.py:attr``. A file is looked
for as given (relative to the working directory), then next to the user's config (Hydra's
``--config-dir``); it is loaded under a module name derived from its absolute path, once per
process, so a class defined there is the same object at every use and its instances pickle
within the process. :func:`absolute` turns a file's name into its absolute path before it goes
to a Ray worker, whose working directory may differ.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

from fedadapt.config import ConfigError


def _split(name: str) -> tuple[str, str]:
    if ":" in name:
        where, _, attr = name.rpartition(":")
    else:
        where, _, attr = name.rpartition(".")
    if not where or not attr:
        raise ValueError("name it pkg.module.attr, pkg.module:attr or file.py:attr")
    return where, attr


def config_dirs() -> list[Path]:
    """The folders of the user's own config (``--config-dir``), when Hydra composed this run."""
    try:
        from hydra.core.hydra_config import HydraConfig

        sources = HydraConfig.get().runtime.config_sources
    except (ImportError, ValueError, AttributeError):
        return []
    return [Path(s.path) for s in sources
            if getattr(s, "provider", "") == "command-line" and s.schema == "file"]


def find_file(where: str) -> Path | None:
    """The Python file ``where`` names (absolute, or relative to the working directory or a
    config folder); None when ``where`` is not a ``.py`` file's name."""
    if not where.endswith(".py"):
        return None
    path = Path(where).expanduser()
    candidates = [path] if path.is_absolute() else [Path.cwd() / path,
                                                    *(d / path for d in config_dirs())]
    for candidate in candidates:
        if candidate.is_file():
            return candidate.resolve()
    raise FileNotFoundError(f"no file {where} (looked in {Path.cwd()} and the config folders)")


def _load_file(path: Path):
    module = f"fedadapt_user_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    if module not in sys.modules:
        spec = importlib.util.spec_from_file_location(module, path)
        loaded = importlib.util.module_from_spec(spec)
        sys.modules[module] = loaded
        try:
            spec.loader.exec_module(loaded)
        except BaseException:
            del sys.modules[module]
            raise
    return sys.modules[module]


def _on_path() -> None:
    """The working directory and the config folders importable, as ``python -m`` would have
    them (a console script's ``sys.path`` holds neither)."""
    for folder in [Path.cwd(), *config_dirs()]:
        if str(folder) not in sys.path and str(folder.resolve()) not in sys.path:
            sys.path.append(str(folder))


def load(name: str, key: str) -> Any:
    """The object ``name`` names; :class:`ConfigError` naming ``key`` when it cannot be found
    (the import's own error in one line)."""
    _on_path()
    try:
        where, attr = _split(str(name))
        path = find_file(where)
        module = _load_file(path) if path is not None else importlib.import_module(where)
        return getattr(module, attr)
    except Exception as err:  # an import error of the user's module is theirs: say it in one line
        first = (str(err).splitlines() or [""])[0]
        raise ConfigError(f"{key}={name!r} cannot be loaded ({type(err).__name__}: {first}); "
                          f"name it pkg.module.attr, pkg.module:attr or file.py:attr") from err


def absolute(name: str) -> str:
    """``name`` with a ``file.py`` part made absolute (for a process with another working
    directory); other names unchanged."""
    where, attr = _split(str(name))
    path = find_file(where)
    return f"{path}:{attr}" if path is not None else str(name)
