"""Where the shipped configuration (``conf/``) and dataset catalogue (``datasets/``) live.

Both folders sit at the repository root and install as package data (``fedadapt.conf`` and
``fedadapt.catalogue`` through setuptools' package-dir mapping), so editable and normal installs
find them the same way.
"""

from __future__ import annotations

import importlib.resources
from pathlib import Path

_PACKAGES = {"conf": "fedadapt.conf", "datasets": "fedadapt.catalogue"}


def resource_dir(name: str) -> Path:
    """Absolute path of ``conf`` or ``datasets``."""
    repo = Path(__file__).resolve().parent.parent / name
    if repo.is_dir():
        return repo
    return Path(str(importlib.resources.files(_PACKAGES[name])))
