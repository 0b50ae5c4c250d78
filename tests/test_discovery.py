"""Plugins found and imported by one helper (:mod:`fedadapt.discovery`): a plugin that raises on
import is named in the error, and nothing of it stays registered, now or on the next try."""

from __future__ import annotations

import sys

import pytest

from fedadapt.adapters.registry import METHODS, load_methods
from fedadapt.backbones.base import BACKBONE_BUILDERS
from fedadapt.discovery import PluginImportError, import_plugins, plugin_modules
from fedadapt.methods import METHOD_FAMILIES

BROKEN = '''
from dataclasses import dataclass

from fedadapt.adapters.registry import register_method
from fedadapt.backbones.base import register_backbone_family
from fedadapt.config import MethodConfig
from fedadapt.methods import Family, register_family
import {package}.helper  # a module of its own package, loaded before it fails


@dataclass
class BrokenConfig(MethodConfig):
    name: str = "broken_plugin"


register_method("broken_plugin", BrokenConfig, family="broken_family")(lambda *a: None)
register_backbone_family("broken_backbone")(lambda cfg, load: None)


class Broken(Family):
    name = "broken_family"


register_family(Broken())
raise RuntimeError("the plugin's own bug")
'''


def test_a_plugin_that_raises_on_import_is_named_and_registers_nothing(tmp_path, monkeypatch):
    package = "fedadapt_test_plugins"
    root = tmp_path / package
    root.mkdir()
    (root / "__init__.py").write_text("")
    (root / "helper.py").write_text("")
    (root / "good.py").write_text(
        "from fedadapt.backbones.base import register_backbone_family\n"
        "register_backbone_family('good_backbone')(lambda cfg, load: None)\n")
    (root / "broken.py").write_text(BROKEN.format(package=package))
    monkeypatch.syspath_prepend(str(tmp_path))
    load_methods()
    before = (dict(METHODS), dict(BACKBONE_BUILDERS), dict(METHOD_FAMILIES))
    found = plugin_modules(package, skip=("helper",))
    assert found == [f"{package}.broken", f"{package}.good"]
    try:
        for _ in range(2):  # the next try fails the same way, from the start
            with pytest.raises(PluginImportError, match=f"{package}.broken.*the plugin's own bug"):
                import_plugins(found)
            assert (METHODS, BACKBONE_BUILDERS, METHOD_FAMILIES) == before
            assert f"{package}.broken" not in sys.modules
            assert f"{package}.helper" not in sys.modules
        import_plugins([f"{package}.good"])  # a plugin beside it still registers
        assert "good_backbone" in BACKBONE_BUILDERS
    finally:
        BACKBONE_BUILDERS.pop("good_backbone", None)
        for name in [m for m in sys.modules if m.split(".")[0] == package]:
            del sys.modules[name]
