"""MOON's client side (Li, He, Song, "Model-Contrastive Federated Learning", CVPR 2021, arXiv
2103.16257, Eq. 3-4 and Algorithm 1): the step of ``strategy=moon``'s clients, each one's
previous model kept in the rule's state, and MOON's refusals. What it computes, and what differs
on a frozen backbone: :mod:`fedadapt.strategies.moon` (docs/strategies.md).
"""

from __future__ import annotations

from contextlib import nullcontext

import numpy as np
import torch
import torch.nn.functional as F
from torch.func import functional_call

from fedadapt.adapters.personal import head_names
from fedadapt.config import ConfigError, RunConfig, check, register_kind_check
from fedadapt.federation.client.grouped import ClientJob, ClientResult
from fedadapt.federation.client.training import local_optimizer, local_schedule
from fedadapt.federation.client.worker import reason_of
from fedadapt.pfl.rule import ClientRule, RoundWork, register_strategy_rule
from fedadapt.strategies.registry import capabilities_of, sample_level

#: The rule's name (``Capabilities.client_rule`` of ``strategy=moon``).
NAME = "moon"


def contrastive_loss(z: torch.Tensor, z_glob: torch.Tensor, z_prev: torch.Tensor,
                     temperature: float) -> torch.Tensor:
    """MOON's ``l_con`` (Eq. 3), the mean over the batch's rows: the cross-entropy of the
    logits ``[sim(z, z_glob), sim(z, z_prev)] / tau`` with the global pair as the positive."""
    z, z_glob, z_prev = (t.flatten(1).float() for t in (z, z_glob, z_prev))
    logits = torch.stack([F.cosine_similarity(z, z_glob, dim=-1),
                          F.cosine_similarity(z, z_prev, dim=-1)], dim=1) / temperature
    return F.cross_entropy(logits, torch.zeros(len(z), dtype=torch.long, device=z.device))


def classifier_module(model, num_classes: int):
    """The module whose input is the representation: the one holding the classifier's tensors.
    ConfigError for a model without one (classes as text features) or with several (exits)."""
    owners = sorted({n.rsplit(".", 1)[0] for n in head_names(model, num_classes)})
    if not owners:
        raise ConfigError("strategy=moon contrasts the representation the classifier receives, "
                          "and this method has no trainable classifier (its classes are text "
                          "features): choose a method with a head")
    if len(owners) > 1:
        raise ConfigError(f"strategy=moon contrasts the input of one classifier, and this "
                          f"model has {len(owners)} ({', '.join(owners[:3])}, ...: exits): "
                          f"choose a method with one head")
    return model.get_submodule(owners[0])


class MoonRule(ClientRule):
    """MOON's client round (see the module docstring): ``mu`` and ``temperature`` are
    ``strategy.mu`` and ``strategy.temperature``."""

    alone_because = ("MOON's step runs three models (the trained one, the global one, the "
                     "client's previous one) by torch.func.functional_call; the grouped engines "
                     "run one")

    def __init__(self, mu: float, temperature: float) -> None:
        self.mu, self.temperature = float(mu), float(temperature)

    @property
    def label(self) -> str:
        return f"strategy={NAME}"

    def check_model(self, model, num_classes: int) -> None:
        classifier_module(model, num_classes)

    def train_round(self, work: RoundWork) -> dict[int, ClientResult | str]:
        model = work.model
        head = classifier_module(model, work.num_classes)
        # what lies in front of the classifier: the part of the model that moves z
        body = [n for n in model.trainable_names()
                if n not in set(head_names(model, work.num_classes))]
        out: dict[int, ClientResult | str] = {}
        for job in work.jobs:
            try:
                out[job.cid] = self.train_one(work, job, head, work.state[job.cid])
            except Exception as err:  # only this client fails
                out[job.cid] = reason_of(err)
                continue
            work.state[job.cid].clear()  # its model of this round: the next round's previous
            work.state[job.cid].update({n: out[job.cid].tensors[n] for n in body})
        return out

    def train_one(self, work: RoundWork, job: ClientJob, head,
                  previous: dict[str, torch.Tensor]) -> ClientResult:
        """One client's local training from ``job`` (as
        :func:`~fedadapt.federation.client.training.train_local` trains it: the same batches,
        dropout keys, optimiser, FedProx term and clipping), each step's loss plus
        ``mu * l_con``."""
        from fedadapt.devices import autocast, seed_torch
        from fedadapt.grouping import dropout

        spec, model, train = work.spec, work.model, work.train_config
        lr, prox = work.rates[job.cid]
        model.load_tensors(job.tensors)
        dev = next(model.parameters()).device
        masks = dropout.install(model)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        params = [p for _, p in named]
        anchor = [p.detach().clone() for p in params] if prox > 0 else None
        glob = {n: p.detach().clone() for n, p in named}  # what it received (and its own)
        prev = {**glob, **{n: t.to(dev, glob[n].dtype) for n, t in previous.items()}}
        batches, _ = local_schedule(job.indices, train, job.seed, None)
        seed_torch(job.seed, dev)
        model.train()
        opt = local_optimizer(params, train, lr)
        crops = None
        if job.crop_seed is not None and train.crop_scale is not None:
            scale = (float(train.crop_scale[0]), float(train.crop_scale[1]))
            crops = [(scale, np.full(len(b), job.crop_seed, dtype=np.uint64)) for b in batches]
        caught: list[torch.Tensor] = []
        hook = head.register_forward_pre_hook(lambda _m, args: caught.append(args[0]))
        losses, sizes = [], []
        try:
            source = job.source or spec.train_source
            for t, (x, y) in enumerate(source.stream(batches, dev, crops)):
                fixed = self.mu > 0  # with mu = 0 only the cross-entropy: FedAvg's step
                if fixed:
                    z_glob, z_prev = self.fixed_representations(model, x, glob, prev, caught,
                                                                spec.precision, dev)
                caught.clear()
                keyed = (dropout.keyed(torch.tensor(dropout.step_key(job.seed, t)))
                         if masks else nullcontext())
                with autocast(dev.type, spec.precision), keyed:
                    loss = model.training_loss(x, y)
                loss = loss.float()
                if fixed:
                    loss = loss + self.mu * contrastive_loss(caught[-1], z_glob, z_prev,
                                                             self.temperature)
                caught.clear()
                if anchor is not None:
                    loss = loss + 0.5 * prox * sum(
                        (p - a).pow(2).sum() for p, a in zip(params, anchor))
                opt.zero_grad(set_to_none=True)
                loss.backward()
                if train.clip_grad_norm is not None:
                    torch.nn.utils.clip_grad_norm_(params, train.clip_grad_norm)
                opt.step()
                losses.append(loss.detach())
                sizes.append(len(y))
        finally:
            hook.remove()
        total = 0.0  # summed in float64 in step order, as train_local does
        for value, n in zip(torch.stack(losses).double().tolist() if losses else [], sizes):
            total += value * n
        seen = sum(sizes)
        return ClientResult(model.tensors(model.trainable_names()), total / max(seen, 1), seen)

    @staticmethod
    def fixed_representations(model, x, glob, prev, caught, precision, dev):
        """``(z_glob, z_prev)`` of batch ``x``: the classifier's input under the global and the
        previous tensors, without gradients or dropout (the previous model is the global one
        where the client has none yet)."""
        from fedadapt.devices import autocast

        model.eval()
        try:
            with torch.no_grad(), autocast(dev.type, precision):
                caught.clear()
                functional_call(model, glob, (x,))
                z_glob = caught[-1]
                caught.clear()
                functional_call(model, prev, (x,))
                z_prev = caught[-1]
        finally:
            model.train()
        return z_glob, z_prev


def make_rule(strategy) -> MoonRule:
    """``strategy=moon``'s client side from its config."""
    return MoonRule(strategy.mu, strategy.temperature)


def check_moon(cfg: RunConfig) -> None:
    """MOON's refusals, before any data is read (its keys' values: the strategy's own
    constructor; a method without a classifier: when the model is built)."""
    if capabilities_of(cfg.strategy).client_rule != NAME:
        return
    mu, tau = getattr(cfg.strategy, "mu", 1.0), getattr(cfg.strategy, "temperature", 0.5)
    check(mu >= 0, "strategy.mu", mu, "MOON's contrastive weight must be >= 0 (the paper: 1 "
                                      "or 5)")
    check(tau > 0, "strategy.temperature", tau, "must be > 0 (the paper: 0.5)")
    check(not cfg.setting.kind.exits, "setting", cfg.setting.name,
          "strategy=moon contrasts the input of one classifier, and this setting trains early "
          "exits: use setting=conventional")
    check(not sample_level(cfg.dp), "dp", cfg.dp.name,
          "strategy=moon's clients train by their own step (three models a step), which "
          "dp=dpsgd's per-sample clipping does not run: use dp=none or one of Flower's "
          "wrappers")


register_strategy_rule(NAME, make_rule)
register_kind_check("strategy.moon", check_moon)
