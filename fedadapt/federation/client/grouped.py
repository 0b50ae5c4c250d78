"""Grouped local training: K clients trained side by side on one worker, one frozen backbone.

Every client keeps its own trainable tensors and optimiser state, stacked along a leading client
dimension ``[K, ...]``. Two engines, chosen per model (:func:`engine_of`, named in the run's
layout line):

* **Grouped forms** (:mod:`fedadapt.grouping.forms`; every client-trained method of the
  presets): at each local step the K clients' batches are one batch of K x B rows (a client's
  last batch padded, its padding weighing 0); the frozen backbone runs once on all of them as
  plain PyTorch (its fused attention, native autocast), and each module a client trains applies
  that client's tensors to its rows by batched products (``bmm`` / ``baddbmm`` over the stacked
  tensors). Clients at different exits (anytime) share one forward: the blocks every client runs
  once for all, each deeper block on the clients that go deeper (ordered deepest first).
  ``compile=True`` (``federation.compile``) runs the step through ``torch.compile`` at fixed
  shapes (every slot present at every step, a finished client's rows all padding;
  ``mode="reduce-overhead"``, CUDA graphs, on a GPU; steps whose clients drew different exits
  stay eager).
* **vmap** (the general path, for what has no grouped form: full fine-tuning, a user's module
  without a form): ``torch.func.vmap`` over ``torch.func.functional_call``, clients in buckets
  of one batch size and exit.

The same semantics as :func:`fedadapt.federation.client.training.train_local` run K times,
either way:

* every random draw comes from the client's own seed: its shuffling, its exit per step (anytime),
  its crops (a hash of its crop seed and the image), its dropout masks (a hash of its step key,
  :mod:`fedadapt.grouping.dropout`), so results never depend on which clients share a group;
* clients of different sizes run their own number of steps (a finished client's tensors stay
  as its last step left them);
* the optimiser (:class:`~fedadapt.federation.client.group_optim.StackedOptimizer`: SGD with
  momentum / Adam / AdamW, torch's update rules) keeps per-client state and updates a client's
  tensor only at steps where that client's loss used it, as torch's optimisers skip tensors
  without a gradient: an anytime client that draws exit 3 leaves exit 7's head (and its
  momentum) alone; plain SGD updates every tensor in one fused call;
* FedProx's ``mu/2 ||w - w_start||^2`` and gradient-norm clipping are per client.

With these the grouped result equals K sequential clients to floating-point tolerance in fp32
(``tests/test_grouped.py``: K = 1, 3, 8, unequal sizes, every client-trained method), and in
bf16 adds no more error than bf16 itself makes (``tests/test_grouped_bf16.py``, on the CPU and
on CUDA).

Precision and kernels inside ``vmap`` (seen with torch 2.11 on an H200 and 2.13 on the CPU):

* **bf16.** Autocast does not reach several ops inside ``vmap`` (a convolution meets a
  bf16-held weight with an fp32 input and raises; ``linear`` adds its bias in fp32; attention
  runs in fp32); :class:`~fedadapt.federation.client.group_vmap.VmapAutocast` applies
  autocast's casts to those ops by hand and runs them with autocast off, as autocast does, so a
  grouped client computes in the dtypes one client computes in.
* **Attention.** The math kernel, on every device
  (:func:`~fedadapt.federation.client.group_vmap.attention_for_vmap`):
  ``benchmarks/investigations/vmap_attention.py`` found on an H200 that the memory-efficient
  kernel's backward
  fails under ``vmap`` (fp32 and bf16), cuDNN's runs in bf16 but returns wrong values (3.5
  relative error), and flash runs in bf16 only (1.2e-2 from fp32, as the math kernel's 1.5e-2).
* **Fallback.** A group that raises is retried one client at a time
  (:mod:`fedadapt.federation.client.worker`), and the sizing probe that raises makes a run train one
  client at a time from the start (:func:`fedadapt.federation.simulation.sizing.size_simulation`),
  each with one line naming the cause.

The step loop reads nothing back from the device: which tensors each client's step updates is
known on the host from its exit (one ``[steps, tensors, K]`` mask sent once per group), losses
are summed on the device; the start tensors go up in one transfer and the final tensors and
losses come back in two (through a pinned buffer on CUDA; ``tests/test_grouped.py`` counts
the reads).

The parts: :mod:`~fedadapt.federation.client.group_jobs` (the jobs, their schedules, which
tensors a step reaches), :mod:`~fedadapt.federation.client.group_optim` (the optimisers),
:mod:`~fedadapt.federation.client.group_forms` and :mod:`~fedadapt.federation.client.group_vmap`
(the two engines).
"""

from __future__ import annotations

from typing import Optional

from torch import nn

from fedadapt.config import TrainConfig
from fedadapt.data.sources import DataSource
from fedadapt.federation.client.group_forms import train_forms
from fedadapt.federation.client.group_jobs import ClientJob, ClientResult, StepLoss, UsedTensors
from fedadapt.federation.client.group_vmap import train_vmap
from fedadapt.grouping import forms


def train_group(model: nn.Module, source: DataSource, jobs: list[ClientJob], train: TrainConfig,
                *, lr: float, precision: str, proximal_mu: float = 0.0,
                used: Optional[UsedTensors] = None, compile: bool = False
                ) -> list[ClientResult]:
    """Train ``jobs`` side by side (see the module docstring) in ``precision`` (``fp32`` /
    ``bf16``, the run's); one result per job, in order. Through the grouped forms where the
    model has them (:func:`engine_of`), else through ``vmap``; ``compile``: the grouped forms'
    step captured by ``torch.compile`` (:mod:`fedadapt.federation.capture`)."""
    if engine_of(model)[0] == "forms":
        return train_forms(model, source, jobs, train, lr=lr, precision=precision,
                           proximal_mu=proximal_mu, used=used, compile=compile)
    return train_vmap(model, source, jobs, train, lr=lr, precision=precision,
                      proximal_mu=proximal_mu, used=used)


def engine_of(model: nn.Module) -> tuple[str, Optional[str]]:
    """How ``model``'s clients train side by side: ``("forms", None)``, or ``("vmap", why)``
    where a trainable module has no grouped form (:func:`fedadapt.grouping.forms.unsupported`)."""
    why = forms.unsupported(model)
    return ("vmap", why) if why else ("forms", None)


__all__ = ["ClientJob", "ClientResult", "StepLoss", "UsedTensors", "engine_of", "train_group"]
