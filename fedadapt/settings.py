"""The Accumulator paper's settings: which exit trains, which exits are evaluated, and the
personalization step (Sec. 5.1 and Appendix A of ``accumulator-anytime-fl.txt``).

* **conventional**: every step trains the last exit; evaluation at the last exit.
* **anytime**: every training step draws its exit uniformly from all exits (seeded per client
  and round); the global model is evaluated at every exit, the headline is their mean.
* **multi-tier**: client ``i`` has a fixed exit ``tier[i]``; it runs only blocks ``0..tier[i]``
  in training and evaluation (compute saved, not masked). Tiers are balanced: a seeded
  permutation of the clients takes the tiers in turn.
* **personalization**: multi-tier FL, then each client fine-tunes one part of the model for
  ``setting.epochs`` epochs on its own corrupted data at its tier's exit and keeps it. For a
  model without exits (FedCLIP's "local fine-tuning after FL"), the same step runs on the
  model's own output, and with ``setting.severities=[0]`` on clean data.

Only :mod:`fedadapt.federation.client.training`'s loops run models; this module says which exits.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Optional

import numpy as np

from fedadapt.config import ConfigError, SettingConfig
from fedadapt.data.partition import ClientSplit


def assign_tiers(num_clients: int, tiers: list[int], seed: int) -> list[int]:
    """Balanced, seeded tiers: client ``perm[j]`` gets ``tiers[j % len(tiers)]``."""
    perm = np.random.default_rng([seed, 0x7153]).permutation(num_clients)
    out = [0] * num_clients
    for j, cid in enumerate(perm):
        out[int(cid)] = int(tiers[j % len(tiers)])
    return out


def client_tiers(setting: SettingConfig, num_clients: int, num_exits: int, seed: int
                 ) -> list[int]:
    """Each client's exit, its tier (multitier, personalization); [] when clients have none."""
    if not setting.kind.tiers:
        return []
    tiers = list(range(num_exits)) if setting.tiers is None else list(setting.tiers)
    bad = [t for t in tiers if not 0 <= t < num_exits]
    if bad:
        raise ConfigError(f"setting.tiers={list(setting.tiers)} is invalid: exits {bad} are "
                          f"outside 0..{num_exits - 1} (the backbone has {num_exits} blocks)")
    return assign_tiers(num_clients, tiers, seed)


def step_exits(setting: SettingConfig, exit_of_client: int, num_exits: int
               ) -> Optional[list[int]]:
    """The exits a client uses: a training step draws one uniformly, local evaluation averages
    over them. None = the model's own forward (conventional: the last exit)."""
    if not setting.kind.exits:
        return None
    if setting.kind.exit_per_step:  # capped by the client's device (setting.tiers_from=fleet)
        return list(range(exit_of_client + 1 if setting.tiers_from == "fleet" else num_exits))
    return [exit_of_client]


# -- personalization ------------------------------------------------------------------------

def part_names(model, part: str) -> list[str]:
    """Parameter names that ``setting.personalize=part`` updates; ConfigError if none."""
    names = [n for n, _ in model.named_parameters()]
    trainable = model.trainable_names()
    if part == "trainable":
        chosen = trainable
    elif part == "full":
        chosen = names
    elif part == "adapters":
        chosen = [n for n in trainable if ".adapter." in n]
    elif part == "accumulator":
        chosen = [n for n in trainable if n.startswith("head.") and _is_accumulator(model)]
    elif part == "client_token":
        chosen = [n for n in trainable if n == "head.client_token"]
    elif part == "tuner":  # a PEFT method's tensors in the backbone (LoRA, (IA)^3, BitFit)
        chosen = model.tuner_names()
    else:
        raise ConfigError(f"setting.personalize={part!r} is invalid")
    if not chosen:
        raise ConfigError(f"setting.personalize={part!r} is invalid for this method: it has no "
                          f"such parameters (adapters need method.parallel_adapter=true; "
                          f"accumulator and client_token need method=accumulator; tuner needs a "
                          f"PEFT method: lora, dora, ia3, bitfit)")
    return chosen


def _is_accumulator(model) -> bool:
    return type(getattr(model, "head", None)).__name__ == "Accumulator"


@contextmanager
def only_training(model, names: list[str]):
    """Within the block exactly ``names`` require grad; the flags are restored afterwards."""
    params = dict(model.named_parameters())
    before = {n: p.requires_grad for n, p in params.items()}
    chosen = set(names)
    try:
        for n, p in params.items():
            p.requires_grad_(n in chosen)
        yield
    finally:
        for n, p in params.items():
            p.requires_grad_(before[n])


def personal_indices(setting: SettingConfig, split: ClientSplit
                     ) -> tuple[np.ndarray, np.ndarray]:
    """``(fine-tune, test)`` indices of a client's personalization step.

    ``setting.personal_split=val``: the client's validation split, held out from FL (the
    Accumulator paper's personal set: with ``partition.val_fraction`` = ``test_fraction`` = 0.1
    the clients hold out 20% of CIFAR-100's training images, its 10,000, half to fine-tune on and
    half as the final test); ``train``: the split it trained on in FL.
    """
    fit = split.val if setting.personal_split == "val" else split.train
    return fit, split.test


def assign_client_corruptions(setting: SettingConfig, num_clients: int, seed: int
                              ) -> list[tuple[str, int]]:
    from fedadapt.data.corruptions import assign_corruptions

    return assign_corruptions(num_clients, seed, kinds=list(setting.corruptions),
                              severities=list(setting.severities))


def summarize_personalization(rows: list[dict]) -> dict:
    """Mean accuracy before / after / gain over clients, overall and per tier and severity."""
    def block(rs: list[dict]) -> dict:
        ok = [r for r in rs if np.isfinite(r["acc_before"]) and np.isfinite(r["acc_after"])]
        if not ok:
            return {"clients": 0, "before": None, "after": None, "gain": None}
        before = float(np.mean([r["acc_before"] for r in ok]))
        after = float(np.mean([r["acc_after"] for r in ok]))
        return {"clients": len(ok), "before": before, "after": after, "gain": after - before}

    tiers = sorted({r["tier"] for r in rows} - {-1})  # -1: a model without exits
    return {
        **block(rows),
        "per_tier": {str(t): block([r for r in rows if r["tier"] == t]) for t in tiers},
        "per_severity": {str(s): block([r for r in rows if r["severity"] == s])
                         for s in sorted({r["severity"] for r in rows})},
    }


def per_tier_accuracy(rows: list[tuple[int, float]]) -> dict[str, float]:
    """``{tier: mean accuracy of that tier's clients}`` from ``(tier, accuracy)`` pairs."""
    out: dict[str, list[float]] = {}
    for tier, acc in rows:
        if np.isfinite(acc):
            out.setdefault(str(int(tier)), []).append(float(acc))
    return {t: float(np.mean(v)) for t, v in sorted(out.items(), key=lambda kv: int(kv[0]))}

