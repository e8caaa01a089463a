"""``pubcomp pipeline report``: one self-contained HTML page that shows the fleet.

Everything comes from the warehouse the pipeline wrote: the rollups for the
pictures, the per-batch ``quality`` and ``quarantine`` tables for the
data-quality table, ``_runs`` for the recent runs. Only small aggregates leave
Spark; ``readings`` is never scanned, so the report costs the same on a year of
data as on a day.
"""

from __future__ import annotations

import base64
import html
import json
import logging
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from pubcomp.sync.tables import html_row, html_table

from . import charts, transforms
from .sparkenv import path_exists

log = logging.getLogger(__name__)

# Finest rollup whose windows still fit a readable chart over the data's span.
LEVELS = (("rollup_1m", "minute", timedelta(hours=6)), ("rollup_1h", "hour", timedelta(days=14)))
COARSEST = ("rollup_1d", "day")


@dataclass
class QualityRow:
    origin: str
    sensor: str
    lines_in: int = 0
    kept: int = 0
    duplicates_removed: int = 0
    late: int = 0
    clock_flagged: int = 0
    max_delay_s: float | None = None
    last_ts: datetime | None = None
    unit: str = ""


@dataclass
class Facts:
    warehouse: str
    level: str = ""
    per: str = ""
    first: datetime | None = None
    last: datetime | None = None
    quality: list[QualityRow] = field(default_factory=list)
    quarantine: dict[str, dict[str, int]] = field(default_factory=dict)  # origin -> reason -> n
    runs: list[dict[str, Any]] = field(default_factory=list)
    heatmap: bytes = b""
    panels: dict[str, bytes] = field(default_factory=dict)  # origin -> PNG
    not_charted: list[str] = field(default_factory=list)
    fleet_page: tuple[str, str] | None = None  # (file name, headline): pipeline/fleetpage.py
    completeness: Any = None  # completeview.Completeness (issue 27)
    completeness_chart: bytes = b""

    @property
    def totals(self) -> dict[str, int]:
        keys = ("lines_in", "kept", "duplicates_removed", "late", "clock_flagged")
        out = {k: sum(getattr(q, k) for q in self.quality) for k in keys}
        out["quarantined"] = sum(sum(r.values()) for r in self.quarantine.values())
        out["origins"] = len({q.origin for q in self.quality})
        out["sensors"] = len(self.quality)
        return out


def _window_micros(per: str) -> int:
    return {"minute": 60, "hour": 3600}.get(per, 86400) * 1_000_000


def _utc(micros: int | None) -> datetime | None:
    if micros is None:
        return None
    return datetime(1970, 1, 1, tzinfo=UTC) + timedelta(microseconds=micros)


class Report:
    def __init__(
        self, spark: SparkSession, warehouse: str, max_origins: int = 40, max_sensors: int = 12
    ) -> None:
        self.spark = spark
        self.wh = warehouse.rstrip("/")
        self.max_origins = max_origins
        self.max_sensors = max_sensors

    def _table(self, name: str, schema: Any) -> DataFrame | None:
        if not path_exists(self.spark, f"{self.wh}/{name}"):
            return None
        return self.spark.read.schema(schema).parquet(f"{self.wh}/{name}")

    def facts(self) -> Facts:
        f = Facts(self.wh)
        days = self._table("rollup_1d", transforms.ROLLUP_DAY_SCHEMA)
        if days is None:
            return f
        self._quality(f, days)
        self._quarantine(f)
        self._runs(f)
        self._completeness(f)
        span = days.agg(F.unix_micros(F.min("first_ts")), F.unix_micros(F.max("last_ts"))).first()
        f.first, f.last = _utc(span[0]), _utc(span[1])  # type: ignore[index]
        if f.first is None or f.last is None:
            return f
        f.level, f.per = COARSEST
        for level, per, fits in LEVELS:
            if f.last - f.first <= fits:
                f.level, f.per = level, per
                break
        schema = {"rollup_1m": transforms.ROLLUP_1M_SCHEMA}.get(
            f.level, transforms.ROLLUP_DAY_SCHEMA
        )
        windows = self._table(f.level, schema)
        assert windows is not None  # rollup_1d exists, and it is written last
        self._heatmap(f, windows)
        self._panels(f, windows)
        return f

    def _quality(self, f: Facts, days: DataFrame) -> None:
        rows: dict[tuple[str, str], QualityRow] = {}
        last = days.groupBy("origin", "sensor").agg(
            F.unix_micros(F.max("last_ts")).alias("last"), F.max("unit").alias("unit")
        )
        for r in last.collect():
            rows[(r.origin, r.sensor)] = QualityRow(
                r.origin, r.sensor, last_ts=_utc(r["last"]), unit=r.unit or ""
            )
        q = self._table("quality", transforms.QUALITY_SCHEMA)
        if q is not None:
            sums = q.groupBy("origin", "sensor").agg(
                *[
                    F.sum(c).alias(c)
                    for c in ("lines_in", "kept", "duplicates_removed", "late", "clock_flagged")
                ],
                F.max("max_delay_s").alias("max_delay_s"),
            )
            for r in sums.collect():
                row = rows.setdefault((r.origin, r.sensor), QualityRow(r.origin, r.sensor))
                row.lines_in, row.kept = int(r.lines_in), int(r.kept)
                row.duplicates_removed = int(r.duplicates_removed)
                row.late, row.clock_flagged = int(r.late), int(r.clock_flagged)
                row.max_delay_s = r.max_delay_s
        f.quality = sorted(rows.values(), key=lambda q: (q.origin, q.sensor))

    def _quarantine(self, f: Facts) -> None:
        q = self._table("quarantine", transforms.QUARANTINE_SCHEMA)
        if q is None:
            return
        counts = q.groupBy(F.coalesce("origin", F.lit("(unreadable)")).alias("o"), "reason")
        for r in counts.count().collect():
            f.quarantine.setdefault(r.o, {})[r.reason] = int(r["count"])

    def _completeness(self, f: Facts) -> None:
        from . import completeview

        c = completeview.load(self.spark, self.wh)
        if not c.found:
            return
        f.completeness = c
        if not c.daily:
            return
        gateways = sorted({g for g, _ in c.daily})
        days = sorted({d for _, d in c.daily})
        shape = (len(gateways), len(days))
        grids = {k: np.zeros(shape) for k in ("explained", "unexplained", "expected")}
        for (g, d), n in c.daily.items():
            i, j = gateways.index(g), days.index(d)
            grids["unexplained"][i, j] = n["unexplained"]
            grids["explained"][i, j] = n["missing"] - n["unexplained"]
            grids["expected"][i, j] = n["expected"]
        f.completeness_chart = charts.completeness_grid(
            gateways, days, grids["explained"], grids["unexplained"], grids["expected"]
        )

    def _runs(self, f: Facts) -> None:
        local = Path(f"{self.wh}/_runs")
        if "://" in self.wh:  # a cluster file system: through Spark
            df = self.spark.read.option("multiLine", "true").json(f"{self.wh}/_runs")
            runs = [json.loads(str(j)) for j in df.toJSON().collect()]
        else:
            runs = [json.loads(p.read_text()) for p in local.glob("run-*.json")]
        f.runs = sorted(runs, key=lambda r: r.get("started", ""))[-20:]

    def _charted(self, f: Facts) -> dict[str, list[str]]:
        by_origin: dict[str, list[str]] = {}
        for q in f.quality:
            by_origin.setdefault(q.origin, []).append(q.sensor)
        origins = sorted(by_origin)
        f.not_charted = origins[self.max_origins :]
        return {o: by_origin[o][: self.max_sensors] for o in origins[: self.max_origins]}

    def _heatmap(self, f: Facts, windows: DataFrame) -> None:
        per_origin = windows.groupBy("origin", F.unix_micros("window_start").alias("w")).agg(
            F.sum("count").alias("n")
        )
        rows = per_origin.collect()
        if not rows:
            return
        origins = sorted({r.origin for r in rows})
        starts = sorted({r.w for r in rows})
        step = _window_micros(f.per)
        grid = list(range(starts[0], starts[-1] + step, step))  # gaps are columns too
        col = {w: i for i, w in enumerate(grid)}
        row = {o: i for i, o in enumerate(origins)}
        counts = np.zeros((len(origins), len(grid)))
        for r in rows:
            counts[row[r.origin], col[r.w]] = r.n
        f.heatmap = charts.fleet_heatmap(origins, [_utc(w) for w in grid], counts, f.per)  # type: ignore[misc]

    def _panels(self, f: Facts, windows: DataFrame) -> None:
        charted = self._charted(f)
        if not charted:
            return
        wanted = self.spark.createDataFrame(
            [(o, s) for o, ss in charted.items() for s in ss], "origin string, sensor string"
        )
        rows = (
            windows.join(F.broadcast(wanted), on=["origin", "sensor"], how="left_semi")
            .select(
                "origin",
                "sensor",
                F.unix_micros("window_start").alias("w"),
                "mean",
                "min",
                "max",
                F.col("sum").cast("double").alias("total"),
                "last_value",
                F.unix_micros("first_ts").alias("first_t"),
                F.unix_micros("last_ts").alias("last_t"),
                "unit",
                F.coalesce(F.col("kind"), F.lit("gauge")).alias("kind"),
            )
            .orderBy("origin", "sensor", "w")
            .collect()
        )
        series: dict[str, dict[str, charts.Series]] = {}
        edges: dict[tuple[str, str], tuple[int, int, int]] = {}  # first_t, last w, last_t
        for r in rows:
            by_sensor = series.setdefault(r.origin, {})
            s = by_sensor.setdefault(r.sensor, charts.Series(r.unit or "", r.kind))
            if not s.starts:
                edges[(r.origin, r.sensor)] = (r.first_t, r.w, r.last_t)
            s.starts.append(_utc(r.w))  # type: ignore[arg-type]
            s.mean.append(r.mean)
            s.low.append(r["min"])
            s.high.append(r["max"])
            s.sums.append(r.total)
            s.last.append(r.last_value)
            first_t = edges[(r.origin, r.sensor)][0]
            edges[(r.origin, r.sensor)] = (first_t, r.w, r.last_t)
        window = _window_micros(f.per)
        for (origin, sensor), (first_t, last_w, last_t) in edges.items():
            s = series[origin][sensor]
            start = int(s.starts[0].timestamp() * 1_000_000)
            # Partly covered: the data began a tenth of a window after it opened, or
            # ended a tenth before it closed (a sensor reporting every few seconds
            # leaves less than that at either end of a full window).
            s.partial_first = first_t - start > window // 10
            s.partial_last = last_w + window - last_t > window // 10
        for origin, by_sensor in series.items():
            f.panels[origin] = charts.sensor_panels(origin, by_sensor, f.per)


# ---------------------------------------------------------------- HTML

CSS = """
body { font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }
table { border-collapse: collapse; font-size: 0.85em; margin-bottom: 1.5em; }
th, td { border: 1px solid #ccc; padding: 0.2em 0.5em; text-align: right; }
th { background: #f0f0f0; } td.name { text-align: left; }
tr.warn td { background: #fff4d6; }
.cards { display: flex; gap: 1em; flex-wrap: wrap; margin-bottom: 1em; }
.card { border: 1px solid #ccc; border-radius: 6px; padding: 0.5em 1em; }
.card b { display: block; font-size: 1.4em; }
img { max-width: 100%; }
"""


def _img(data: bytes, alt: str) -> str:
    b64 = base64.b64encode(data).decode()
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{b64}">'


def _when(t: datetime | None) -> str:
    return t.strftime("%Y-%m-%d %H:%M:%S") if t else "-"


def _table(headers: list[str], rows: list[tuple[list[str], bool]], tid: str) -> str:
    """The first two columns name what a row is about (``class="name"``); a row that
    wants a look is ``warn``."""
    body = (
        html_row(cells, attrs=" class=warn" if warn else "", classes=("name", "name"))
        for cells, warn in rows
    )
    return html_table(headers, body, tid=tid)


def render(f: Facts) -> str:
    t = f.totals
    out = [
        "<!doctype html><html><head><meta charset='utf-8'><title>pubcomp fleet report</title>",
        f"<style>{CSS}</style></head><body>",
        "<h1>pubcomp fleet report</h1>",
        f"<p>Warehouse <code>{html.escape(f.warehouse)}</code>; readings from "
        f"{_when(f.first)} to {_when(f.last)} UTC; generated "
        f"{_when(datetime.now(UTC))} UTC.</p>",
    ]
    if f.fleet_page:
        name, headline = f.fleet_page
        out.append(
            f'<p id="fleet-link">Gateways: {html.escape(headline)}; see '
            f'<a href="{html.escape(name)}">the fleet page</a>.</p>'
        )
    if not f.quality:
        out.append(
            "<p>The warehouse holds no readings yet: run <code>pubcomp pipeline run</code>.</p>"
        )
        return "".join([*out, "</body></html>"])
    cards = [
        ("origins", t["origins"]),
        ("sensors", t["sensors"]),
        ("readings kept", t["kept"]),
        ("duplicates removed", t["duplicates_removed"]),
        ("late", t["late"]),
        ("clock-flagged", t["clock_flagged"]),
        ("quarantined", t["quarantined"]),
    ]
    out.append('<div class="cards">')
    out += [
        f'<div class="card" id="total-{k.replace(" ", "-")}"><b>{v:,}</b>{k}</div>'
        for k, v in cards
    ]
    out.append("</div>")
    if f.heatmap:
        out += ["<h2>The fleet</h2>", _img(f.heatmap, "readings per origin over time")]
    if f.completeness is not None:
        out.append(_completeness_section(f))
    out.append(
        "<h2>Data quality</h2><p>Late: received more than "
        f"{transforms.LATE_AFTER_S // 60} minutes after "
        "it was taken. Clock-flagged: taken while the gateway's clock was not synchronised "
        "(<code>clock_unsynced</code>, <code>clock_corrected</code>). Quarantined lines are "
        "counted per origin (below). Highlighted rows have late, clock-flagged or quarantined "
        "data.</p>"
    )
    quarantined_by_origin = {o: sum(r.values()) for o, r in f.quarantine.items()}
    rows = []
    for q in f.quality:
        delay = f"{q.max_delay_s:,.0f}" if q.max_delay_s is not None else "-"
        cells = [
            q.origin,
            q.sensor,
            f"{q.kept:,}",
            f"{q.duplicates_removed:,}",
            f"{q.late:,}",
            f"{q.clock_flagged:,}",
            delay,
            _when(q.last_ts),
            q.unit,
        ]
        warn = bool(q.late or q.clock_flagged or quarantined_by_origin.get(q.origin))
        rows.append((cells, warn))
    headers = ["origin", "sensor", "readings", "duplicates removed", "late", "clock-flagged"]
    headers += ["max delay (s)", "last reading (UTC)", "unit"]
    out.append(_table(headers, rows, "quality"))
    if f.quarantine:
        qrows = [
            ([origin, reason, f"{n:,}"], True)
            for origin, reasons in sorted(f.quarantine.items())
            for reason, n in sorted(reasons.items())
        ]
        out += ["<h2>Quarantined</h2>", _table(["origin", "reason", "lines"], qrows, "quarantine")]
    if f.panels:
        out.append(f"<h2>Sensors</h2><p>Per {f.per} from <code>{f.level}</code>.</p>")
        for origin, data in sorted(f.panels.items()):
            out += [
                f'<h3 id="origin-{html.escape(origin)}">{html.escape(origin)}</h3>',
                _img(data, origin),
            ]
        if f.not_charted:
            out.append(
                f"<p>{len(f.not_charted)} more origins are in the table but not charted "
                "(<code>--max-origins</code>).</p>"
            )
    if f.runs:
        rrows = [(_run_cells(r), False) for r in reversed(f.runs)]
        out += ["<h2>Recent pipeline runs</h2>", _table(RUN_HEADERS, rrows, "runs")]
    return "".join([*out, "</body></html>"])


MAX_GAP_ROWS = 50


def _completeness_section(f: Facts) -> str:
    """Per gateway and day, the picture; then the streams with missing readings, the
    unexplained first (pipeline/completeness.py's reasons)."""
    c = f.completeness
    n = c.unexplained
    verdict = (
        f"{n:,} positions missing with no reason: the alarm"
        if n
        else "nothing missing without a reason"
    )
    out = [
        '<h2 id="completeness">Completeness</h2>',
        f'<p id="completeness-verdict" class="{"warn" if n else "ok"}">{html.escape(verdict)}. '
        "A position is a store seq of a gateway (its own readings and its nodes', as stored) "
        "or a node's message; missing ones are held at the gateway, evicted by its quota, "
        "dead-lettered, refused, dropped on the node, or unexplained (the gateways' ledgers "
        "say which). <code>pubcomp fleet completeness</code> prints the same.</p>",
    ]
    if f.completeness_chart:
        out.append(_img(f.completeness_chart, "missing positions per gateway and day"))
    rows = [
        (
            [
                s.gateway,
                s.stream,
                s.kind,
                f"{s.expected:,}",
                f"{s.landed:,}",
                f"{s.missing:,}",
                s.why(),
            ],
            bool(s.unexplained),
        )
        for s in c.streams
        if s.missing
    ]
    if rows:
        headers = ["gateway", "stream", "kind", "expected", "landed", "missing", "why"]
        out.append(_table(headers, rows[:MAX_GAP_ROWS], "completeness"))
        if len(rows) > MAX_GAP_ROWS:
            out.append(f"<p>{len(rows) - MAX_GAP_ROWS} more streams miss readings.</p>")
    return "".join(out)


RUN_HEADERS = ["started (UTC)", "files", "readings read", "duplicates removed", "quarantined"]
RUN_HEADERS += ["seconds"]


def _run_cells(run: dict[str, Any]) -> list[str]:
    """A run summary (``_runs/run-*.json``) as the table shows it: times like the
    others on the page, counts with thousands separators."""
    started = run.get("started")
    try:
        when = _when(datetime.fromisoformat(str(started).replace("Z", "+00:00")))
    except ValueError:
        when = str(started or "-")
    counts = [run.get(k) for k in ("files", "readings_in", "duplicates_removed", "quarantined")]
    seconds = run.get("seconds")
    return [
        when,
        *(f"{c:,}" if isinstance(c, int) else "-" for c in counts),
        f"{seconds:,.1f}" if isinstance(seconds, int | float) else "-",
    ]


def write(spark: SparkSession, warehouse: str, out: Path, **limits: int) -> Facts:
    facts = Report(spark, warehouse, **limits).facts()
    from . import fleetpage  # the gateways' health, worst first (issue 15)

    page = fleetpage.page_path(out)
    facts.fleet_page = (page.name, fleetpage.write(spark, warehouse, page))
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(render(facts))
    tmp.replace(out)
    return facts
