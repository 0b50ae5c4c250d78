"""The researcher's own code, named in the config: a strategy class, an ``evaluate_fn``, a mod.

A name is ``pkg.module.attr``, ``pkg.module:attr``, or ``path/to/file.py:attr``. A file is looked
for as given (relative to the working directory), then next to the user's config (Hydra's
``--config-dir``); it is loaded under a module name derived from its absolute path, once per
process, so a class defined there is the same object at every use and its instances pickle
within the process. :func:`absolute` turns a file's name into its absolute path before it goes
to a Ray worker, whose working directory may differ.

A run records each of these files by absolute path and SHA-256 in its run directory
(:data:`USER_FILES`, :func:`file_record`); a resumed job looks them up there first
(:func:`recorded_files`), so ``fedadapt resume=`` works from any folder, and says in one line
when a file changed since. An exception raised inside the user's code becomes a
:class:`UserCodeError` (:func:`user_error`): one line naming their function, the config key
that named it and when it raised, then their traceback frames only.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import os
import sys
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional

from fedadapt.config import ConfigError, FedadaptError


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
    if where in _RECORDED and Path(_RECORDED[where]["file"]).is_file():
        return Path(_RECORDED[where]["file"])  # a resumed run: the file it ran
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


def _import(where: str):
    """``importlib.import_module(where)``; in a resumed run (:func:`recorded_files`) from the
    folder the run imported it from, whatever the working directory."""
    root = (_RECORDED.get(where) or {}).get("root")
    if not root or where in sys.modules:
        return importlib.import_module(where)
    sys.path.insert(0, root)
    try:
        return importlib.import_module(where)
    finally:
        sys.path.remove(root)


def load(name: str, key: str) -> Any:
    """The object ``name`` names; :class:`ConfigError` naming ``key`` when it cannot be found
    (the import's own error in one line)."""
    _on_path()
    try:
        where, attr = _split(str(name))
        path = find_file(where)
        module = _load_file(path) if path is not None else _import(where)
        found = getattr(module, attr)
    except Exception as err:  # an import error of the user's module is theirs: say it in one line
        first = (str(err).splitlines() or [""])[0]
        raise ConfigError(f"{key}={name!r} cannot be loaded ({type(err).__name__}: {first}); "
                          f"name it pkg.module.attr, pkg.module:attr or file.py:attr") from err
    _note(found, key, name)
    return found


def absolute(name: str) -> str:
    """``name`` with a ``file.py`` part made absolute (for a process with another working
    directory); other names unchanged."""
    where, attr = _split(str(name))
    path = find_file(where)
    return f"{path}:{attr}" if path is not None else str(name)


# -- what a run records of the user's files, and a resume reads back --------------------------

#: ``where`` (``file.py`` as named, or a module's dotted name) -> the record it was run with;
#: set only while a resumed job runs (:func:`recorded_files`), consulted before anything else.
_RECORDED: dict[str, dict] = {}


def _sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _library(path: str) -> bool:
    """Whether ``path`` is the standard library's, an installed package's or fedadapt's own."""
    return _own(path) or path.startswith("<") or any(
        path.startswith(root + os.sep) for root in _library_roots())


def _own(path: str) -> bool:
    return any(path.startswith(root + os.sep) for root in _own_roots())


@functools.lru_cache(maxsize=1)
def _own_roots() -> tuple[str, ...]:
    """fedadapt's own source folders (the library, and its strategies and clients packages,
    which install from their own folders), found without importing them."""
    return tuple(sorted({os.path.realpath(folder) for name in
                         ("fedadapt", "fedadapt.clients", "fedadapt.strategies")
                         for folder in importlib.util.find_spec(name).submodule_search_locations}))


@functools.lru_cache(maxsize=1)
def _library_roots() -> tuple[str, ...]:
    import sysconfig

    paths = sysconfig.get_paths()
    return tuple(sorted({os.path.realpath(paths[k]) for k in ("stdlib", "platstdlib",
                                                              "purelib", "platlib")
                         if paths.get(k)}))


def file_record(name: str) -> Optional[dict]:
    """``{"name", "file", "sha256", "root"}`` of the user's file that ``name`` is loaded from
    (``root``: the folder a dotted module name is imported from), or None for an installed
    package's object (``flwr.clientapp.mod:fixedclipping_mod``)."""
    _on_path()
    where, _ = _split(str(name))
    path = find_file(where)
    root = None
    if path is None:
        module = sys.modules.get(where) or importlib.import_module(where)
        file = getattr(module, "__file__", None)
        if not file:
            return None
        path = Path(file).resolve()
        depth = where.count(".") + (1 if path.name == "__init__.py" else 0)
        root = str(path.parents[depth])
    if _library(str(path)):
        return None
    return {"name": str(name), "file": str(path), "sha256": _sha256(path), "root": root}


@contextmanager
def recorded_files(records: list[dict]) -> Iterator[None]:
    """While the block runs (a resumed job), the user's files are the ones the run recorded
    (:func:`file_record`), whatever the working directory: a ``file.py`` by its absolute path,
    a module from the folder it was imported from. A file changed since is said in one line; a
    file that is gone is looked up as usual."""
    from fedadapt.log import log

    before = dict(_RECORDED)
    for rec in records:
        where, _ = _split(rec["name"])
        path = Path(rec["file"])
        if not path.is_file():
            continue
        now = _sha256(path)
        if now != rec.get("sha256"):
            log(f"[job] {path} changed since the run started (sha256 "
                f"{str(rec.get('sha256'))[:12]} -> {now[:12]}): the resumed rounds run it as "
                f"it is now")
        _RECORDED[where] = rec
    try:
        yield
    finally:
        _RECORDED.clear()
        _RECORDED.update(before)


def read_records(folders: Iterable[Path]) -> list[dict]:
    """The records of :data:`USER_FILES` files in ``folders`` (unreadable ones skipped)."""
    import json

    out, seen = [], set()
    for folder in folders:
        path = Path(folder) / USER_FILES
        try:
            rows = json.loads(path.read_text())["files"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        for rec in rows:
            if isinstance(rec, dict) and {"name", "file"} <= set(rec) and \
                    rec["name"] not in seen:
                seen.add(rec["name"])
                out.append(rec)
    return out


#: A run directory's record of the user's files (:func:`file_record` of each name).
USER_FILES = "user_files.json"


# -- errors raised inside the user's code -----------------------------------------------------

class UserCodeError(FedadaptError):
    """An exception raised inside the researcher's own code: one line naming their object and
    when it raised, then their traceback frames only (fedadapt's left out)."""

    def __init__(self, header: str, frames: str = "") -> None:
        super().__init__(f"{header}\n{frames}" if frames else header)
        self.header, self.frames = header, frames


#: A loaded object's file -> ``[(its qualified name, key, name it was given by)]``: what the
#: config named in that file (a class's bases of the user's under the class's name).
_NAMED: dict[str, list[tuple[str, str, str]]] = {}


def _note(obj: Any, key: str, name: str) -> None:
    """Remember the files of ``obj`` (its module; a class's bases that are the user's too)."""
    classes = obj.__mro__ if isinstance(obj, type) else (obj,)
    for item in classes:
        module = sys.modules.get(getattr(item, "__module__", "") or "")
        file = getattr(module, "__file__", None)
        if file and not _library(os.path.realpath(file)):
            entry = (getattr(item, "__qualname__", ""), key, str(name))
            known = _NAMED.setdefault(os.path.realpath(file), [])
            if entry in known:
                known.remove(entry)
            known.append(entry)  # the latest last


def _named_by(filename: str, qualname: str) -> Optional[tuple[str, str]]:
    """``(key, name)`` that named the object a frame of ``filename`` running ``qualname``
    belongs to (its class or function), else the file's latest named object."""
    known = _NAMED.get(os.path.realpath(filename)) or []
    for owner, key, name in reversed(known):
        if owner and (qualname == owner or qualname.startswith(owner + ".")):
            return key, name
    return (known[-1][1], known[-1][2]) if known else None


def user_frames(err: BaseException) -> Optional[list[tuple[traceback.FrameSummary, str]]]:
    """``(frame, qualified name)`` of ``err``'s traceback from the first frame in a file of
    the user's objects (the ones the config named, :func:`load`) on, fedadapt's own frames left
    out (what their code called, their helpers and Flower, stays); None when no frame is in
    their files."""
    frames = [(summary, getattr(frame.f_code, "co_qualname", frame.f_code.co_name))
              for summary, (frame, _) in zip(traceback.extract_tb(err.__traceback__),
                                             traceback.walk_tb(err.__traceback__))]
    first = next((i for i, (f, _) in enumerate(frames)
                  if not f.filename.startswith("<") and os.path.realpath(f.filename) in _NAMED),
                 None)
    if first is None:
        return None
    return [(f, q) for f, q in frames[first:] if not _own(os.path.realpath(f.filename))]


def _said(err: BaseException) -> str:
    first = (str(err).splitlines() or [""])[0]
    return f"{type(err).__name__}: {first}" if first else type(err).__name__


def user_error(err: BaseException, when: str) -> Optional[UserCodeError]:
    """``err`` as a :class:`UserCodeError` when it was raised inside the user's code: ``<their
    function> (<key>=<name>) raised <when>: <exception>``, then their frames; None otherwise."""
    frames = user_frames(err)
    if not frames:
        return None
    summary, qualname = frames[0]
    named = _named_by(summary.filename, qualname)
    who = f"{qualname} ({named[0]}={named[1]})" if named else \
        f"{qualname} ({Path(summary.filename).name})"
    listing = "".join(traceback.format_list([f for f, _ in frames])).rstrip()
    return UserCodeError(f"{who} raised {when}: {_said(err)}",
                         f"its frames (fedadapt's left out):\n{listing}")


def where_raised(err: BaseException) -> str:
    """`` (file.py, line 12, in fn)``: the innermost frame of the user's code in ``err``'s
    traceback, for a one-line reason; empty when none is theirs."""
    frames = user_frames(err)
    if not frames:
        return ""
    summary, qualname = frames[-1]
    return f" ({Path(summary.filename).name}, line {summary.lineno}, in {qualname})"
