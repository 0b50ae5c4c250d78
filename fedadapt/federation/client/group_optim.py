"""The grouped clients' optimisers: torch's SGD (momentum, weight decay) / Adam / AdamW update
rules applied per client to ``[K, ...]`` tensors, or to one flat buffer of them, and per-client
gradient-norm clipping (:mod:`fedadapt.federation.client.grouped`)."""

from __future__ import annotations

import torch

from fedadapt.config import TrainConfig


class StackedOptimizer:
    """Per-client SGD (momentum, weight decay) / Adam / AdamW over ``[K, ...]`` tensors, torch's
    update rules; ``step(used, active)`` updates client k's slice of the i-th tensor only where
    ``used[i, k]`` (a device tensor), as torch skips a tensor without a gradient (its state
    untouched too); ``active[i]`` (on the host): whether any client used it. Plain SGD (no
    momentum, no weight decay) needs no mask (an unused slice's gradient is zero): one fused
    update of every tensor."""

    def __init__(self, stacked: dict[str, torch.Tensor], train: TrainConfig, lr: float) -> None:
        self.tensors, self.train, self.lr = stacked, train, lr
        self.state: dict[str, dict[str, torch.Tensor]] = {}

    def zero_grad(self) -> None:
        for t in self.tensors.values():
            t.grad = None

    @torch.no_grad()
    def step(self, used: torch.Tensor, active) -> None:
        t = self.train
        if t.optimizer == "sgd" and not t.momentum and not t.weight_decay:
            # plain SGD: a client's slice of a tensor its step did not reach has a zero
            # gradient (its loss does not depend on it), so p - lr * g leaves it as torch's
            # skip would; one fused update for every tensor, as torch's own foreach SGD
            ps = [p for i, p in enumerate(self.tensors.values())
                  if p.grad is not None and active[i]]
            if ps:
                torch._foreach_add_(ps, [p.grad for p in ps], alpha=-self.lr)
            return
        for i, (name, p) in enumerate(self.tensors.items()):
            if p.grad is None or not active[i]:
                continue
            shape = (-1,) + (1,) * (p.dim() - 1)
            m = used[i].view(shape)
            new = self._sgd(name, p, m) if self.train.optimizer == "sgd" else \
                self._adam(name, p, m, shape)
            p.copy_(torch.where(m, new, p))

    def _sgd(self, name: str, p: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        t = self.train
        d_p = p.grad if t.weight_decay == 0 else p.grad + t.weight_decay * p
        if t.momentum:
            st = self.state.setdefault(name, {"buf": torch.zeros_like(p),
                                              "started": torch.zeros_like(m)})
            buf = torch.where(st["started"], st["buf"] * t.momentum + d_p, d_p)
            st["buf"] = torch.where(m, buf, st["buf"])
            st["started"] = st["started"] | m
            d_p = buf
        return p - self.lr * d_p

    def _adam(self, name: str, p: torch.Tensor, m: torch.Tensor, shape) -> torch.Tensor:
        t = self.train
        beta1, beta2 = t.betas
        st = self.state.setdefault(name, {"exp_avg": torch.zeros_like(p),
                                          "exp_avg_sq": torch.zeros_like(p),
                                          "step": torch.zeros(p.shape[0], device=p.device)})
        step = st["step"] + m.view(-1).to(st["step"].dtype)
        grad, base = p.grad, p
        if t.weight_decay and t.optimizer == "adamw":
            base = p * (1 - self.lr * t.weight_decay)
        elif t.weight_decay:
            grad = grad + t.weight_decay * p
        exp_avg = torch.where(m, st["exp_avg"].lerp(grad, 1 - beta1), st["exp_avg"])
        exp_avg_sq = torch.where(m, st["exp_avg_sq"] * beta2 + (1 - beta2) * grad * grad,
                                 st["exp_avg_sq"])
        st.update(exp_avg=exp_avg, exp_avg_sq=exp_avg_sq, step=step)
        safe = step.clamp(min=1).view(shape)
        bias1, bias2 = 1 - beta1 ** safe, 1 - beta2 ** safe
        denom = exp_avg_sq.sqrt() / bias2.sqrt() + t.eps
        return base - (self.lr / bias1) * exp_avg / denom


class FlatOptimizer:
    """:class:`StackedOptimizer`'s update rules over one flat buffer: every client's every
    trainable tensor is a view of ``flat`` (slot-major within each tensor), their gradients
    views of one flat gradient (set before the backward, which accumulates into them in place),
    so each step is a handful of operations whatever the number of tensors. ``used[i, k]``
    (whether client k's step reached tensor i) becomes an element mask by one
    ``repeat_interleave``; a step leaves what a client did not reach, and its state, as torch's
    optimisers leave a tensor without a gradient."""

    def __init__(self, flat: torch.Tensor, stored: dict[str, torch.Tensor], train: TrainConfig,
                 lr: float) -> None:
        self.flat, self.train, self.lr = flat, train, lr
        self.grad = torch.zeros_like(flat)
        counts = []
        for p in stored.values():
            at = p.storage_offset() - flat.storage_offset()
            p.grad = self.grad[at:at + p.numel()].view(p.shape)
            counts += [p.numel() // p.shape[0]] * p.shape[0]
        self.counts = torch.tensor(counts, dtype=torch.int64, device=flat.device)
        self.state: dict[str, torch.Tensor] = {}

    def zero_grad(self) -> None:
        self.grad.zero_()

    def _mask(self, used: torch.Tensor) -> torch.Tensor:
        """``[tensors, K]`` -> an element mask of the flat buffer."""
        return used.reshape(-1).repeat_interleave(self.counts, output_size=self.flat.numel())

    @torch.no_grad()
    def step(self, used: torch.Tensor, active=None) -> None:
        t, p, g = self.train, self.flat, self.grad
        if t.optimizer == "sgd" and not t.momentum and not t.weight_decay:
            p.add_(g, alpha=-self.lr)  # an unreached slice's gradient is zero: left as it was
            return
        m = self._mask(used)
        if t.optimizer == "sgd":
            d_p = g if not t.weight_decay else g + t.weight_decay * p
            if t.momentum:
                st = self.state
                if "buf" not in st:
                    st["buf"], st["started"] = torch.zeros_like(p), torch.zeros_like(m)
                buf = torch.where(st["started"], st["buf"] * t.momentum + d_p, d_p)
                st["buf"] = torch.where(m, buf, st["buf"])
                st["started"] = st["started"] | m
                d_p = buf
            p.copy_(torch.where(m, p - self.lr * d_p, p))
            return
        beta1, beta2 = t.betas
        st = self.state
        if "exp_avg" not in st:
            st.update(exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p),
                      step=torch.zeros(len(self.counts), device=p.device))
        st["step"] = st["step"] + used.reshape(-1).to(st["step"].dtype)
        step = st["step"].repeat_interleave(self.counts, output_size=p.numel())
        grad, base = g, p
        if t.weight_decay and t.optimizer == "adamw":
            base = p * (1 - self.lr * t.weight_decay)
        elif t.weight_decay:
            grad = grad + t.weight_decay * p
        st["exp_avg"] = torch.where(m, st["exp_avg"].lerp(grad, 1 - beta1), st["exp_avg"])
        st["exp_avg_sq"] = torch.where(m, st["exp_avg_sq"] * beta2 + (1 - beta2) * grad * grad,
                                       st["exp_avg_sq"])
        safe = step.clamp(min=1)
        bias1, bias2 = 1 - beta1 ** safe, 1 - beta2 ** safe
        denom = st["exp_avg_sq"].sqrt() / bias2.sqrt() + t.eps
        p.copy_(torch.where(m, base - (self.lr / bias1) * st["exp_avg"] / denom, p))


def clip_per_client(stacked: dict[str, torch.Tensor], max_norm: float) -> None:
    """Each client's gradient norm over all its tensors clipped to ``max_norm``, as
    ``torch.nn.utils.clip_grad_norm_`` does for one client."""
    grads = [t.grad for t in stacked.values() if t.grad is not None]
    if not grads:
        return
    sq = sum(g.reshape(g.shape[0], -1).pow(2).sum(1) for g in grads)
    coef = (max_norm / (sq.sqrt() + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.mul_(coef.view((-1,) + (1,) * (g.dim() - 1)))
