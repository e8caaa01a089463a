"""The store's ops committed one at a time, as tests and benchmarks need them.

Each is ``Store.commit`` of the op a gateway submits to its group commit, with the same
``frees`` its submitter gives it (the intake's batches do not free; the uplink's session
transitions and deliveries do), so a test proves the path production runs: there is no
other way to write the store (sync/store/__init__.py, "One write API").
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from pubcomp.sync.session import OutState
from pubcomp.sync.store import Message, Reading, Store


def append(store: Store, readings: Iterable[Reading]) -> tuple[int, int]:
    """Readings into the outbox as ``pubcomp store import`` commits them; their (first,
    last) seq, or (0, -1) for none. An iterator is read once (no retry on a full disk)."""
    return store.commit(
        lambda db: store.append_in(db, readings), retry=isinstance(readings, Sequence)
    )


def append_batches(
    store: Store,
    batches: Sequence[tuple[str | None, Sequence[Reading]]],
    state: dict[str, str] | None = None,
) -> list[bool]:
    """Producers' batches (node message keys, driver state) as the intake commits them."""
    return store.commit(lambda db: store.append_batches_in(db, batches, state))


def begin(store: Store, session: str, messages: Sequence[Message]) -> None:
    """New packet ids committed (rule 1) as the uplink's fill does; each message then has
    its ord and state PUBLISH_SENT, as the uplink sets them after the commit."""
    ords = store.commit(lambda db: store.begin_messages_in(db, session, messages), frees=True)
    for m, o in zip(messages, ords, strict=True):
        m.ord, m.state = o, OutState.PUBLISH_SENT


def apply(store: Store, session: str, **acks: Sequence[Any]) -> int:
    """Acknowledgements (``released``, ``completed``, ``refused``, ``awaiting``: as
    ``Store.apply_in`` takes them) committed as the uplink's ``read_acks`` does; returns
    the readings delivered."""
    return store.commit(lambda db: store.apply_in(db, session, **acks), frees=True)
