"""Flower ClientApp mods, applied to each client inside the worker that trains it.

A Flower mod wraps a ClientApp handler: ``mod(msg, context, call_next) -> Message``. A worker's
message carries many clients, and Flower's own mods expect one client's records
(``fixedclipping_mod`` clips *the* ArrayRecord of the reply against *the* ArrayRecord it was
sent), so fedadapt applies the run's mods per client: each client's message (its own view of
the worker's message: the arrays it trains and its config) and its reply, built after it
trained side by side with the others, go through the chain (the first mod outermost, as in
Flower's ``ClientApp(mods=[...])``). A mod may read the message and change the reply; one that
hands ``call_next`` another message is refused, since the client has trained already.
"""

from __future__ import annotations

import importlib
from functools import lru_cache
from typing import Callable

from flwr.app import ArrayRecord, Context, Message, RecordDict
from flwr.client.mod.utils import make_ffn

from fedadapt.config import ConfigError
from fedadapt.federation import records


def resolve(name: str, key: str = "federation.train_mods") -> Callable:
    """The mod ``module:function`` (or ``module.function``) names; :class:`ConfigError`
    naming ``key`` when it cannot be imported or is not a function."""
    module, _, attr = name.partition(":") if ":" in name else name.rpartition(".")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError, ValueError) as err:
        raise ConfigError(f"{key}: cannot import the mod {name!r} ({err}); name it "
                          f"module:function, e.g. flwr.clientapp.mod:arrays_size_mod") from err
    if isinstance(fn, type) or not callable(fn):
        raise ConfigError(f"{key}: {name!r} is not a mod function (msg, context, call_next) "
                          f"-> Message")
    return fn


@lru_cache(maxsize=16)
def _chain(names: tuple[str, ...]) -> tuple[Callable, ...]:
    return tuple(resolve(n) for n in names)


def apply(names: list[str], incoming: Message, mine: RecordDict, reply: RecordDict,
          context: Context, trained: list[str] | None = None) -> RecordDict:
    """``reply`` of the client whose records are ``mine`` (its view of ``incoming``, the
    worker's message) after the mods ``names``; an error record if a mod answers with an
    error. ``trained``: the tensors the client trains, to which its view's arrays are cut (a
    mod compares the reply's arrays with those it was sent)."""
    if not names:
        return reply
    if trained is not None and "arrays" in mine.array_records:
        sent = mine.array_records["arrays"]
        mine = RecordDict(dict(mine.items()))
        mine["arrays"] = ArrayRecord({n: sent[n] for n in trained if n in sent})
    client_msg = Message(content=mine, metadata=incoming.metadata)

    def trained_reply(msg: Message, ctx: Context) -> Message:
        if msg is not client_msg:
            raise RuntimeError("a mod handed call_next another message; fedadapt applies mods "
                               "to each client's reply after it trained (clients train side by "
                               "side), so a mod may read the message and change the reply only")
        return Message(reply, reply_to=client_msg)

    out = make_ffn(trained_reply, list(_chain(tuple(names))))(client_msg, context)
    return records.error(f"mod: {out.error.reason}") if out.has_error() else out.content
