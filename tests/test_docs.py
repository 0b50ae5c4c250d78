"""The documentation site's generated page is current: docs/configuration.md is what
scripts/config_docs.py writes from the schemas and conf/ now (as docs/strategies.md is checked in
tests/test_strategy_registry.py)."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def config_docs():
    path = ROOT / "scripts" / "config_docs.py"
    spec = importlib.util.spec_from_file_location("config_docs", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_docs_configuration_page_is_current():
    assert (ROOT / "docs" / "configuration.md").read_text() == config_docs().render(), \
        "regenerate: python scripts/config_docs.py"
