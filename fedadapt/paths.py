"""Where the shipped configuration (``conf/``) and dataset catalogue (``datasets/``) live.

Both folders sit at the repository root and install inside the package through setuptools'
package-dir mapping: ``conf/`` as the regular package ``fedadapt.conf`` (Hydra reads it as
``pkg://fedadapt.conf``), ``datasets/`` as ``fedadapt.catalogue``, a folder of data files with no
``__init__.py`` (one named ``datasets`` would shadow Hugging Face's ``datasets`` whenever the
repository root is on ``sys.path``). Both are found through ``importlib.resources``, never by
walking up from ``__file__``, so an editable install and a wheel behave the same.
"""

from __future__ import annotations

import importlib.resources
from importlib.resources.abc import Traversable

#: Hydra's search path entry for the shipped configuration.
CONF_MODULE = "fedadapt.conf"
CONF_PATH = f"pkg://{CONF_MODULE}"
CATALOGUE_MODULE = "fedadapt.catalogue"


def catalogue() -> Traversable:
    """The dataset catalogue (cards ``<name>.yaml`` and recipes ``<name>.md``)."""
    return importlib.resources.files(CATALOGUE_MODULE)


def catalogue_file(name: str) -> Traversable:
    """One file of the catalogue, e.g. ``catalogue_file("digits.yaml")``."""
    return catalogue().joinpath(name)


def conf_file(*parts: str) -> Traversable:
    """A file of the shipped configuration: ``conf_file("experiment", "quickstart.yaml")``."""
    return importlib.resources.files(CONF_MODULE).joinpath(*parts)
