"""The completeness table as people read it: ``pubcomp fleet completeness``, the report's
section and the fleet page's column, and the Prometheus metrics (a textfile).

Only the small ``completeness`` and ``completeness_gaps`` tables are read (rows per
stream, hour and gap: pipeline/completeness.py), never ``readings``.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from pubcomp.sync.exitcodes import EXIT_OK, EXIT_UNEXPLAINED, EXIT_USAGE
from pubcomp.sync.tables import text_table

# Reasons in the order they are judged (pipeline/completeness.REASONS), as shown.
REASONS = (
    "held",
    "evicted",
    "dead_letter",
    "refused",
    "node_dropped",
    "unexplained",
    "unreported",
)
SHOWN_RANGES = 3  # per stream and reason in the text table; the rest counted


@dataclass
class StreamGaps:
    gateway: str
    stream: str
    kind: str
    expected: int = 0
    landed: int = 0
    missing: int = 0
    skipped: int = 0
    by_reason: dict[str, int] = field(default_factory=dict)
    ranges: list[tuple[str, str | None, int, int, int]] = field(default_factory=list)

    @property
    def unexplained(self) -> int:
        return self.by_reason.get("unexplained", 0)

    def why(self) -> str:
        """``unexplained 1201-1300 (100); held 5-6 (2)``: the ranges by reason, in order."""
        parts = []
        for reason in REASONS:
            mine = [r for r in self.ranges if r[0] == reason]
            if not mine:
                continue
            shown = []
            for _, detail, lo, hi, _n in mine[:SHOWN_RANGES]:
                span = f"{lo}" if lo == hi else f"{lo}-{hi}"
                shown.append(f"{span}{f' {detail}' if detail else ''}")
            more = f" +{len(mine) - SHOWN_RANGES} more" if len(mine) > SHOWN_RANGES else ""
            parts.append(f"{reason} {', '.join(shown)}{more} ({self.by_reason.get(reason, 0):,})")
        return "; ".join(parts)


@dataclass
class Completeness:
    streams: list[StreamGaps] = field(default_factory=list)  # every stream, worst first
    daily: dict[tuple[str, str], dict[str, int]] = field(default_factory=dict)  # (gw, day)
    found: bool = False  # the warehouse has the table at all

    @property
    def unexplained(self) -> int:
        return sum(s.unexplained for s in self.streams)

    def gateways(self) -> dict[str, dict[str, int]]:
        """Per gateway: expected, landed, missing and each reason's count."""
        out: dict[str, dict[str, int]] = {}
        for s in self.streams:
            g = out.setdefault(s.gateway, {"expected": 0, "landed": 0, "missing": 0})
            g["expected"] += s.expected
            g["landed"] += s.landed
            g["missing"] += s.missing
            for r, n in s.by_reason.items():
                g[r] = g.get(r, 0) + n
        return out


def load(
    spark: Any, warehouse: str, since: datetime | None = None, gateway: str | None = None
) -> Completeness:
    """The completeness of the streams with an hour at or after ``since`` (all: None)."""
    from pyspark.sql import functions as F

    from .completeness import COMPLETENESS_SCHEMA, GAPS_SCHEMA
    from .sparkenv import path_exists

    wh = warehouse.rstrip("/")
    out = Completeness()
    if not path_exists(spark, f"{wh}/completeness"):
        return out
    out.found = True
    table = spark.read.schema(COMPLETENESS_SCHEMA).parquet(f"{wh}/completeness")
    gaps = spark.read.schema(GAPS_SCHEMA).parquet(f"{wh}/completeness_gaps")
    where = F.lit(True)
    if gateway:
        where = where & (F.col("gateway") == gateway)
    if since is not None:
        where = where & (F.col("hour") >= F.lit(since.replace(tzinfo=None)))
    counts = ["expected", "landed", "missing", "skipped", *REASONS]
    per = (
        table.where(where)
        .groupBy("gateway", "stream", "kind")
        .agg(*[F.sum(c).alias(c) for c in counts])
    )
    streams: dict[tuple[str, str], StreamGaps] = {}
    for r in per.collect():
        s = StreamGaps(r.gateway, r.stream, r.kind, int(r.expected), int(r.landed),
                       int(r.missing), int(r.skipped))  # fmt: skip
        s.by_reason = {c: int(r[c]) for c in REASONS if r[c]}
        streams[(r.gateway, r.stream)] = s
    for r in gaps.where(where).orderBy("gateway", "stream", "lo").collect():
        found = streams.get((r.gateway, r.stream))
        if found is not None and r.reason != "skipped":
            found.ranges.append((r.reason, r.detail, int(r.lo), int(r.hi), int(r.n)))
    out.streams = sorted(
        streams.values(), key=lambda s: (-s.unexplained, -s.missing, s.gateway, s.stream)
    )
    day = F.date_format("hour", "yyyy-MM-dd").alias("day")
    for r in (
        table.where(where)
        .groupBy("gateway", day)
        .agg(*[F.sum(c).alias(c) for c in counts])
        .collect()
    ):
        out.daily[(r.gateway, r.day)] = {c: int(r[c]) for c in counts}
    return out


def render(c: Completeness, warehouse: str) -> str:
    """The streams with missing readings, and a line for the whole fleet."""
    if not c.found:
        return (
            f"no completeness table in {warehouse}: `pubcomp pipeline run` writes it "
            "(the gateways' ledgers and the ingest's outbox spans are what it reads)"
        )
    total = {"expected": 0, "landed": 0, "missing": 0}
    for s in c.streams:
        total["expected"] += s.expected
        total["landed"] += s.landed
        total["missing"] += s.missing
    rows = [
        [s.gateway, s.stream, s.kind, f"{s.expected:,}", f"{s.landed:,}", f"{s.missing:,}", s.why()]
        for s in c.streams
        if s.missing
    ]
    head = ["GATEWAY", "STREAM", "KIND", "EXPECTED", "LANDED", "MISSING", "WHY (positions)"]
    lines = [text_table(head, rows)] if rows else []
    n = len(c.streams)
    verdict = (
        f"{c.unexplained:,} unexplained: the alarm (docs/operations.md, 'Completeness')"
        if c.unexplained
        else "nothing unexplained"
    )
    lines.append(
        f"{n:,} streams, {total['expected']:,} positions expected, {total['landed']:,} landed, "
        f"{total['missing']:,} missing ({len(rows):,} streams); {verdict}"
    )
    return "\n".join(lines)


def code(c: Completeness) -> int:
    return EXIT_UNEXPLAINED if c.unexplained else EXIT_OK


def prometheus(c: Completeness) -> str:
    """The metrics in Prometheus's text format (for node_exporter's textfile collector)."""
    out = [
        "# HELP pubcomp_completeness_missing Positions the warehouse misses, by gateway and "
        "reason (pubcomp fleet completeness).",
        "# TYPE pubcomp_completeness_missing gauge",
    ]
    gws = c.gateways()
    for gw in sorted(gws):
        for reason in REASONS:
            out.append(
                f'pubcomp_completeness_missing{{gateway="{_label(gw)}",reason="{reason}"}} '
                f"{gws[gw].get(reason, 0)}"
            )
    for metric, key, text in (
        ("expected", "expected", "Positions the warehouse expects, by gateway."),
        ("landed", "landed", "Positions landed in the warehouse, by gateway."),
    ):
        out.append(f"# HELP pubcomp_completeness_{metric} {text}")
        out.append(f"# TYPE pubcomp_completeness_{metric} gauge")
        for gw in sorted(gws):
            out.append(f'pubcomp_completeness_{metric}{{gateway="{_label(gw)}"}} {gws[gw][key]}')
    return "\n".join(out) + "\n"


def _label(v: str) -> str:
    return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def write_textfile(path: Path, text: str) -> None:
    """Whole or not at all (node_exporter may read it at any moment)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def parse_since(text: str, now: datetime) -> datetime:
    """``24h``, ``7d``, ``90m`` back from now, or an ISO date or time (UTC)."""
    units = {"m": 60, "h": 3600, "d": 86400}
    if text[-1:] in units and text[:-1].isdigit():
        return now - timedelta(seconds=int(text[:-1]) * units[text[-1]])
    t = datetime.fromisoformat(text.replace("Z", "+00:00"))
    return t if t.tzinfo else t.replace(tzinfo=UTC)


def fleet_completeness(args: argparse.Namespace) -> int:
    from .commands import warehouse_problem

    problem = warehouse_problem(args.warehouse)
    if problem is not None:
        print(f"pubcomp fleet completeness: {problem}", file=sys.stderr)
        return EXIT_USAGE
    try:
        since = parse_since(args.since, datetime.now(UTC)) if args.since else None
    except ValueError:
        print(
            f"pubcomp fleet completeness: --since {args.since!r}: give 24h, 7d or an ISO time",
            file=sys.stderr,
        )
        return EXIT_USAGE
    from .sparkenv import spark_session

    spark = spark_session(args.master, app="pubcomp-fleet-completeness")
    spark.sparkContext.setLogLevel("ERROR")
    c = load(spark, args.warehouse, since, args.gateway)
    print(render(c, args.warehouse))
    if args.textfile:
        write_textfile(Path(args.textfile), prometheus(c))
    return code(c)
