"""Flower ClientApp mods, wrapped around each client's handler as Flower's ClientApp does.

A Flower mod wraps a ClientApp handler: ``mod(msg, context, call_next) -> Message``; the first
mod of ``ClientApp(mods=[...])`` is the outermost. A mod may read or change the incoming
message, replace it (``call_next(another_message, context)``), answer without calling the
handler, and change or replace the reply. fedadapt keeps exactly that for each client, although
the clients of one worker train side by side in one step (:func:`around_clients`): each
client's chain runs in its own thread up to its ``call_next``; once every client has reached
its handler (or answered without it), the handler runs for all of them at once on the messages
the mods passed on, and each thread carries its client's reply back out through its chain.
Each client sees its own message (its view of the worker's message, the arrays cut to what it
trains, as a deployment client gets them) and its own ``Context`` (see
:mod:`fedadapt.federation.client.worker`).

A mod is named ``module:function`` (or ``module.function``, ``file.py:function``), or given as
a class with its arguments as Hydra instantiates it (``{_target_: flwr.client.mod.LocalDpMod,
clipping_norm: 1.0, ...}``). Flower's ``LocalDpMod`` reads messages in Flower's older layout
(``fitins.parameters`` / ``fitres.parameters``); it is handed that layout and its result is put
back (:func:`legacy_layout`).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Context,
    Error,
    Message,
    MetricRecord,
    RecordDict,
)
from flwr.client.mod.utils import make_ffn
from flwr.common.constant import ErrorCode

from fedadapt.config import ConfigError
from fedadapt.federation.wire import records

#: A handler of many clients at once: ``{cid: message}`` -> ``{cid: reply records}`` (an error
#: record for a client that failed; no entry for one that answered too late).
Handler = Callable[[dict[int, Message]], dict[int, RecordDict]]


def resolve(entry: Any, key: str = "federation.train_mods") -> Callable:
    """The mod ``entry`` names (a name, or ``{_target_: Class, **arguments}``);
    :class:`ConfigError` naming ``key`` when it cannot be made or is not a mod."""
    from fedadapt.userimport import load

    if isinstance(entry, dict) or hasattr(entry, "keys"):
        spec = dict(entry)
        target = spec.pop("_target_", None)
        if not target:
            raise ConfigError(f"{key}: {spec} is invalid: a mod given as a mapping names its "
                              f"class as _target_ (with its arguments as the other keys)")
        cls = load(target, key)
        try:
            fn = cls(**spec)
        except (TypeError, ValueError) as err:
            raise ConfigError(f"{key}: {target}({spec}) is invalid: {err}") from err
    else:
        fn = load(str(entry), key)
    if isinstance(fn, type) or not callable(fn):
        hint = "; a class is given with its arguments: {_target_: CLASS, ...}" \
            if isinstance(fn, type) else ""
        raise ConfigError(f"{key}: {entry!r} is not a mod (msg, context, call_next) -> "
                          f"Message{hint}")
    _check_signature(fn, entry, key)
    return legacy_layout(fn) if _reads_legacy_layout(fn) else fn


def _check_signature(fn: Callable, entry: Any, key: str) -> None:
    """A mod is called ``mod(msg, context, call_next)``: one that cannot take those three
    arguments is refused now, in one line, not in every client of round 1."""
    import inspect

    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: called as it is
        return
    try:
        signature.bind(object(), object(), object())
    except TypeError as err:
        raise ConfigError(f"{key}: {_label(entry)} takes {signature}, not a mod's (msg, "
                          f"context, call_next) ({err})") from err


def _label(entry: Any) -> str:
    """How a mod is named in messages: its name, or its class (``_target_``)."""
    if isinstance(entry, dict) or hasattr(entry, "keys"):
        return str(dict(entry).get("_target_"))
    return str(entry)


class ModError(Exception):
    """A mod that raised or returned something other than a Message; the message names it."""


def _checked(mod: Callable, label: str) -> Callable:
    """``mod`` as the chain calls it: an exception raised inside it (not one that passed
    through its ``call_next`` from the mods and handler inside it) and a return value that is
    not a Message become a :class:`ModError` naming the mod, in one line."""
    from fedadapt.userimport import where_raised

    def checked(msg: Message, context: Context, call_next) -> Message:
        def inner(m: Message, ctx: Context) -> Message:
            try:
                return call_next(m, ctx)
            except BaseException as err:
                err.__dict__["_fedadapt_inner"] = True  # not this mod's own
                raise

        try:
            out = mod(msg, context, inner)
        except ModError:
            raise
        except Exception as err:
            if err.__dict__.get("_fedadapt_inner"):
                raise
            raise ModError(f"mod {label} raised {type(err).__name__}: "
                           f"{(str(err).splitlines() or [''])[0]}{where_raised(err)}") from err
        if not isinstance(out, Message):
            raise ModError(f"mod {label} returned {type(out).__name__}, not a Message (a mod "
                           f"returns call_next(msg, context), or a Message of its own)")
        return out

    return checked


_CHAINS: dict[str, list[Callable]] = {}


def chain(entries: list) -> list[Callable]:
    """The mods of ``entries``, made once per process (a mod object keeps its own state), each
    checked (:func:`_checked`)."""
    cache_key = repr(entries)
    if cache_key not in _CHAINS:
        _CHAINS[cache_key] = [_checked(resolve(e), _label(e)) for e in entries]
    return _CHAINS[cache_key]


def as_message(content: RecordDict, incoming: Message, cid: int, node: int) -> Message:
    """Client ``cid``'s own message: its records, the worker's message's metadata addressed to
    the client's node."""
    from flwr.app import Metadata

    m = incoming.metadata
    return Message(content=content, metadata=Metadata(
        run_id=m.run_id, message_id=m.message_id, src_node_id=m.src_node_id, dst_node_id=node,
        reply_to_message_id=m.reply_to_message_id, group_id=m.group_id, created_at=m.created_at,
        ttl=m.ttl, message_type=m.message_type))


def _reply(reply: Optional[RecordDict], msg: Message) -> Message:
    reason = records.error_of(reply) if reply is not None else "no reply: the client was late"
    if reason is not None:
        return Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=reason),
                       reply_to=msg)
    return Message(reply, reply_to=msg)


def _outcome(out: Message) -> RecordDict:
    return records.error(out.error.reason) if out.has_error() else out.content


@dataclass
class _Client:
    msg: Message
    context: Context
    arrived: Optional[Message] = None
    finished: bool = False
    out: Optional[Message] = None
    failed: Optional[BaseException] = None
    reply: Optional[RecordDict] = None
    ready: threading.Event = field(default_factory=threading.Event)


def around_clients(entries: list, msgs: dict[int, Message], contexts: dict[int, Context],
                   handle: Handler) -> dict[int, RecordDict]:
    """Each client's reply after its mods (``entries``) around ``handle``, which trains every
    client that reached it in one call (see the module docstring). A client whose handler
    reply was late has no entry."""
    if not entries:
        return handle(msgs)
    mods = chain(entries)
    cv = threading.Condition()
    clients = {cid: _Client(msg, contexts[cid]) for cid, msg in msgs.items()}
    threads = [threading.Thread(target=_through_mods, args=(c, mods, cv), daemon=True)
               for c in clients.values()]
    for t in threads:
        t.start()
    with cv:
        cv.wait_for(lambda: all(c.arrived is not None or c.finished for c in clients.values()))
    waiting = {cid: c for cid, c in clients.items() if c.arrived is not None and not c.finished}
    try:
        late = _handle_together(waiting, handle)
    finally:
        for t in threads:
            t.join()
    return _replies(clients, late)


def _through_mods(c: _Client, mods: list, cv: threading.Condition) -> None:
    """One client's thread: its message through its mod chain, whose innermost ``call_next``
    hands the message to the handler's one call and waits for its reply there."""
    def call_next(msg: Message, ctx: Context) -> Message:
        with cv:
            if c.arrived is not None:
                raise RuntimeError("a mod called call_next twice for one message")
            c.arrived = msg
            cv.notify_all()
        c.ready.wait()
        return _reply(c.reply, msg)

    try:
        c.out = make_ffn(call_next, mods)(c.msg, c.context)
    except BaseException as err:  # the client's failure, reported as its error record
        c.failed = err
    finally:
        with cv:
            c.finished = True
            cv.notify_all()


def _handle_together(waiting: dict[int, _Client], handle: Handler) -> set[int]:
    """``handle``'s one call on the messages that reached it, each reply handed back to its
    client's thread (the handler's failure as every waiting client's error record); returns
    the clients whose reply was late."""
    late: set[int] = set()
    try:
        replies = handle({cid: c.arrived for cid, c in waiting.items()}) if waiting else {}
        for cid, c in waiting.items():
            c.reply = replies.get(cid)
            if c.reply is None:
                late.add(cid)
    except BaseException as err:
        for c in waiting.values():
            c.reply = records.error(f"{type(err).__name__}: {err}")
        raise
    finally:
        for c in waiting.values():
            c.ready.set()
    return late


def _replies(clients: dict[int, _Client], late: set[int]) -> dict[int, RecordDict]:
    """Each client's reply after its mods, or its failure as an error record; none for a late
    client."""
    out = {}
    for cid, c in clients.items():
        if cid in late:
            continue
        if c.failed is not None:
            out[cid] = records.error(_failure(c.failed))
        else:
            out[cid] = _outcome(c.out)
    return out


def _failure(err: BaseException) -> str:
    """A client's failure inside its mod chain, as its error record's reason."""
    if isinstance(err, ModError):
        return str(err)
    return f"mod: {type(err).__name__}: {err}"


def around_one(entries: list, msg: Message, context: Context,
               handle: Callable[[Message], RecordDict]) -> RecordDict:
    """One client's reply after its mods around ``handle`` (no other client waits on it)."""
    if not entries:
        return handle(msg)
    try:
        return _outcome(make_ffn(lambda m, _: _reply(handle(m), m), chain(entries))(msg, context))
    except Exception as err:
        return records.error(_failure(err))


# -- Flower's older message layout ------------------------------------------------------------

def _reads_legacy_layout(fn: Callable) -> bool:
    try:
        from flwr.client.mod import LocalDpMod
    except ImportError:  # pragma: no cover (Flower without its compat layer)
        return False
    return isinstance(fn, LocalDpMod)


def legacy_layout(mod: Callable) -> Callable:
    """``mod``, which reads TRAIN messages in Flower's older layout (``fitins.parameters`` and
    ``fitins.config`` in, ``fitres.*`` out), around fedadapt's layout (``arrays`` and
    ``config`` in, ``arrays`` and ``metrics`` out): the message is translated for it and back
    (arrays by position, their names kept), as is the reply."""
    from flwr.app import MessageType
    from flwr.common import (
        Code,
        FitIns,
        FitRes,
        Status,
        ndarrays_to_parameters,
        parameters_to_ndarrays,
    )
    from flwr.compat.common import recorddict_compat as compat

    def to_fitins(content: RecordDict) -> tuple[RecordDict, list[str]]:
        arrays = content.array_records.get("arrays", ArrayRecord())
        names = list(arrays.keys())
        ins = FitIns(ndarrays_to_parameters([arrays[n].numpy() for n in names]),
                     dict(content.config_records.get("config", ConfigRecord())))
        return compat.fitins_to_recorddict(ins, keep_input=True), names

    def from_fitins(content: RecordDict, names: list[str], original: RecordDict) -> RecordDict:
        ins = compat.recorddict_to_fitins(content, keep_input=True)
        out = RecordDict(dict(original.items()))
        out["arrays"] = ArrayRecord({n: Array(a) for n, a in
                                     zip(names, parameters_to_ndarrays(ins.parameters))})
        out["config"] = ConfigRecord(ins.config)
        return out

    def to_fitres(content: RecordDict) -> tuple[RecordDict, list[str]]:
        arrays, metrics = content["arrays"], dict(content["metrics"])
        names = list(arrays.keys())
        res = FitRes(Status(Code.OK, ""), ndarrays_to_parameters([arrays[n].numpy()
                                                                  for n in names]),
                     int(metrics.get("num-examples", 0)), metrics)
        return compat.fitres_to_recorddict(res, keep_input=True), names

    def from_fitres(content: RecordDict, names: list[str]) -> RecordDict:
        res = compat.recorddict_to_fitres(content, keep_input=True)
        return RecordDict({
            "arrays": ArrayRecord({n: Array(a) for n, a in
                                   zip(names, parameters_to_ndarrays(res.parameters))}),
            "metrics": MetricRecord({**res.metrics, "num-examples": res.num_examples})})

    def wrapped(msg: Message, context: Context, call_next) -> Message:
        if msg.metadata.message_type != MessageType.TRAIN:
            return mod(msg, context, call_next)
        legacy, names = to_fitins(msg.content)
        sent_names: list[str] = []

        def inner(m: Message, ctx: Context) -> Message:
            modern = Message(content=from_fitins(m.content, names, msg.content),
                             metadata=msg.metadata)
            reply = call_next(modern, ctx)
            if reply.has_error():
                return reply
            content, sent = to_fitres(reply.content)
            sent_names[:] = sent
            return Message(content, reply_to=m)

        legacy_msg = Message(content=legacy, metadata=msg.metadata)
        out = mod(legacy_msg, context, inner)
        if out.has_error():
            return out
        return Message(from_fitres(out.content, sent_names), reply_to=msg)

    return wrapped
