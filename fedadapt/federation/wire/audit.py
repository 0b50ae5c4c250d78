"""What leaves a device, checked message by message: no per-sample label, no raw feature of a
client's test data, no personal tensor, in any record of any reply.

:func:`leaks` walks every record of a message (``ArrayRecord``, ``MetricRecord``,
``ConfigRecord``, whatever their names: one reply may carry several clients' records) and
compares each array and each list-valued metric with what the run's clients hold
(:class:`Secrets`):

* **labels**: a vector (or one-hot matrix) of class indices whose length and multiset of values
  are those of a client's train / val / test split or of one of its sessions, in any order; and
  any key named like a label (``label``, ``labels``, ``target``, ``y``);
* **test features**: any row of an array whose width is the feature width that is bit for bit a
  row of a client's test features, except in a record the protocol declares for them (a session
  plug-in's upload: ``allowed``);
* **personal tensors**: any array equal to a client's personal tensor (a local-only head, a
  personalized part; constant tensors carry nothing and are skipped), or named like one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Optional

import numpy as np

#: Keys that name labels, as a record name or an entry's name, whole or dot/colon separated.
LABEL_NAME = re.compile(r"(^|[._:/-])(labels?|targets?|y)($|[._:/-])", re.IGNORECASE)


@dataclass
class Secrets:
    """What never leaves a device, in the forms :func:`leaks` compares."""

    num_classes: int
    #: ``(length, sorted labels)`` of every client's split and session.
    label_sets: set[tuple[int, tuple]] = field(default_factory=set)
    #: Width of a feature row, and the float32 bytes of every client's test feature rows.
    feature_dim: Optional[int] = None
    feature_rows: set[bytes] = field(default_factory=set)
    #: ``(shape, float32 bytes)`` of personal tensors, and their names.
    personal: set[tuple[tuple, bytes]] = field(default_factory=set)
    personal_names: set[str] = field(default_factory=set)

    def add_labels(self, labels: np.ndarray) -> None:
        if len(labels) >= 2:
            self.label_sets.add((len(labels), tuple(sorted(int(v) for v in labels))))

    def add_personal(self, name: str, tensor: Any, *, by_name: bool = True) -> None:
        """A client's personal tensor; ``by_name=False`` for a personalized copy of a tensor
        that is also communicated in the rounds (only its values are secret)."""
        if by_name:
            self.personal_names.add(name)
        arr = np.asarray(tensor, dtype=np.float32)
        if arr.size > 1 and not np.all(arr == arr.reshape(-1)[0]):
            self.personal.add((arr.shape, arr.tobytes()))


def secrets_of(spec, sessions: Optional[Callable[[int], list[np.ndarray]]] = None) -> Secrets:
    """The labels of every client's splits (and sessions, ``sessions(cid)``) and, for a run on
    cached features, every client's test feature rows. Personal tensors are added as the run
    produces them (:meth:`Secrets.add_personal`)."""
    labels = spec.train_source.labels()
    out = Secrets(num_classes=spec.num_classes)
    for cid, split in enumerate(spec.clients):
        for part in (split.train, split.val, split.test):
            out.add_labels(labels[np.asarray(part, dtype=np.int64)])
        for s in (sessions(cid) if sessions else []):
            out.add_labels(labels[np.asarray(s, dtype=np.int64)])
    if spec.train_source.kind == "features":
        feats = np.asarray(spec.train_source.features(), dtype=np.float32)
        out.feature_dim = feats.shape[1]
        for split in spec.clients:
            out.feature_rows.update(feats[i].tobytes() for i in np.asarray(split.test, int))
    return out


def walk(message) -> Iterator[tuple[str, str, Any]]:
    """``(record name, key, value)`` of every entry of every record of ``message``'s content;
    arrays as numpy arrays."""
    if not message.has_content():
        return
    for name, record in message.content.array_records.items():
        for key, array in record.items():
            yield name, key, array.numpy()
    for records in (message.content.metric_records, message.content.config_records):
        for name, record in records.items():
            for key, value in record.items():
                yield name, key, value


def _as_labels(arr: np.ndarray, num_classes: int) -> Optional[np.ndarray]:
    """``arr`` as a vector of class indices (one-hot rows read by argmax), or None."""
    if arr.dtype.kind not in "biuf" or arr.size < 2:
        return None
    if arr.ndim == 2 and arr.shape[1] == num_classes and np.isin(arr, (0, 1)).all() \
            and (arr.sum(1) == 1).all():
        arr = arr.argmax(1)
    if arr.ndim != 1 or not np.isfinite(arr).all() or not (arr == np.round(arr)).all():
        return None
    if arr.min() < 0 or arr.max() >= num_classes:
        return None
    return arr.astype(np.int64)


def leaks(message, secrets: Secrets,
          allowed: Callable[[str, str], bool] = lambda record, key: False) -> list[str]:
    """Every entry of ``message`` that carries a secret, described (empty: nothing leaks)."""
    found = []
    for record, key, value in walk(message):
        where = f"{record}[{key!r}]"
        if LABEL_NAME.search(record) or LABEL_NAME.search(key):
            found.append(f"{where}: named like a label")
        if isinstance(value, (str, bytes, bool, int, float)) or value is None:
            continue
        arr = np.asarray(value)
        if arr.dtype.kind not in "biuf":
            continue
        labels = _as_labels(arr, secrets.num_classes)
        if labels is not None and (len(labels), tuple(sorted(labels.tolist()))) in \
                secrets.label_sets:
            found.append(f"{where}: the labels of a client's samples")
        d = secrets.feature_dim
        if d and arr.ndim >= 1 and arr.shape[-1] == d and not allowed(record, key):
            rows = np.ascontiguousarray(arr.reshape(-1, d), dtype=np.float32)
            if any(r.tobytes() in secrets.feature_rows for r in rows):
                found.append(f"{where}: raw features of a client's test samples")
        if key in secrets.personal_names:
            found.append(f"{where}: named like a personal tensor")
        if (arr.shape, np.ascontiguousarray(arr, dtype=np.float32).tobytes()) in \
                secrets.personal:
            found.append(f"{where}: a client's personal tensor")
    return found


def audit(exchanges: Iterable[tuple[Any, Any]], secrets: Secrets,
          allowed: Callable[[Any, str, str], bool] = lambda sent, record, key: False
          ) -> list[str]:
    """:func:`leaks` of every reply of ``(sent, reply)`` exchanges; ``allowed(sent, record,
    key)`` declares what the protocol lets a reply to ``sent`` carry."""
    out = []
    for sent, reply in exchanges:
        phase = _phase(sent)
        for problem in leaks(reply, secrets, lambda r, k, s=sent: allowed(s, r, k)):
            out.append(f"reply to {sent.metadata.message_type} ({phase}): {problem}")
    return out


def _phase(message) -> str:
    config = message.content.config_records.get("config") if message.has_content() else None
    return str(config.get("phase", "round")) if config is not None else "round"
