"""What fedadapt's server needs from an asynchronous strategy (:class:`AsynchronousStrategy`).

A Flower strategy whose clients train asynchronously on a simulated fleet's clock (``fleet=``;
:class:`~fedadapt.strategies.fedbuff.FedBuff`, or a researcher's own ``strategy=custom``)
declares it by having the two members of the protocol; the server then runs each round of its
loop as one server update:

1. ``configure_train(server_round, arrays, config, grid)``: the strategy starts clients among
   the nodes the grid lists (the clients available at the round's start on the fleet's clock);
2. the server exchanges the messages and computes on the fleet's clock when each started client
   will arrive, from its device's compute and bandwidth and the bytes it receives and sends; a
   client that would go offline first gets an error reply and no arrival. It tells the strategy
   :meth:`~AsynchronousStrategy.arrive` before ``aggregate_train``;
3. ``aggregate_train(server_round, replies)``: the strategy applies the updates it deems
   arrived and returns the new global arrays (None: no update this round) and its metrics, whose
   ``train_loss`` is the round's (the loss of the updates applied, not of the clients started);
4. the server's clock (the row's ``sim_time_s``) moves to :attr:`~AsynchronousStrategy.now`.

The server does not cut an asynchronous strategy's clients' work at a deadline
(``fleet.partial_work``). Without a fleet there is no clock: ``arrive`` is never called. Node ids
are the ones the grid lists and the replies come from (``msg.metadata.src_node_id``); the
strategy needs to know nothing else about them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol, runtime_checkable

__all__ = ["AsynchronousStrategy"]


@runtime_checkable
class AsynchronousStrategy(Protocol):
    """A strategy whose clients train asynchronously on a simulated fleet's clock (see the
    module docstring). ``isinstance(strategy, AsynchronousStrategy)`` is how fedadapt's server
    tells it from a synchronous one (the innermost strategy, inside a DP wrapper)."""

    #: The simulated second of the last update the strategy applied (0.0 before the first):
    #: after each ``aggregate_train`` the server's clock moves to it (never back).
    now: float

    def arrive(self, arrivals: Mapping[int, tuple[float, float]]) -> None:
        """The clients that ``configure_train`` started this round and that replied: ``{node
        id: (start, seconds)}``, each arriving at simulated second ``start + seconds``. Called
        once per round, before ``aggregate_train`` (empty when no client started)."""
        ...
