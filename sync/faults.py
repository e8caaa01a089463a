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

- ``ingest_landed``:     a group holding PUBLISHes written and fsynced (with their
  receive records), PUBRECs not yet sent
- ``ingest_pubrel_received``: PUBREL decoded for a landed message, PUBCOMP not yet sent

and in the Spark pipeline: ``pipeline_seen_written`` (a batch's seen-id index
written, its readings not yet), ``pipeline_readings_written`` (its readings
written, its rollups and checkpoint not yet), ``pipeline_displaced_removed``
(copies it displaced removed from earlier partitions, rollups not yet).

``PUBCOMP_CRASH_MARKER=path``: before the kill, the point's name and the
caller's detail (what it was handling) are written to ``path``, so a test can
assert that the crash happened where it meant it to.

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
    "ingest_pubrel_received",
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


def crash_point(point: str, detail: str = "") -> None:
    global _remaining
    if point != _target:
        return
    _remaining -= 1
    if _remaining <= 0:
        marker = os.environ.get("PUBCOMP_CRASH_MARKER")
        if marker:
            with open(marker, "w") as f:
                f.write(f"{point} {detail}".strip() + "\n")
        os.kill(os.getpid(), signal.SIGKILL)


_load()
