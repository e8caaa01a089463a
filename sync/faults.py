"""Crash points for tests: kill this process at a named point.

``PUBCOMP_CRASH_AT=point[:n]`` makes the n-th pass (default 1) through ``point``
send SIGKILL to the process itself: a real kill with no cleanup, not an
exception. Each layer names its own points (``register``) where it defines
them: the uplink's QoS 2 handshake (sync/uplink.py), the cloud ingest's
(pipeline/ingest.py), the Spark pipeline's batch steps (pipeline/job.py). This
module knows none of them.

``PUBCOMP_CRASH_MARKER=path``: before the kill, the point's name and the
caller's detail (what it was handling) are written to ``path``, so a test can
assert that the crash happened where it meant it to.

Unset (production), ``crash_point`` costs a set lookup and a comparison. A point
name in ``PUBCOMP_CRASH_AT`` that no layer passes through never fires: the tests
check the marker.
"""

from __future__ import annotations

import os
import signal

_known: set[str] = set()
_target: str | None = None
_remaining = 0


def register(*points: str) -> None:
    """Name the crash points a layer passes through (``crash_point`` refuses others)."""
    _known.update(points)


def _load() -> None:
    global _target, _remaining
    spec = os.environ.get("PUBCOMP_CRASH_AT")
    if not spec:
        return
    point, _, n = spec.partition(":")
    _target, _remaining = point, int(n or 1)


def crash_point(point: str, detail: str = "") -> None:
    global _remaining
    if point not in _known:
        # (checked even when unset: a point passed without being named is a bug)
        raise ValueError(f"crash point {point!r} was never registered")
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
