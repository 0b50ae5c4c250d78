"""Shared plumbing of the non-Hydra-main entry points (inspect, prefetch, bench)."""

from __future__ import annotations

import sys
from typing import Callable

from omegaconf import DictConfig


def compose_config(overrides: list[str], *, default_experiment: str = "custom") -> DictConfig:
    """Compose ``conf/config.yaml`` with command-line style ``overrides``.

    Unless the overrides name an experiment, ``default_experiment`` is used (``custom``: no
    preset, so e.g. ``backbone=deit_small`` keeps DeiT-S's own image size).
    """
    from hydra import compose, initialize_config_module

    from fedadapt.config import register_configs
    from fedadapt.paths import CONF_MODULE

    register_configs()
    if not any(o.split("=")[0].lstrip("+~") == "experiment" for o in overrides):
        overrides = [f"experiment={default_experiment}", *overrides]
    with initialize_config_module(config_module=CONF_MODULE, version_base=None):
        return compose(config_name="config", overrides=overrides)


def run_cli(fn: Callable[[list[str]], int], argv: list[str] | None = None) -> None:
    """Run ``fn(argv)``; turn config and missing-asset errors into one clear line, exit 2."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from fedadapt.config import FedadaptError

    try:
        sys.exit(fn(sys.argv[1:] if argv is None else argv))
    except (FedadaptError, HydraException, OmegaConfBaseException) as err:
        print(f"{sys.argv[0].rsplit('/', 1)[-1]}: error: {err}", file=sys.stderr)
        sys.exit(2)
