"""The report's fleet page: every gateway worst first, each with a small backlog chart.

Written by ``pubcomp pipeline report`` beside the report (``{report}-fleet.html``),
from ``gateway_health`` and ``gateway_health_1m``; the same rows and order as
``pubcomp fleet status`` (pipeline/fleet.py). Self-contained: inline SVG, no
scripts, no files.
"""

from __future__ import annotations

import html
import re
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pyspark.sql import SparkSession

from pubcomp.sync.tables import Raw, html_row, html_table

from . import fleet
from .fleet import GatewayView

CHART_W, CHART_H = 180, 36
HISTORY_H = 24.0

CSS = """
body{font-family:system-ui,sans-serif;margin:1.5em;color:#222}
h1{font-size:1.4em}
.verdict{font-size:1.1em;font-weight:bold;padding:.5em .8em;border-radius:4px}
.verdict.ok{background:#e3f4e3;border-left:6px solid #2a8a2a}
.verdict.bad{background:#fff0d6;border-left:6px solid #d98200}
table{border-collapse:collapse;font-size:.85em;margin:1em 0}
th,td{border:1px solid #ccc;padding:.2em .5em;text-align:left;vertical-align:middle}
th{background:#f0f0f0}
tr.s3 td{background:#fde2e2}tr.s4 td,tr.s1 td{background:#fff0d6}
tr.s5 td,tr.s6 td{background:#fff8e0}
td.why{max-width:28em}tr.ok td{background:#fff}
svg.spark{display:block}.spark .line{fill:none;stroke:#1f77b4;stroke-width:1.5}
.spark .area{fill:#1f77b4;fill-opacity:.15}.spark .base{stroke:#bbb}
details{margin:.4em 0}.note{color:#555;font-size:.9em}
"""
# The release's apply state as a badge: in progress blue, committed green, reverted
# orange, refused red (the row colours mark the gateway's health, not its release).
RELEASE_CSS = (
    ".rel{display:inline-block;padding:0 .45em;border-radius:3px;color:#fff;white-space:nowrap;"
    "background:#777;font-weight:bold}.rel.committed{background:#2a8a2a}"
    ".rel.fetched,.rel.verified,.rel.staged,.rel.switched,.rel.trial{background:#1f6fb4}"
    ".rel.rolling_back,.rel.rolled_back{background:#c05800}.rel.refused{background:#b3261e}"
    ".rel-bad{color:#b3261e;font-weight:bold;white-space:nowrap}.rel-error{min-width:12em}"
)


def spark_svg(history: list[tuple[float, int]], gateway: str) -> str:
    """Backlog per minute (its highest) as a small inline chart."""
    if not history:
        return '<span class="note">no history</span>'
    t0, t1 = history[0][0], history[-1][0]
    span = max(t1 - t0, 60.0)
    peak = max(b for _, b in history)
    top = max(peak, 1)
    pts = [
        (2 + (t - t0) / span * (CHART_W - 4), CHART_H - 2 - b / top * (CHART_H - 12))
        for t, b in history
    ]
    if len(pts) == 1:
        pts.append((CHART_W - 2, pts[0][1]))
    line = " ".join(f"{x:.1f},{y:.1f}" for x, y in pts)
    area = f"{pts[0][0]:.1f},{CHART_H - 2} {line} {pts[-1][0]:.1f},{CHART_H - 2}"
    label = f"{gateway}: backlog per minute, {_hm(t0)} to {_hm(t1)} UTC, peak {peak:,} readings"
    return (
        f'<svg class="spark" width="{CHART_W}" height="{CHART_H}" role="img" '
        f'aria-label="{html.escape(label)}" data-peak="{peak}" data-points="{len(history)}">'
        f"<title>{html.escape(label)}</title>"
        f'<line class="base" x1="0" x2="{CHART_W}" y1="{CHART_H - 2}" y2="{CHART_H - 2}"/>'
        f'<polygon class="area" points="{area}"/><polyline class="line" points="{line}"/>'
        f'<text x="{CHART_W - 2}" y="9" text-anchor="end" font-size="9">peak {peak:,}</text>'
        "</svg>"
    )


def _hm(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%H:%M")


def _details(v: GatewayView) -> str:
    parts = []
    if v.sensors:
        rows = []
        for sid, s in sorted(v.sensors.items()):
            last = ", ".join(
                f"{ch.removeprefix(sid + '.')}={r.value}" + (f" {r.unit}" if r.unit else "")
                for ch, r in sorted(s.last.items())
            )
            rows.append([sid, s.state, last or "-", str(s.faults), str(s.restarts)])
        header = ["sensor", "state", "last reading", "faults", "restarts"]
        parts.append(html_table(header, map(html_row, rows)))
    if v.nodes:
        rows = [
            [nid, "yes" if n.connected else "no", n.last_seen or "never"]
            for nid, n in sorted(v.nodes.items())
        ]
        parts.append(html_table(["node", "connected", "last seen (UTC)"], map(html_row, rows)))
    if not parts:
        return ""
    return (
        f'<details id="detail-{html.escape(v.gateway)}"><summary>{html.escape(v.gateway)}: '
        f"sensors and nodes</summary>{''.join(parts)}</details>"
    )


BAR_W, BAR_H = 160, 12


def completeness_bar(counts: dict[str, int], gateway: str) -> str:
    """Expected positions as one bar: landed green, missing for a reason amber,
    unexplained red (at least a pixel, so a single lost one shows)."""
    expected = max(counts.get("expected", 0), 1)
    bad = counts.get("unexplained", 0)
    explained = counts.get("missing", 0) - bad
    widths = []
    for n in (bad, explained):
        widths.append(0.0 if not n else max(1.0, n / expected * BAR_W))
    landed_w = max(BAR_W - sum(widths), 0.0)
    label = (
        f"{gateway}: {counts.get('landed', 0):,} of {counts.get('expected', 0):,} landed, "
        f"{explained:,} missing for a reason, {bad:,} unexplained"
    )
    rects, x = [], 0.0
    for w, color in ((landed_w, "#7cc47c"), (widths[1], "#ffb84d"), (widths[0], "#e0474c")):
        if w:
            rects.append(
                f'<rect x="{x:.1f}" y="0" width="{w:.1f}" height="{BAR_H}" fill="{color}"/>'
            )
            x += w
    return (
        f'<svg class="bar" width="{BAR_W}" height="{BAR_H}" role="img" '
        f'aria-label="{html.escape(label)}" data-unexplained="{bad}">'
        f"<title>{html.escape(label)}</title>{''.join(rects)}</svg>"
    )


COMPLETENESS_HEADER = ["gateway", "expected", "landed", "missing", "unexplained"]
COMPLETENESS_HEADER += ["held", "evicted", "dead letter", "refused", "node dropped", ""]


def completeness_section(c: Any) -> str:
    """Per gateway: what its streams expect, what landed, what is missing and why
    (pipeline/completeness.py), the unexplained first."""
    if c is None or not c.found:
        return ""
    gws = c.gateways()
    order = sorted(gws, key=lambda g: (-gws[g].get("unexplained", 0), -gws[g]["missing"], g))
    rows = []
    for g in order:
        n = gws[g]
        cells = [g, *(f"{n.get(k, 0):,}" for k in ("expected", "landed", "missing", "unexplained",
                 "held", "evicted", "dead_letter", "refused", "node_dropped"))]  # fmt: skip
        level = "s3" if n.get("unexplained") else ("s6" if n["missing"] else "ok")
        rows.append(
            html_row(
                [*cells, Raw(completeness_bar(n, g))],
                attrs=f' class="{level}" data-gateway="{html.escape(g)}"',
            )
        )
    bad = c.unexplained
    verdict = (
        f"{bad:,} positions missing with no reason: run pubcomp fleet completeness"
        if bad
        else "nothing missing without a reason"
    )
    return (
        f'<h2 id="completeness">Completeness</h2><p id="completeness-verdict" class="verdict '
        f'{"bad" if bad else "ok"}">{html.escape(verdict)}</p>'
        "<p class=\"note\">Positions (a gateway's store seqs, its nodes' messages) each "
        "gateway's streams expect, landed in the warehouse, and missing: held in its store, "
        "evicted by its quota, dead-lettered, refused, dropped on the node (its ledgers say "
        "which), or unexplained.</p>" + html_table(COMPLETENESS_HEADER, rows, tid="completeness")
    )


def release_html(v: GatewayView) -> str:
    """The release cell: version (and the one under way), its state as a badge, the
    versions rolled back here, and why the last one was refused or rolled back."""
    r = v.release
    if r is None:
        return "-"
    state = re.sub(r"[^a-z_]", "", r.state) or "unknown"
    out = str(r.version) if r.version is not None else "config"
    if r.candidate is not None:
        out += f" &rarr; {r.candidate}"
    words = state.replace("_", " ")
    out += f' <span class="rel {state}" data-release-state="{state}">{words}</span>'
    if r.bad:
        out += f' <span class="rel-bad">bad: {", ".join(map(str, r.bad))}</span>'
    if r.last_error:
        out += f'<div class="note rel-error">{html.escape(r.last_error)}</div>'
    return Raw(out)


def render(
    views: list[GatewayView], warehouse: str, now: float | None = None, completeness: Any = None
) -> str:
    now = time.time() if now is None else now
    ranked = fleet.rank(views, now)
    judged = [fleet.judge(v, now) for v in ranked]
    head = fleet.headline(ranked, judged)
    level = "ok" if all(j.code == fleet.EXIT_OK for j in judged) and ranked else "bad"
    drawn = datetime.fromtimestamp(now, UTC).strftime("%Y-%m-%d %H:%M:%S")
    out = [
        "<!doctype html><html lang='en'><head><meta charset='utf-8'>",
        "<meta name='viewport' content='width=device-width, initial-scale=1'>",
        f"<title>pubcomp fleet: gateways</title><style>{CSS}{RELEASE_CSS}</style></head><body>",
        "<h1>pubcomp fleet: gateways</h1>",
        f'<p id="verdict" class="verdict {level}">{html.escape(head)}</p>',
        f'<p class="note">From <code>{html.escape(warehouse)}</code> (gateway_health), drawn '
        f"{drawn} UTC. Worst first: offline, oldest unsent reading, clock, disk. The chart is "
        f"each gateway's highest backlog per minute over the last {HISTORY_H:g} hours it "
        "reported. For an offline gateway the figures are those of its last status, the "
        "uplink state in parentheses.</p>",
    ]
    if not ranked:
        out.append(
            "<p>No gateway status yet: gateways publish it, <code>pubcomp ingest run</code> "
            "lands it, <code>pubcomp pipeline run</code> puts it here.</p>"
        )
        return "".join([*out, completeness_section(completeness), "</body></html>"])
    header = [*fleet.HEADER, "why", "backlog"]
    classes = [None] * len(fleet.HEADER) + ["why"]
    rel = fleet.HEADER.index("release")
    body = (
        html_row(
            [
                *(release_html(v) if i == rel else c for i, c in enumerate(fleet.row(v, j, now))),
                j.why if j.code else "",
                Raw(spark_svg(v.history, v.gateway)),
            ],
            attrs=f' class="s{j.code}" data-gateway="{html.escape(v.gateway)}"',
            classes=classes,
        )
        for v, j in zip(ranked, judged, strict=True)
    )
    table = html_table(header, body, tid="gateways")
    out.append(f'<div style="overflow-x:auto">{table}</div>')
    out.append(completeness_section(completeness))
    out += [_details(v) for v in ranked]
    return "".join([*out, "</body></html>"])


def page_path(report: Path) -> Path:
    return report.with_name(f"{report.stem}-fleet{report.suffix or '.html'}")


def write(spark: SparkSession, warehouse: str, out: Path) -> str:
    """Write the page; returns its headline (for the report's link to it)."""
    from . import completeview
    from .health import views

    found = views(spark, warehouse, history_hours=HISTORY_H)
    now = time.time()
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(render(found, warehouse, now, completeview.load(spark, warehouse)))
    tmp.replace(out)
    ranked = fleet.rank(found, now)
    return fleet.headline(ranked, [fleet.judge(v, now) for v in ranked])
