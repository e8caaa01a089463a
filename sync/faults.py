"""Crash points for tests: kill this process at a named point of the QoS 2 handshake.

``PUBCOMP_CRASH_AT=point[:n]`` makes the n-th pass (default 1) through ``point``
send SIGKILL to the process itself: a real kill with no cleanup, not an
exception. Points, in handshake order:

- ``publish_persisted``: packet ids committed, PUBLISH not yet written
- ``publish_written``:   PUBLISH written, PUBREC not yet received
- ``pubrec_received``:   PUBREC decoded, not yet committed
- ``pubrel_written``:    PUBREL written, PUBCOMP not yet received
- ``pubcomp_received``:  PUBCOMP decoded, its deletion not yet committed

and on the receiving side (the cloud ingest):

- ``ingest_landed``:     readings written and fsynced, packet ids not yet committed,
  PUBREC not yet sent
- ``ingest_committed``:  packet ids committed, PUBREC not yet sent

and in the Spark pipeline: ``pipeline_readings_written`` (a batch's readings
written, its rollups and checkpoint not yet).

Unset (production), ``crash_point`` costs one dictionary lookup.
"""

from __future__ import annotations

import os
import signal

POINTS = (
    "publish_persisted",
    "publish_written",
    "pubrec_received",
    "pubrel_written",
    "pubcomp_received",
    "ingest_landed",
    "ingest_committed",
    "pipeline_seen_written",
    "pipeline_readings_written",
    "pipeline_displaced_removed",
)

_target: str | None = None
_remaining = 0


def _load() -> None:
    global _target, _remaining
    spec = os.environ.get("PUBCOMP_CRASH_AT")
    if not spec:
        return
    point, _, n = spec.partition(":")
    if point not in POINTS:
        raise ValueError(f"PUBCOMP_CRASH_AT: unknown point {point!r}; one of {POINTS}")
    _target, _remaining = point, int(n or 1)


def crash_point(point: str) -> None:
    global _remaining
    if point != _target:
        return
    _remaining -= 1
    if _remaining <= 0:
        os.kill(os.getpid(), signal.SIGKILL)


_load()
