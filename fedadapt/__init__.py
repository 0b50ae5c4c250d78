"""fedadapt: federated adaptation of frozen foundation models on Flower."""

from fedadapt import _compat  # noqa: F401  (must come first: see _compat's docstring)

__version__ = "0.1.0"
