"""Health on 127.0.0.1:9101: ``/healthz``, ``/metrics`` (Prometheus), ``/status.json``, ``/``.

A small HTTP/1.1 server on the gateway's event loop (one request per
connection, GET and HEAD only): it needs nothing a web framework adds, and
every byte it serves comes from ``Gateway.snapshot()``. The status page draws
the backlog as an inline SVG, so it needs no scripts and no files.
"""

from __future__ import annotations

import asyncio
import contextlib
import html
import json
import logging
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric

from pubcomp.sync.tables import html_row, html_table

from .ingress import CLOSED, REFUSED_CONNECTION, REFUSED_LOGIN

log = logging.getLogger(__name__)

Snapshot = Callable[[], Awaitable[dict[str, Any]]]
Health = Callable[[], tuple[bool, list[str]]]


class _Collector:
    """Turns one snapshot into Prometheus metrics at scrape time."""

    def __init__(self) -> None:
        self.snap: dict[str, Any] = {}
        self.started: float | None = None  # Unix time the gateway started, fixed at first scrape

    def collect(self) -> Iterable[Metric]:
        s = self.snap
        if not s:
            return
        up, st, it, clk = s["uplink"], s["store"], s["intake"], s["clock"]
        e2e = up.get("end_to_end") or {}
        if self.started is None:
            # Fixed once, so it changes only when the process does (``changes()`` counts restarts).
            # The exact start, not time - rounded uptime: that lands up to 0.1 s after the start.
            self.started = s["started"]
        yield InfoMetricFamily(
            "pubcomp_gateway",
            "the gateway's id and fleet",
            {"gateway": s["gateway"], "fleet": s["fleet"]},
        )

        Family = type[CounterMetricFamily | GaugeMetricFamily]
        plain: list[tuple[Family, str, str, float | None]] = [
            (GaugeMetricFamily, "uplink_connected", "1 while connected to the cloud broker",
             up["connected"]),
            (GaugeMetricFamily, "backlog_readings", "readings waiting in the store", up["backlog"]),
            (GaugeMetricFamily, "oldest_reading_age_seconds", "age of the oldest waiting reading",
             up["oldest_age_s"]),
            (GaugeMetricFamily, "inflight_messages", "uplink messages awaiting PUBREC/PUBCOMP",
             up["inflight_messages"]),
            (GaugeMetricFamily, "drain_rate_readings_per_second", "delivery rate over 30 s",
             up["drain_rate"]),
            (CounterMetricFamily, "uplink_delivered_readings", "readings the broker completed",
             up["delivered"]),
            (GaugeMetricFamily, "end_to_end",
             "1 while delivered readings are kept until the cloud ingest says they landed",
             e2e.get("enabled", False)),
            (GaugeMetricFamily, "awaiting_landing_readings",
             "readings the broker completed that the cloud has not yet said it landed",
             e2e.get("awaiting_landing")),
            (GaugeMetricFamily, "awaiting_landing_age_seconds",
             "age of the oldest delivered message not yet landed (NaN: none)",
             e2e.get("awaiting_age_s")),
            (CounterMetricFamily, "landed_readings",
             "readings let go because the cloud ingest said they landed",
             e2e.get("landed")),
            (CounterMetricFamily, "resent_not_landed_readings",
             "readings published again: not landed within uplink.landed_timeout_s",
             e2e.get("resent_not_landed")),
            (GaugeMetricFamily, "dead_letter_readings",
             "readings the broker refused for good (or uplink.max_refusals times), kept aside",
             up["dead_letter"]),
            (CounterMetricFamily, "intake_committed_readings", "readings committed to the store",
             it["committed_readings"]),
            (CounterMetricFamily, "intake_commits", "store commits (one fsync each)",
             it["commits"]),
            (CounterMetricFamily, "intake_duplicate_messages",
             "node messages seen before (acknowledged, not stored again)", it["duplicates"]),
            (CounterMetricFamily, "intake_refused_messages", "node messages refused: store full",
             it["refused_full"]),
            (CounterMetricFamily, "intake_refused_sensor_readings",
             "own sensor readings refused: store full", it["sensor_readings_refused"]),
            (CounterMetricFamily, "intake_lost_sensor_readings",
             "own sensor readings whose commit failed", it["sensor_readings_lost"]),
            (GaugeMetricFamily, "store_writable",
             "1 while the store's file system takes writes; 0: a dying card (read-only, EIO)",
             st["writable"]),
            (CounterMetricFamily, "store_write_errors",
             "commits the store's file system refused (read-only, I/O errors)",
             st["write_errors"]),
            (CounterMetricFamily, "intake_refused_unwritable_readings",
             "readings refused (not acknowledged): the store could not be written",
             st["refused_while_unwritable"]),
            (CounterMetricFamily, "uplink_delivered_while_unwritable",
             "readings delivered at least once on the degraded session while the store was "
             "unwritable (sent again by the QoS 2 session later: the cloud dedups them)",
             up["degraded"]["delivered_while_unwritable"]),
            (GaugeMetricFamily, "store_bytes", "bytes used inside the store", st["store_bytes"]),
            (GaugeMetricFamily, "store_quota_bytes",
             "the store's quota (store.quota_mb), NaN without one", st["quota_bytes"]),
            (GaugeMetricFamily, "disk_free_bytes", "free bytes on the store's file system",
             st["disk_free_bytes"]),
            (GaugeMetricFamily, "clock_synced", "1 when the wall clock is trusted (NTP or GPS)",
             clk["synced"]),
            (GaugeMetricFamily, "up_seconds", "seconds since the gateway started", s["uptime_s"]),
            (GaugeMetricFamily, "start_timestamp_seconds",
             "Unix time the gateway process started: each change is a restart", self.started),
            (CounterMetricFamily, "store_commits", "store transactions committed (one fsync each)",
             st["commits"]),
            (CounterMetricFamily, "store_fsyncs", "fsyncs by the store (commits, 2 per checkpoint)",
             s["flash"]["fsyncs"]),
            (CounterMetricFamily, "flash_written_bytes",
             "bytes the gateway process wrote to storage (/proc/self/io write_bytes)",
             s["flash"]["bytes_written"]),
            (GaugeMetricFamily, "flash_bytes_per_day", "write rate over the last hour, per day",
             s["flash"]["bytes_per_day"]),
            (GaugeMetricFamily, "flash_life_years",
             "rated card endurance / write rate: the card's projected life at this load",
             s["flash"]["life_years"]),
        ]  # fmt: skip
        for family, name, doc, value in plain:
            m = family(f"pubcomp_{name}", doc)
            m.add_metric([], float("nan") if value is None else float(value))
            yield m
        events = CounterMetricFamily("pubcomp_store_events", "store counters", labels=["event"])
        # dropped_quota is there from 0, so that increase() sees the first drop (PubcompStoreFull).
        for name, value in sorted(({"dropped_quota": 0} | st["counters"]).items()):
            events.add_metric([name], value)
        yield events
        acks = CounterMetricFamily(
            "pubcomp_landed_acks",
            "landed acknowledgements by verdict (accepted; ignored: out_of_range, bad_hmac, "
            "other_gateway, other_epoch, malformed)",
            labels=["verdict"],
        )
        for verdict_, n in sorted(({"accepted": 0} | (e2e.get("acks") or {})).items()):
            acks.add_metric([verdict_], n)
        yield acks
        readings = CounterMetricFamily("pubcomp_sensor_readings", "readings", labels=["sensor"])
        faults = CounterMetricFamily("pubcomp_sensor_faults", "faults", labels=["sensor", "kind"])
        restarts = CounterMetricFamily("pubcomp_sensor_restarts", "restarts", labels=["sensor"])
        for sid, d in sorted(s["sensors"].items()):
            readings.add_metric([sid], d["readings"])
            restarts.add_metric([sid], d["restarts"])
            for kind, n in sorted(d["fault_kinds"].items()):
                faults.add_metric([sid, kind], n)
        yield from (readings, faults, restarts)
        msgs = CounterMetricFamily("pubcomp_node_messages", "messages stored", labels=["node"])
        rej = CounterMetricFamily("pubcomp_node_rejected", "rejected", labels=["node", "reason"])
        conn = GaugeMetricFamily("pubcomp_node_connected", "1 while connected", labels=["node"])
        seen = GaugeMetricFamily("pubcomp_node_last_seen_timestamp_seconds", "", labels=["node"])
        for nid, d in sorted(s["nodes"].items()):
            msgs.add_metric([nid], d["messages"])
            conn.add_metric([nid], d["connected"])
            seen.add_metric([nid], d["last_seen"] or 0)
            for reason, n in sorted(d["rejected"].items()):
                rej.add_metric([nid, reason], n)
        yield from (msgs, rej, conn, seen)
        labels = ["listener", "port"]
        acc = CounterMetricFamily(
            "pubcomp_ingress_connections", "connections accepted per listener", labels=labels
        )
        opn = GaugeMetricFamily(
            "pubcomp_ingress_open_connections", "open connections per listener", labels=labels
        )
        bad = CounterMetricFamily(
            "pubcomp_ingress_tls_handshake_failures",
            "failed TLS handshakes (plaintext clients, refused certificates)",
            labels=labels,
        )
        for name, d in sorted(s.get("listeners", {}).items()):
            lv = [name, str(d["port"])]
            acc.add_metric(lv, d["accepted"])
            opn.add_metric(lv, d["open"])
            if d["tls"]:
                bad.add_metric(lv, d["tls_failures"])
        yield from (acc, opn, bad)
        yield from _ingress_limits(s.get("ingress"))
        m = CounterMetricFamily(
            "pubcomp_log_lines_suppressed",
            "log lines not written: repeats of an event within a minute, summarised",
        )
        m.add_metric([], s.get("log_lines_suppressed", 0))
        yield m


def _ingress_limits(ing: dict[str, Any] | None) -> Iterable[Metric]:
    """What clients were refused or cut off for (issue 25), by reason, from 0."""
    if ing is None:
        return
    for name, doc, reasons, counts in (
        ("refused_connections", "connections closed at accept: over a limit",
         REFUSED_CONNECTION, ing["refused_connections"]),
        ("refused_logins", "logins refused (CONNACK 4 / 0x86), by reason",
         REFUSED_LOGIN, ing["refused_logins"]),
        ("closed_connections", "connections the gateway ended: timeouts, floods, stalls, errors",
         CLOSED, ing["closed"]),
    ):  # fmt: skip
        fam = CounterMetricFamily(f"pubcomp_ingress_{name}", doc, labels=["reason"])
        for reason, n in sorted(({r: 0 for r in reasons} | counts).items()):
            fam.add_metric([reason], n)
        yield fam
    for family, name, doc, value in (
        (GaugeMetricFamily, "pending_logins", "connections not yet logged in",
         ing["pending_logins"]),
        (CounterMetricFamily, "password_checks", "scrypt checks run", ing["password_checks"]),
        (GaugeMetricFamily, "password_checks_waiting", "scrypt checks queued",
         ing["password_checks_waiting"]),
        (CounterMetricFamily, "wrong_passwords_from_cache",
         "wrong passwords seen before, refused without a scrypt check",
         ing["wrong_passwords_from_cache"]),
    ):  # fmt: skip
        m = family(f"pubcomp_ingress_{name}", doc)
        m.add_metric([], value)
        yield m


class HealthServer:
    def __init__(self, host: str, port: int, snapshot: Snapshot, health: Health) -> None:
        self.host, self.port = host, port
        self.snapshot, self.health = snapshot, health
        self.history: list[tuple[float, int]] = []  # (unix time, backlog), the last hour
        self._collector = _Collector()
        self._registry = CollectorRegistry(auto_describe=False)
        self._registry.register(self._collector)
        self._server: asyncio.Server | None = None

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._handle, self.host, self.port)
        port: int = self._server.sockets[0].getsockname()[1]
        return port

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()

    def record(self, backlog: int, now: float | None = None) -> None:
        now = time.time() if now is None else now
        self.history.append((now, backlog))
        while self.history and self.history[0][0] < now - HISTORY_S:
            self.history.pop(0)

    async def _handle(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 5.0)
            method, target, _ = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ", 2)
            path, _, qs = target.partition("?")
            status, ctype, body = await self._route(method, path, urllib.parse.parse_qs(qs))
            w.write(
                f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                "Cache-Control: no-store\r\nConnection: close\r\n\r\n".encode()
            )
            if method != "HEAD":
                w.write(body)
            await w.drain()
        except (TimeoutError, ValueError, ConnectionError, asyncio.IncompleteReadError):
            pass
        except asyncio.LimitOverrunError:
            pass
        except Exception:
            log.exception("health server: request failed")
        finally:
            w.close()

    async def _route(
        self, method: str, path: str, query: dict[str, list[str]]
    ) -> tuple[str, str, bytes]:
        if method not in ("GET", "HEAD"):
            return "405 Method Not Allowed", "text/plain", b"GET only\n"
        if path == "/healthz":
            ok, why = self.health()
            text = "ok\n" if ok else "unhealthy: " + "; ".join(why) + "\n"
            return ("200 OK" if ok else "503 Service Unavailable"), "text/plain", text.encode()
        if path == "/metrics":
            self._collector.snap = await self.snapshot()
            return "200 OK", "text/plain; version=0.0.4", generate_latest(self._registry)
        if path == "/status.json":
            snap = await self.snapshot()
            snap["backlog_history"] = self.history
            return "200 OK", "application/json", json.dumps(snap).encode()
        if path == "/":
            span = query.get("span", ["fit"])[0]
            page = status_page(await self.snapshot(), self.history, self.health(), span)
            return "200 OK", "text/html; charset=utf-8", page.encode()
        return "404 Not Found", "text/plain", b"not found\n"


SPANS = {"fit": None, "10m": 600.0, "1h": 3600.0}  # the page's choice (?span=)
HISTORY_S = 3600.0
_PLOT_TOP, _PLOT_H = 8, 130  # the plot area inside the chart's SVG, in px


def _nice_step(top: float, ticks: int = 4) -> int:
    raw = max(top / ticks, 1.0)
    mag: int = 10 ** len(str(int(raw))) // 10
    return next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)


def _time_step(span: float) -> float:
    return next((s for s in (10, 15, 30, 60, 120, 300, 600, 900, 1800) if span / s <= 5), 3600)


def fit_span(history: list[tuple[float, int]], now: float, outage: float | None) -> float:
    """Seconds shown when the span is ``fit``: the last outage with room on both sides,
    or the whole history of a young gateway (at least a minute, at most an hour)."""
    first = history[0][0] if history else now
    if outage is not None and outage >= now - HISTORY_S:
        want = (now - outage) * 1.5 + 30
    else:
        want = now - first
    return min(HISTORY_S, max(60.0, want))


def backlog_svg(
    history: list[tuple[float, int]],
    now: float,
    span: float = HISTORY_S,
    outages: list[tuple[float, float]] | None = None,
) -> str:
    """The backlog over the last ``span`` seconds as an inline SVG that takes the page's width.

    The data sit in a nested SVG stretched to the plot area (strokes keep their width);
    labels are placed in percent, so text keeps its size at any width. Each of about
    300 columns draws the highest sample it covers, so a peak is never smoothed away.
    """
    t0 = now - span
    pts = [(t, b) for t, b in history if t >= t0]
    before = [(t, b) for t, b in history if t < t0]
    if before:
        pts.insert(0, (t0, before[-1][1]))
    peak = max((b for _, b in pts), default=0)
    step = _nice_step(max(peak, 10))
    top = max(step * -(-max(peak, 10) // step), step)
    cols: dict[int, tuple[float, int]] = {}
    for t, b in pts:
        c = int((t - t0) / span * 300)
        if c not in cols or b > cols[c][1]:
            cols[c] = (t, b)
    xy = [((t - t0) / span * 1000, 1000 - b / top * 1000) for t, b in sorted(cols.values())]
    line = " ".join(f"{x:.1f},{y:.1f}" for x, y in xy)
    area = f"{xy[0][0]:.1f},1000 {line} {xy[-1][0]:.1f},1000" if xy else ""
    shade = "".join(
        f'<rect class="outage" x="{max(a - t0, 0) / span * 1000:.1f}" y="0" '
        f'width="{(min(b, now) - max(a, t0)) / span * 1000:.1f}" height="1000"/>'
        for a, b in outages or []
        if b > t0
    )
    grid, ylab = "", ""
    for v in range(0, top + 1, step):
        y = 1000 - v / top * 1000
        grid += f'<line class="grid" x1="0" x2="1000" y1="{y:.1f}" y2="{y:.1f}"/>'
        py = _PLOT_TOP + _PLOT_H * (1 - v / top)
        ylab += f'<text class="ytick" x="-6" y="{py + 4:.1f}" text-anchor="end">{v:,}</text>'
    tstep = _time_step(span)
    fmt = "%H:%M" if tstep >= 60 else "%H:%M:%S"
    xlab = ""
    t = (t0 // tstep + 1) * tstep
    i = 0
    while t <= now:
        i += 1
        pct = (t - t0) / span * 100
        anchor = "start" if pct < 6 else "end" if pct > 94 else "middle"
        bottom = _PLOT_TOP + _PLOT_H
        xlab += (
            f'<line class="tick" x1="{pct:.2f}%" x2="{pct:.2f}%" y1="{bottom}" y2="{bottom + 5}"/>'
            f'<text class="xtick{"" if i % 2 else " even"}" x="{pct:.2f}%" y="{bottom + 18}" '
            f'text-anchor="{anchor}">'
            f"{time.strftime(fmt, time.localtime(t))}</text>"
        )
        t += tstep
    data = (
        f'<polygon class="area" points="{area}"/><polyline class="line" points="{line}"/>'
        if xy
        else ""
    )
    label = f"backlog in readings, {_span_text(span)} to {time.strftime('%H:%M:%S')}, peak {peak:,}"
    return (
        f'<svg id="backlog-chart" class="chart" width="100%" height="{_PLOT_TOP + _PLOT_H + 24}" '
        f'role="img" aria-label="{label}" data-peak="{peak}" data-top="{top}" '
        f'data-span="{span:.0f}">'
        f'<svg x="0" y="{_PLOT_TOP}" width="100%" height="{_PLOT_H}" viewBox="0 0 1000 1000" '
        f'preserveAspectRatio="none"><rect class="plot" x="0" y="0" width="1000" height="1000"/>'
        f"{shade}{grid}{data}</svg>{ylab}{xlab}</svg>"
    )


def _span_text(span: float) -> str:
    if span < 120:
        return f"last {span:.0f} s"
    if span < 7200:
        return f"last {span / 60:.0f} min"
    return f"last {span / 3600:.0f} h"


def _rows(pairs: Iterable[tuple[str, Any]]) -> str:
    return "".join(
        f"<tr><th>{html.escape(str(k))}</th><td>{html.escape(str(v))}</td></tr>" for k, v in pairs
    )


def _table(tid: str, header: list[str], rows: list[list[str]], empty: str) -> str:
    if not rows:
        return f'<p id="{tid}" class="empty">{html.escape(empty)}</p>'
    table = html_table(header, (html_row(row) for row in rows), tid=tid)
    return f'<div class="scroll">{table}</div>'


_CSS = """
body{font-family:system-ui,sans-serif;margin:1em auto;padding:0 1em;max-width:60em;color:#222}
h1{font-size:1.4em;overflow-wrap:anywhere}h2{font-size:1.1em;margin:1.2em 0 .3em}
.verdict{font-size:1.15em;font-weight:bold;padding:.6em .8em;border-radius:4px;margin:.5em 0}
.verdict.ok{background:#e3f4e3;border-left:6px solid #2a8a2a}
.verdict.down{background:#fff0d6;border-left:6px solid #d98200}
.verdict.unhealthy{background:#fde2e2;border-left:6px solid #c0392b}
.note{color:#555;margin:.2em 0;font-size:.9em}
.scroll{overflow-x:auto}table{border-collapse:collapse}
td,th{padding:2px 10px 2px 0;text-align:left;vertical-align:top}
th{color:#555;font-weight:normal;white-space:nowrap}
#summary td{overflow-wrap:anywhere}
.chartbox{padding-left:3.2em;margin:.3em 0 .2em}
svg.chart{overflow:visible;display:block;font-size:11px}
.plot{fill:#f7f7f7}.grid{stroke:#ddd;vector-effect:non-scaling-stroke}
.line{fill:none;stroke:#1f77b4;stroke-width:2;vector-effect:non-scaling-stroke}
.area{fill:#1f77b4;fill-opacity:.15}.outage{fill:#d98200;fill-opacity:.15}
.tick{stroke:#999}.empty{color:#555;font-style:italic}
@media (max-width:600px){.xtick.even{display:none}}
"""


def status_page(
    snap: dict[str, Any],
    history: list[tuple[float, int]],
    health: tuple[bool, list[str]] | None = None,
    span: str = "fit",
) -> str:
    from .status import hms, node_rows, sensor_rows, summary_pairs, verdict

    now = snap["time"]
    level, headline, _ = verdict(snap)
    up = snap["uplink"]
    outages = []
    if up.get("last_outage"):
        outages.append((up["last_outage"]["from"], up["last_outage"]["to"]))
    if up.get("down_since") is not None and up["state"] != "connected":
        outages.append((up["down_since"], now))
    begun = max((a for a, _ in outages), default=None)
    # The chart ends at this snapshot's backlog, so its right edge is "now".
    history = [*history, (now, up["backlog"])]
    seconds = SPANS.get(span) or fit_span(history, now, begun)
    chosen = span if span in SPANS else "fit"
    choice = " · ".join(
        f"<b>{name}</b>" if name == chosen else f'<a href="?span={name}">{name}</a>'
        for name in SPANS
    )
    peak = max((b for t, b in history if t >= now - seconds), default=0)
    peak_at = next((t for t, b in history if t >= now - seconds and b == peak), None)
    if peak:
        about = f"peak {peak:,} readings at {hms(peak_at)}"
    else:
        about = "no backlog: every reading was delivered as it came"
    title = html.escape(f"pubcomp gateway {snap['gateway']}")
    sensors = _table(
        "sensors",
        ["sensor", "state", "last value", "readings", "faults", "restarts"],
        sensor_rows(snap),
        "No sensors in this gateway's section of the fleet file.",
    )
    nodes = _table(
        "nodes",
        ["node", "connected", "last seen", "messages", "rejected", "software"],
        node_rows(snap),
        "No nodes in this gateway's section of the fleet file (or its ingress is off).",
    )
    drawn = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(now))
    return f"""<!doctype html><html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta http-equiv="refresh" content="10"><title>{title}</title><style>{_CSS}</style></head><body>
<h1>{title}</h1>
<p id="verdict" class="verdict {level}">{html.escape(headline)}</p>
<p id="drawn" class="note">Drawn {drawn} by the gateway; reloads every 10 s.</p>
<h2>Backlog: readings waiting, {_span_text(seconds)}</h2>
<p class="note">Span: {choice}. Sampled every 2 s and at each reconnection; {about}.</p>
<div class="chartbox">{backlog_svg(history, now, seconds, outages)}</div>
<table id="summary">{_rows(summary_pairs(snap))}</table>
<h2>Sensors</h2>{sensors}
<h2>Nodes</h2>{nodes}
</body></html>"""
