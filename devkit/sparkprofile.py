"""Where a Spark run's time goes: its SQL executions from an event log, a line each.

Spark's UI is gone when the process ends; its event log is not. Run the pipeline (or
a benchmark) with the log on and uncompressed::

    export PYSPARK_SUBMIT_ARGS="--conf spark.eventLog.enabled=true \\
      --conf spark.eventLog.dir=file:///tmp/ev \\
      --conf spark.eventLog.compress=false pyspark-shell"
    python bench/pipeline.py --fleet --histories 1e6 --streams 100
    python -m devkit.sparkprofile /tmp/ev/eventlog_v2_* [--since EPOCH_S] [--until EPOCH_S]

Each line: the execution's wall seconds, the table it writes (the last folder of its
``InsertIntoHadoopFsRelationCommand``), the tables it reads (file scans; a cached or
checkpointed input reads none), and how many window and generate operators its plan
has (a window sorts its input: the usual suspect). A batch's own execution (the file
stream's, which holds all the others) comes first and is the batch's total.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

_WRITE = re.compile(r"Arguments: file:([^\s,]+)")
_SCAN = re.compile(r"Location: \w+\s?\[?file:([^\s,\]]+)")
_PARTITION = re.compile(r"/\w+=.*")


@dataclass
class Execution:
    id: int
    start_ms: int
    end_ms: int | None = None
    writes: list[str] = field(default_factory=list)
    reads: list[str] = field(default_factory=list)
    windows: int = 0
    generates: int = 0

    @property
    def seconds(self) -> float:
        return ((self.end_ms or self.start_ms) - self.start_ms) / 1000


def _table(path: str) -> str:
    return _PARTITION.sub("", path.rstrip("/")).rsplit("/", 1)[-1]


def _lines(log: Path) -> Iterator[str]:
    """A log file's lines, or a rolling log's (Spark 4's ``eventlog_v2_*`` folder: its
    ``events_N_*`` files in order)."""
    parts = [log]
    if log.is_dir():
        parts = sorted(log.glob("events_*"), key=lambda p: int(p.name.split("_")[1]))
    for part in parts:
        with part.open() as f:
            yield from f


def executions(log: Path) -> list[Execution]:
    """The SQL executions an event log (JSON lines, uncompressed; a file or a rolling
    log's folder) records, by id."""
    found: dict[int, Execution] = {}
    for line in _lines(log):
        e = json.loads(line)
        kind = e.get("Event", "")
        if kind.endswith("SQLExecutionStart"):
            plan = e.get("physicalPlanDescription", "")
            found[e["executionId"]] = Execution(
                e["executionId"],
                e["time"],
                writes=[_table(p) for p in _WRITE.findall(plan)],
                reads=sorted({_table(p) for p in _SCAN.findall(plan)}),
                windows=plan.count("Window ("),
                generates=plan.count("Generate ("),
            )
        elif kind.endswith("SQLExecutionEnd") and e["executionId"] in found:
            found[e["executionId"]].end_ms = e["time"]
    return [found[k] for k in sorted(found)]


def report(runs: list[Execution]) -> str:
    lines = [f"{'seconds':>8}  {'id':>5}  {'writes':<20} {'reads':<36} windows generates"]
    for x in runs:
        lines.append(
            f"{x.seconds:>8.2f}  {x.id:>5}  {','.join(x.writes)[:20]:<20} "
            f"{','.join(x.reads)[:36]:<36} {x.windows:>7} {x.generates:>9}"
        )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("log", type=Path, help="an uncompressed Spark event log (a file or folder)")
    ap.add_argument("--since", type=float, help="only executions started at or after (epoch s)")
    ap.add_argument("--until", type=float, help="only executions started before (epoch s)")
    args = ap.parse_args()
    runs = [
        x
        for x in executions(args.log)
        if (args.since is None or x.start_ms >= args.since * 1000)
        and (args.until is None or x.start_ms < args.until * 1000)
    ]
    print(report(runs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
