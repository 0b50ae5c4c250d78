"""The client side of the drift-correcting strategies SCAFFOLD and FedDyn (their servers:
:mod:`fedadapt.strategies.scaffold`, :mod:`fedadapt.strategies.feddyn`), as client rules the
strategies name in their capabilities (``client_rule``).

* **SCAFFOLD** (Karimireddy et al., ICML 2020, arXiv 1910.06378, Algorithm 1): a client trains
  from the received ``x`` with every step's gradient corrected by ``c - c_i``
  (``ClientJob.linear``), to ``y_i``; then its variate ``c_i+`` is, by option I, the gradient
  of its loss at ``x`` over its data (one pass, as one full batch), or by option II
  ``c_i - c + (x - y_i) / (K lr)``, ``K`` its local steps (with SGD momentum ``rho``, the
  weight its steps' gradients add up to, FedNova's ``sum_k (1 - rho^k) / (1 - rho)``: then
  ``(x - y_i) / (K lr)`` is again a weighted mean of its corrected gradients). It keeps
  ``c_i+`` (zero at first) and sends ``dc_i = c_i+ - c_i``.
* **FedDyn** (Acar et al., ICLR 2021, arXiv 2111.04263, Algorithm 1): a client minimises
  ``L_k(theta) - <g_k, theta> + alpha/2 ||theta - theta^{t-1}||^2`` (``linear = -g_k``, proximal
  ``mu = alpha`` towards what it received), then keeps ``g_k <- g_k - alpha (theta_k -
  theta^{t-1})`` (zero at first).

Both act on the tensors the server sends (the trained ones; the frozen backbone never moves).
The clients train side by side, as FedAvg's.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from fedadapt.federation.client.grouped import ClientJob, ClientResult
from fedadapt.federation.client.worker import sent_names
from fedadapt.pfl.rule import ClientRule, RoundWork, register_strategy_rule
from fedadapt.strategies.fednova import local_steps, step_weights
from fedadapt.strategies.scaffold import C_PREFIX, DC_PREFIX, RULE_PREFIX

_C, _DC = C_PREFIX[len(RULE_PREFIX):], DC_PREFIX[len(RULE_PREFIX):]  # c/, dc/ as received


class ScaffoldRule(ClientRule):
    """SCAFFOLD's client round (see the module docstring); ``option`` ``I`` or ``II``."""

    def __init__(self, option: str = "II") -> None:
        self.option = str(option)

    def train_round(self, work: RoundWork) -> dict[int, ClientResult | str]:
        corrected, variates = [], {}
        for job in work.jobs:
            sent = set(sent_names(work.spec, job.cid, work.model))  # a tier's: its tensors
            c = {n[len(_C):]: t for n, t in work.received[job.cid].items()
                 if n.startswith(_C) and n[len(_C):] in sent}
            state = work.state[job.cid]
            c_i = {n: state[n] if n in state else torch.zeros_like(t) for n, t in c.items()}
            variates[job.cid] = (c, c_i)
            corrected.append(replace(job, linear={n: c[n] - c_i[n] for n in c}))
        results = work.train(corrected)
        grads = self._gradients(work) if self.option == "I" else {}
        for job in work.jobs:
            res = results.get(job.cid)
            if not isinstance(res, ClientResult):
                continue
            c, c_i = variates[job.cid]
            if self.option == "I":
                if isinstance(grads.get(job.cid), str):
                    results[job.cid] = grads[job.cid]
                    continue
                new = {n: grads[job.cid][n] for n in c}
            else:
                train = work.train_config
                steps = local_steps(len(job.indices), train.batch_size, train.local_epochs)
                scale = step_weights(steps, train.momentum) * work.rates[job.cid][0]
                new = {n: c_i[n] if scale <= 0 else
                       (c_i[n].double() - c[n].double() + (job.tensors[n].double()
                        - res.tensors[n].double()) / scale).to(c_i[n].dtype) for n in c}
            work.send[job.cid] = {_DC + n: new[n] - c_i[n] for n in c}
            work.state[job.cid].update(new)
        return results

    @staticmethod
    def _gradients(work: RoundWork) -> dict[int, dict[str, torch.Tensor] | str]:
        """Each client's gradient of its loss at the received tensors over all its data (option
        I): one plain SGD step of lr 1 on one full batch, ``x - (x - grad)``."""
        probe = [replace(job, seed=job.seed + 1) for job in work.jobs]
        train = replace(work.train_config, local_epochs=1, optimizer="sgd", momentum=0.0,
                        weight_decay=0.0, clip_grad_norm=None,
                        batch_size=max([len(j.indices) for j in work.jobs] + [1]))
        out = replace(work, train_config=train).train(probe, lr=1.0, mu=0.0)
        grads: dict[int, dict[str, torch.Tensor] | str] = {}
        for job in probe:
            res = out.get(job.cid)
            if not isinstance(res, ClientResult):
                grads[job.cid] = res if isinstance(res, str) else "no gradient"
                continue
            grads[job.cid] = {n: (job.tensors[n].double() - res.tensors[n].double())
                              .to(job.tensors[n].dtype) for n in res.tensors}
        return grads


class FedDynRule(ClientRule):
    """FedDyn's client round (see the module docstring); ``alpha`` its regulariser's weight."""

    def __init__(self, alpha: float) -> None:
        self.alpha = float(alpha)

    def train_round(self, work: RoundWork) -> dict[int, ClientResult | str]:
        jobs: list[ClientJob] = []
        for job in work.jobs:  # what it sends (not its personal tensors; a tier's tensors)
            names = [n for n in sent_names(work.spec, job.cid, work.model) if n in job.tensors]
            state = work.state[job.cid]
            g = {n: state[n] if n in state else torch.zeros_like(job.tensors[n]) for n in names}
            jobs.append(replace(job, linear={n: -t for n, t in g.items()}))
        if not any(job.linear for job in jobs):  # a method that is not federated sends none
            return work.train()
        results = work.train(jobs, mu=self.alpha)
        for job in jobs:
            res = results.get(job.cid)
            if not isinstance(res, ClientResult):
                continue
            work.state[job.cid].update({
                n: (-lin.double() - self.alpha * (res.tensors[n].double()
                                                  - job.tensors[n].double())).to(lin.dtype)
                for n, lin in job.linear.items()})
        return results


register_strategy_rule("scaffold", lambda strategy: ScaffoldRule(strategy.option))
register_strategy_rule("feddyn", lambda strategy: FedDynRule(strategy.alpha))
