"""Finding plugin modules (methods, method families, backbones) and importing them, each of
which registers itself when imported.

Plugins are found, not listed: :func:`plugin_modules` names the modules of a package and
:func:`import_plugins` imports them. The rule for a plugin that fails to import: the error names
the plugin's module, and nothing of it stays registered. Every registry made by
:func:`plugin_registry` is put back as it was before that module's import began, and the
modules of its top-level package that the import loaded are dropped, so the next attempt runs it
again from the start.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys

#: Every registry plugins fill (:func:`plugin_registry`).
_REGISTRIES: list[dict] = []


class PluginImportError(ImportError):
    """A plugin module raised while it was imported."""


def plugin_registry() -> dict:
    """A new empty registry (name -> what a plugin registers under it) that a failing plugin
    import leaves as it found it."""
    registry: dict = {}
    _REGISTRIES.append(registry)
    return registry


def plugin_modules(package: str, *, skip: tuple[str, ...] = (),
                   packages_only: bool = False) -> list[str]:
    """The full names of ``package``'s modules (sub-packages only with ``packages_only``),
    leaving out those in ``skip`` and those whose name starts with ``_``."""
    path = importlib.import_module(package).__path__
    return [f"{package}.{m.name}" for m in pkgutil.iter_modules(path)
            if not m.name.startswith("_") and m.name not in skip
            and (m.ispkg or not packages_only)]


def import_plugins(modules: list[str]) -> None:
    """Import ``modules`` in order (one already imported is skipped). One that raises leaves
    every registry as it was before its import began, and raises :class:`PluginImportError`
    naming it."""
    for name in modules:
        if name in sys.modules:
            continue
        kept = [dict(registry) for registry in _REGISTRIES]
        loaded = set(sys.modules)
        try:
            importlib.import_module(name)
        except Exception as err:
            for registry, before in zip(_REGISTRIES, kept):
                registry.clear()
                registry.update(before)
            root = name.split(".")[0]
            for extra in set(sys.modules) - loaded:  # its own package's, not torch's
                if extra.split(".")[0] == root:
                    del sys.modules[extra]
            raise PluginImportError(f"the plugin module {name} failed to import, so nothing "
                                    f"of it is registered: {type(err).__name__}: {err}") from err
