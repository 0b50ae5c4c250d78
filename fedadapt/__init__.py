"""fedadapt: federated adaptation of frozen foundation models on Flower."""

from fedadapt import cores

cores.choose_wait_policy()  # before torch loads OpenMP (fedadapt.cores)

from fedadapt import _compat  # noqa: E402, F401  (before torchvision: see _compat's docstring)

__version__ = "0.1.0"
