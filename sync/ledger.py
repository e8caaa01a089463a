"""The gateway's ledger record (issue 27): what its store did with each stream's
positions since the last record, as ranges. Pure functions: no file, no clock.

A record travels to the cloud as a reading whose sensor is ``$ledger`` (value and unit
null, the record in ``record``; docs/wire-format.md, "The ledger record"), made by one
op of the group commit (sync/store/ledger.py) from the events the store appended in
the same transactions as what they describe, the positions it holds and the node
streams it stored into. What the cloud makes of it (the completeness table) is the
pipeline's.

Streams: the store's own ``{gateway}/{epoch}`` (positions are the store's seqs) and
each node boot's ``{node}/{boot}`` (positions are the node's message seqs).

Event kinds (``KINDS``), each a range of positions of one stream:

    skipped       store stream: seqs no reading was given (the seq floor's block after a
                  restart: sync/store/outbox.py ``SEQ_BLOCK``)
    evicted       dropped by the quota's ``drop_oldest`` (store seqs, and for node rows
                  the node messages they held); grouped by the time it happened
    dead_letter   refused for good by the broker (the same two kinds of positions)
    refused       node stream: a message the ingress refused (reason: invalid_time, ...)
    node_dropped  node stream: messages the node reports it gave up (reason:
                  ring_overflow, spill_full)
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .ranges import RangeSet
from .wire import wire_time

LEDGER_SENSOR = "$ledger"
RECORD_VERSION = 1
KINDS = ("skipped", "evicted", "dead_letter", "refused", "node_dropped")
# Kinds told with the time they happened (``{"at": t, "ranges": [...]}``), and those told
# per reason (``{reason: ranges}``); ``skipped`` is plain ranges.
TIMED = ("evicted", "dead_letter")
BY_REASON = ("refused", "node_dropped")


@dataclass(frozen=True, slots=True)
class Event:
    """One row of the store's ``ledger_events``: a range of one stream's positions."""

    at: float  # wall-clock seconds of the transaction that made it
    stream: str
    kind: str
    lo: int
    hi: int
    reason: str | None = None


def merged(spans: Iterable[tuple[int, int]]) -> list[list[int]]:
    """Inclusive (lo, hi) spans, sorted by lo (as an ``ORDER BY`` gives them), as
    disjoint ranges with neighbours merged: one pass, for the outbox's many rows."""
    out: list[list[int]] = []
    for lo, hi in spans:
        if out and lo <= out[-1][1] + 1:
            if hi > out[-1][1]:
                out[-1][1] = hi
        else:
            out.append([lo, hi])
    return out


def build_record(
    *,
    window: tuple[float, float],
    top: int,
    store_stream: str,
    events: Iterable[Event],
    held: Mapping[str, list[list[int]]],
    stored: Mapping[str, list[list[int]]],
) -> dict[str, Any]:
    """The ``$ledger`` record (docs/wire-format.md).

    ``window``: (last record's time, now), wall-clock seconds. ``top``: the highest seq
    the store had given. ``held``: per stream, the positions the store still holds
    (the store stream's is always told, empty or not). ``stored``: per node stream
    stored into since the last record, every message seq stored so far.
    """
    streams: dict[str, dict[str, Any]] = {}

    def entry(stream: str) -> dict[str, Any]:
        return streams.setdefault(stream, {})

    entry(store_stream)["held"] = [list(r) for r in held.get(store_stream, [])]
    for stream, ranges in sorted(stored.items()):
        if ranges:
            entry(stream)["stored"] = [list(r) for r in ranges]
    for stream, ranges in sorted(held.items()):
        if ranges and stream != store_stream:
            entry(stream)["held"] = [list(r) for r in ranges]

    plain: dict[tuple[str, str], RangeSet] = {}
    timed: dict[tuple[str, str], dict[str, RangeSet]] = {}  # by wire time
    by_reason: dict[tuple[str, str], dict[str, RangeSet]] = {}
    for e in events:
        if e.kind not in KINDS:
            raise ValueError(f"unknown ledger event kind {e.kind!r}")
        key = (e.stream, e.kind)
        if e.kind in TIMED:
            at = wire_time(e.at)
            timed.setdefault(key, {}).setdefault(at, RangeSet()).add(e.lo, e.hi)
        elif e.kind in BY_REASON:
            reason = e.reason or "unknown"
            by_reason.setdefault(key, {}).setdefault(reason, RangeSet()).add(e.lo, e.hi)
        else:
            plain.setdefault(key, RangeSet()).add(e.lo, e.hi)
    for (stream, kind), rs in plain.items():
        entry(stream)[kind] = rs.as_lists()
    for (stream, kind), at_ranges in timed.items():
        entry(stream)[kind] = [
            {"at": at, "ranges": at_ranges[at].as_lists()} for at in sorted(at_ranges)
        ]
    for (stream, kind), reasons in by_reason.items():
        entry(stream)[kind] = {r: reasons[r].as_lists() for r in sorted(reasons)}
    return {
        "v": RECORD_VERSION,
        "window": [wire_time(window[0]), wire_time(window[1])],
        "top": top,
        "streams": {s: streams[s] for s in sorted(streams)},
    }
