"""MOON (Li, He, Song, "Model-Contrastive Federated Learning", CVPR 2021, arXiv 2103.16257,
Eq. 3-4 and Algorithm 1): FedAvg's server (each tensor averaged over the clients that sent it);
the clients' step is :mod:`fedadapt.pfl.moon`'s. Keys: ``strategy.mu`` (the paper: 1 or 5, by
data set) and ``strategy.temperature`` (tau, 0.5).

Each local step minimises ``cross-entropy + mu * l_con`` with

    l_con = -log( e^(sim(z, z_glob)/tau) / (e^(sim(z, z_glob)/tau) + e^(sim(z, z_prev)/tau)) )

``sim`` the cosine similarity, and ``z``, ``z_glob``, ``z_prev`` the representation of the batch
by three models: the one being trained, the global one the client received (fixed for the
round), and the client's own model as it left its previous round (kept in the rule's state,
saved in the run directory and resumed like personal tensors).

On a frozen backbone the representation is what the classifier receives: the input of the
linear map onto the classes (:func:`fedadapt.adapters.personal.head_names`), caught by a forward
pre-hook on that module. With a hidden layer, adapters, LoRA or tokens in front of the
classifier it moves with them; with a linear head alone it is the frozen feature, the same for
the three models: ``l_con`` is a constant with no gradient and MOON trains exactly as FedAvg.

On a client's first round it has no previous model; like the paper's code (whose previous
models start as copies of the global one) ``z_prev`` is then the global model's, so
``l_con = log 2`` with no gradient: its first round is FedAvg's. The global and previous models
run without dropout (evaluation mode) and without gradients. The clients train one at a time
(three models a step; the run's layout line says so). Refused in one line: a setting with early
exits (``setting=anytime``, ``multitier``, ``personalization``), ``dp=dpsgd`` (its per-sample
clipping is not MOON's step; Flower's DP wrappers compose: the update sent is FedAvg's), a
``pfl=`` kind, ``secagg=``, and, when the model is built, a method without one classifier
(FedCLIP's class prompts, a model with exits).
"""

from __future__ import annotations

from flwr.serverapp.strategy import FedAvg

from fedadapt.config import ConfigError
from fedadapt.strategies.capabilities import Capabilities


class Moon(FedAvg):
    """FedAvg's server for MOON's clients. ``mu``: the weight of the contrastive term (the
    paper uses 1 or 5, by data set); ``temperature``: its ``tau`` (0.5 in the paper)."""

    # the update each client sends is FedAvg's (only how it was trained differs), so Flower's
    # DP wrappers calibrate and account as for FedAvg
    capabilities = Capabilities(per_tensor=True, each_tensor=True, fedavg_sensitivity=True,
                                client_rule="moon")

    def __init__(self, mu: float = 1.0, temperature: float = 0.5, **kwargs) -> None:
        super().__init__(**kwargs)
        if not mu >= 0:
            raise ConfigError(f"strategy.mu={mu} is invalid: MOON's contrastive weight must be "
                              f">= 0 (the paper uses 1 or 5)")
        if not temperature > 0:
            raise ConfigError(f"strategy.temperature={temperature} is invalid: must be > 0 "
                              f"(the paper uses 0.5)")
        self.mu, self.temperature = float(mu), float(temperature)
