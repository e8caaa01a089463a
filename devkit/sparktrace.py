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

Wall time hides how busy the cores were. Each call's Spark jobs carry its site as their
description, so the stages they ran can be read back from the driver's UI (its REST
API: the session's UI must be on, as it is by default) with their executor time, tasks
and rows, by site::

    print(sparktrace.stage_report(sparktrace.stages(spark, calls)))

A site whose executor seconds are near its wall seconds kept one core busy of the
machine's; a stage's rows in and out say which input it scanned (a cached one counts
its batches, not rows).
"""

from __future__ import annotations

import functools
import itertools
import json
import threading
import time
import traceback
import urllib.request
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
_TRACES = itertools.count(1)
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


class Calls(list[Call]):
    """The calls of one ``trace``; ``tag`` begins the description of their Spark jobs."""

    def __init__(self, tag: str) -> None:
        super().__init__()
        self.tag = tag


@dataclass(frozen=True)
class Stage:
    site: str
    stage_id: int
    tasks: int
    executor_s: float
    input_rows: int
    shuffle_read_rows: int
    shuffle_write_rows: int
    output_rows: int


@contextmanager
def trace(root: Path = ROOT) -> Iterator[Calls]:
    """Record every action and write while the block runs (in any thread: a stream's
    foreachBatch calls back on py4j's); the patched methods are put back after it."""
    from pyspark import SparkContext
    from pyspark.sql.classic.dataframe import DataFrame
    from pyspark.sql.readwriter import DataFrameWriter

    calls = Calls(f"sparktrace#{next(_TRACES)}@{time.time():.0f}")
    depth = threading.local()
    saved: list[tuple[type, str, Callable[..., Any]]] = []

    def wrap(cls: type, name: str) -> None:
        original = getattr(cls, name)

        @functools.wraps(original)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if getattr(depth, "n", 0):  # inside another action: charged to it
                return original(*args, **kwargs)
            depth.n = 1
            site = _site(root)
            sc = SparkContext._active_spark_context
            before = None
            if sc is not None:  # (on this thread: a job takes its caller's description)
                before = sc.getLocalProperty("spark.job.description")
                sc.setJobDescription(f"{calls.tag} {site}")
            t0 = time.monotonic()
            try:
                return original(*args, **kwargs)
            finally:
                depth.n = 0
                calls.append(Call(site, name, time.monotonic() - t0))
                if sc is not None:  # (a stream's own description put back)
                    sc.setJobDescription(before)  # type: ignore[arg-type]

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


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.load(r)


def stages(spark: Any, calls: Calls, settle_s: float = 30.0) -> list[Stage]:
    """The stages the jobs of ``calls`` ran, from the driver's UI. Its store is fed by
    the listener bus, behind the driver: the bus is drained first (up to ``settle_s``),
    so every stage of a call that has returned is in it, finished."""
    sc = spark.sparkContext
    if not sc.uiWebUrl:
        raise RuntimeError("the Spark UI is off (spark.ui.enabled): no stage figures")
    # (Scala's private[spark] is public in the bytecode: the bus's own wait, not a guess)
    sc._jsc.sc().listenerBus().waitUntilEmpty(int(settle_s * 1000))
    base = f"{sc.uiWebUrl}/api/v1/applications/{sc.applicationId}"
    mine = f"{calls.tag} "
    rows = [r for r in _get(f"{base}/stages") if str(r.get("description", "")).startswith(mine)]
    return [
        Stage(
            site=r["description"][len(mine) :],
            stage_id=int(r["stageId"]),
            tasks=int(r["numTasks"]),
            executor_s=r["executorRunTime"] / 1000,
            input_rows=int(r["inputRecords"]),
            shuffle_read_rows=int(r["shuffleReadRecords"]),
            shuffle_write_rows=int(r["shuffleWriteRecords"]),
            output_rows=int(r["outputRecords"]),
        )
        for r in rows
        if r["status"] == "COMPLETE"
    ]


def stage_report(found: list[Stage]) -> str:
    """A line per site, the most executor time first: its stages, tasks, executor
    seconds and rows (read from files, through shuffles, written)."""
    by: dict[str, list[Stage]] = defaultdict(list)
    for st in found:
        by[st.site].append(st)
    head = f"{'stages':>6} {'tasks':>6} {'exec s':>8} {'in':>10} {'shuffled':>10} {'out':>10}  site"
    lines = [head]
    for site, group in sorted(by.items(), key=lambda kv: -sum(s.executor_s for s in kv[1])):
        lines.append(
            f"{len(group):6d} {sum(s.tasks for s in group):6d}"
            f" {sum(s.executor_s for s in group):8.2f} {sum(s.input_rows for s in group):10d}"
            f" {sum(s.shuffle_read_rows for s in group):10d}"
            f" {sum(s.output_rows for s in group):10d}  {site}"
        )
    total = sum(s.executor_s for s in found)
    lines.append(f"total {total:.1f} executor s over {len(found)} stages")
    return "\n".join(lines)
