"""Crash points for tests: kill this process at a named point.

Each layer names its own points (``register``) where it defines them: the
uplink's QoS 2 handshake (sync/uplink.py), the cloud ingest's
(pipeline/ingest.py), the Spark pipeline's batch steps (pipeline/job.py). This
module knows none of them.

``arm(point, n, marker)`` makes the n-th pass (default 1) through ``point``
send SIGKILL to the process itself: a real kill with no cleanup, not an
exception. Before the kill, the point's name and the caller's detail (what it
was handling) are written to ``marker``, so a test can assert that the crash
happened where it meant it to.

Nothing in the product arms a point, and no environment variable does (issue
25: ``PUBCOMP_CRASH_AT`` used to act in the installed product). The tests start
processes through ``devkit/hooked.py``, which reads ``PUBCOMP_CRASH_AT=point[:n]``
and ``PUBCOMP_CRASH_MARKER=path`` and calls ``arm`` before the normal main.
Unarmed, ``crash_point`` costs a set lookup and a comparison. A point that no
layer passes through never fires: the tests check the marker.
"""

from __future__ import annotations

import os
import signal

_known: set[str] = set()
_target: str | None = None
_remaining = 0
_marker: str | None = None


def register(*points: str) -> None:
    """Name the crash points a layer passes through (``crash_point`` refuses others)."""
    _known.update(points)


def arm(point: str, n: int = 1, marker: str | None = None) -> None:
    """Kill this process at the n-th pass through ``point`` (devkit/hooked.py only)."""
    global _target, _remaining, _marker
    _target, _remaining, _marker = point, n, marker


def crash_point(point: str, detail: str = "") -> None:
    global _remaining
    if point not in _known:
        # (checked even when unarmed: a point passed without being named is a bug)
        raise ValueError(f"crash point {point!r} was never registered")
    if point != _target:
        return
    _remaining -= 1
    if _remaining <= 0:
        if _marker:
            with open(_marker, "w") as f:
                f.write(f"{point} {detail}".strip() + "\n")
        os.kill(os.getpid(), signal.SIGKILL)
