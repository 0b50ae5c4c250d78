"""Every numeric key of the configuration has its domain checked before anything is loaded:
a negative, NaN or infinite value fails in :func:`fedadapt.config.validate` with one line that
names the key (``seed=-1`` used to fail deep inside numpy)."""

import dataclasses
import math
import typing

import pytest

from fedadapt.adapters import load_methods
from fedadapt.config import (
    BackboneConfig,
    ConfigError,
    DatasetConfig,
    PartitionConfig,
    RunConfig,
    validate,
)


def base(method) -> RunConfig:
    return RunConfig(dataset=DatasetConfig(name="digits"),
                     backbone=BackboneConfig(name="small_cnn", family="small_cnn"),
                     method=method, partition=PartitionConfig(kind="iid"))


def numeric_keys(obj, prefix=""):
    """``(dotted key, kind)`` of every int / float / list-of-numbers field, optional or not."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value, hint = getattr(obj, f.name), hints[f.name]
        if dataclasses.is_dataclass(value):
            yield from numeric_keys(value, prefix + f.name + ".")
            continue
        optional = typing.get_origin(hint) is typing.Union
        inner = [a for a in typing.get_args(hint) if a is not type(None)][0] if optional else hint
        if typing.get_origin(inner) is list:
            if typing.get_args(inner)[0] in (int, float):
                yield prefix + f.name, "list"
        elif inner in (int, float):
            yield prefix + f.name, inner.__name__


def assign(cfg, key: str, value) -> None:
    *path, last = key.split(".")
    obj = cfg
    for part in path:
        obj = getattr(obj, part)
    setattr(obj, last, value)


#: The run's keys once (with linear_head), each method's own keys with that method.
CASES = [(name, key, kind) for name, spec in load_methods().items()
         for key, kind in numeric_keys(base(spec.config_cls()))
         if key.startswith("method.") or name == "linear_head"]


def test_every_numeric_key_is_covered():
    keys = {key for _, key, _ in CASES}
    assert {"seed", "rounds", "backbone.crop_pct", "faults.delay_s", "train.betas",
            "method.proximal_mu", "method.gamma", "method.history_sweep",
            "method.adapter_bottleneck", "method.lam"} <= keys
    assert len(keys) > 60


@pytest.mark.parametrize("method,key,kind", CASES)
def test_out_of_domain_values_fail_naming_the_key(method, key, kind):
    bad = [[-1]] if kind == "list" else [-1] + ([math.nan, math.inf] if kind == "float" else [])
    for value in bad:
        cfg = base(load_methods()[method].config_cls())
        assign(cfg, key, value)
        with pytest.raises(ConfigError) as err:
            validate(cfg)
        assert str(err.value).startswith(f"{key}="), (key, value, str(err.value))


@pytest.mark.parametrize("method", sorted(load_methods()))
def test_defaults_are_valid(method):
    validate(base(load_methods()[method].config_cls()))


def test_seed_bounds():
    cfg = base(load_methods()["linear_head"].config_cls())
    cfg.seed = 2**63 - 1
    validate(cfg)
    cfg.seed = 2**64
    with pytest.raises(ConfigError, match=r"^seed=18446744073709551616 is invalid"):
        validate(cfg)


def test_a_keys_own_rule_is_named_before_the_rule_of_every_number():
    """``method.ranks=[-2,4]`` is refused by the ranks' own rule, not by "a finite number
    >= 0", which every numeric key meets last."""
    cfg = base(load_methods()["lora"].config_cls())
    cfg.method.ranks = [-2, 4]
    with pytest.raises(ConfigError, match=r"^method\.ranks=\[-2, 4\] is invalid: LoRA ranks, "
                                          r"each an integer >= 1"):
        validate(cfg)


def test_the_server_trained_models_share_one_schema_with_their_papers_defaults():
    """``original.*`` and ICIIA's, DUET's and CDC-MMPG's ``method.*`` server training keys are one
    :class:`ServerTrainConfig`, each with its own defaults; AdamW's methods refuse a momentum."""
    from fedadapt.config import OriginalConfig, ServerTrainConfig

    methods = load_methods()
    shared = ("lr", "momentum", "weight_decay", "max_epochs", "patience")
    expected = {"original": (0.01, 0.0, 5e-4, 100, 10), "iciia": (0.01, 0.0, 0.0, 100, 10),
                "duet": (1e-3, 0.0, 0.0, 50, 5), "cdc_mmpg": (1e-4, 0.0, 0.01, 40, 5)}
    for name, values in expected.items():
        cfg = OriginalConfig() if name == "original" else methods[name].config_cls()
        assert isinstance(cfg, ServerTrainConfig)
        assert tuple(getattr(cfg, key) for key in shared) == values, name
    cfg = base(methods["duet"].config_cls(momentum=0.9))
    with pytest.raises(ConfigError, match=r"^method\.momentum=0\.9 is invalid: must be 0"):
        validate(cfg)
