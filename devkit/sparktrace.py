"""Where a Spark run's time goes, by the line of our code that asked for it.

devkit/sparkprofile.py reads an event log: each execution's time and the tables it
wrote and read, but not which line of the pipeline ran it (a foreachBatch's
executions all carry the stream's description). This wraps the DataFrame actions
(``first``, ``count``, ``collect``, ``localCheckpoint``, ...) and the writer's
``parquet``/``save`` while it is active, and charges each call's wall time to the
first frame under ``root`` that is not this module: a line of pipeline/, say. An
action called inside another (a ``count`` an action makes itself) is charged to the
outer one, so the figures add up to no more than the wall time::

    from devkit import sparktrace
    with sparktrace.trace() as calls:
        Pipeline(spark, landing, warehouse).run()
    print(sparktrace.report(calls))

Lazy work (a cached DataFrame's first read) is charged to the action that made it
happen, as Spark runs it: that is the point, and a thing to remember when reading.
"""

from __future__ import annotations

import functools
import threading
import time
import traceback
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
ACTIONS = ("first", "count", "collect", "localCheckpoint", "toLocalIterator", "take", "head")
WRITES = ("parquet", "save", "json", "text", "csv")


@dataclass(frozen=True)
class Call:
    site: str  # "pipeline/job.py:426 _rollups"
    action: str
    seconds: float


def _site(root: Path) -> str:
    here = str(Path(__file__).resolve())
    for frame in reversed(traceback.extract_stack()):
        name = str(Path(frame.filename).resolve())
        if name != here and name.startswith(str(root)) and "/.venv/" not in name:
            return f"{Path(name).relative_to(root)}:{frame.lineno} {frame.name}"
    return "?"


@contextmanager
def trace(root: Path = ROOT) -> Iterator[list[Call]]:
    """Record every action and write while the block runs (in any thread: a stream's
    foreachBatch calls back on py4j's); the patched methods are put back after it."""
    from pyspark.sql.classic.dataframe import DataFrame
    from pyspark.sql.readwriter import DataFrameWriter

    calls: list[Call] = []
    depth = threading.local()
    saved: list[tuple[type, str, Callable[..., Any]]] = []

    def wrap(cls: type, name: str) -> None:
        original = getattr(cls, name)

        @functools.wraps(original)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if getattr(depth, "n", 0):  # inside another action: charged to it
                return original(*args, **kwargs)
            depth.n = 1
            t0 = time.monotonic()
            try:
                return original(*args, **kwargs)
            finally:
                depth.n = 0
                calls.append(Call(_site(root), name, time.monotonic() - t0))

        saved.append((cls, name, original))
        setattr(cls, name, timed)

    for name in ACTIONS:
        wrap(DataFrame, name)
    for name in WRITES:
        wrap(DataFrameWriter, name)
    try:
        yield calls
    finally:
        for cls, name, original in reversed(saved):
            setattr(cls, name, original)


def report(calls: list[Call]) -> str:
    """A line per call site and action, the most expensive first, and the total."""
    by: dict[tuple[str, str], list[float]] = defaultdict(list)
    for c in calls:
        by[(c.site, c.action)].append(c.seconds)
    lines = [f"{'calls':>5} {'seconds':>8}  {'action':16} site"]
    for (site, action), secs in sorted(by.items(), key=lambda kv: -sum(kv[1])):
        lines.append(f"{len(secs):5d} {sum(secs):8.2f}  {action:16} {site}")
    lines.append(f"total {sum(c.seconds for c in calls):.1f} s over {len(calls)} calls")
    return "\n".join(lines)
