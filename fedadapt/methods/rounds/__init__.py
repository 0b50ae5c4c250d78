"""The ``rounds`` family: the clients train, in federated rounds driven by a Flower strategy.

Its methods are the modules of :mod:`fedadapt.adapters` (heads, FedCLIP's AttAI, the early-exit
methods and the Accumulator). The server side is :mod:`fedadapt.methods.rounds.run` (the plan
of the rounds, checkpoints and resume), :mod:`fedadapt.methods.rounds.strategy` (the strategy
built and checked, the user's code) and :mod:`fedadapt.methods.rounds.summary` (the summary
after the last round); the client side is
:mod:`fedadapt.methods.rounds.clients` (clients trained side by side in a worker, through the
run's mods).
"""

from __future__ import annotations

from fedadapt.methods import Family, register_family


def _train(spec, msg, context):
    from fedadapt.methods.rounds.clients import train_clients

    return train_clients(spec, msg, context)


def _personalize(spec, msg, context):
    from fedadapt.methods.rounds.clients import personalize_clients

    return personalize_clients(spec, msg.content, context)


def _evaluate(spec, msg, context):
    from fedadapt.methods.rounds.clients import evaluate_clients

    return evaluate_clients(spec, msg, context)


class Rounds(Family):
    name = "rounds"
    clients_train = True
    handlers = {("train", None): _train, ("train", "personalize"): _personalize,
                ("evaluate", None): _evaluate}

    def prepare(self, cfg, prep, *, backbone, images, original) -> None:
        """The setting's exits, tiers and corruptions, the client mods; the strategy checked
        against the real client count and what the clients send."""
        from fedadapt.methods.rounds.run import apply_setting, assign_client_ranks
        from fedadapt.methods.rounds.strategy import check_strategy_with_clients, client_mods

        apply_setting(cfg, prep.spec, prep.model)
        assign_client_ranks(cfg, prep.spec)
        prep.spec.train_mods, prep.spec.evaluate_mods = client_mods(cfg)
        check_strategy_with_clients(cfg, prep)
        from fedadapt.federation.simulation.fleet import build_fleet

        prep.fleet = build_fleet(cfg, prep.spec, prep.model)  # a deadline nobody meets: now

    def check(self, cfg, card) -> None:
        from fedadapt.methods.rounds.strategy import check_rounds_config

        check_rounds_config(cfg)

    def check_code(self, cfg) -> None:
        from fedadapt.methods.rounds.strategy import check_code

        check_code(cfg)

    def units(self, cfg) -> int:
        return cfg.rounds

    def run(self, cfg, run_dir, prep, **kw) -> dict:
        from fedadapt.methods.rounds.run import run_rounds

        return run_rounds(cfg, run_dir, prep, **kw)

    def warm_up(self, spec, model) -> None:
        """Find which tensors each exit trains (the first message would otherwise pay it)."""
        from fedadapt.federation.client.worker import client_exits, used_tensors

        used = used_tensors(spec, model)
        for e in sorted({e for c in range(spec.num_clients)
                         for e in (client_exits(spec, c) or [None])}, key=str):
            used(e)


register_family(Rounds())
