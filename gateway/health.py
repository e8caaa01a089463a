"""Health on 127.0.0.1:9101: ``/healthz``, ``/metrics`` (Prometheus), ``/status.json``, ``/``.

A small HTTP/1.1 server on the gateway's event loop (one request per
connection, GET and HEAD only): it needs nothing a web framework adds, and
every byte it serves comes from ``Gateway.snapshot()``. The status page draws
the backlog over the last hour as an inline SVG, so it needs no scripts and
no files.
"""

from __future__ import annotations

import asyncio
import contextlib
import html
import json
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

log = logging.getLogger(__name__)

Snapshot = Callable[[], Awaitable[dict[str, Any]]]
Health = Callable[[], tuple[bool, list[str]]]


class _Collector:
    """Turns one snapshot into Prometheus metrics at scrape time."""

    def __init__(self) -> None:
        self.snap: dict[str, Any] = {}

    def collect(self) -> Iterable[Metric]:
        s = self.snap
        if not s:
            return
        up, st, it, clk = s["uplink"], s["store"], s["intake"], s["clock"]

        plain: list[tuple[type[Metric], str, str, float | None]] = [
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
            (CounterMetricFamily, "intake_committed_readings", "readings committed to the store",
             it["committed_readings"]),
            (CounterMetricFamily, "intake_commits", "store commits (one fsync each)",
             it["commits"]),
            (CounterMetricFamily, "intake_duplicate_messages",
             "node messages seen before (acknowledged, not stored again)", it["duplicates"]),
            (CounterMetricFamily, "intake_refused_messages", "node messages refused: store full",
             it["refused_full"]),
            (GaugeMetricFamily, "store_bytes", "bytes used inside the store", st["store_bytes"]),
            (GaugeMetricFamily, "disk_free_bytes", "free bytes on the store's file system",
             st["disk_free_bytes"]),
            (GaugeMetricFamily, "clock_synced", "1 when the wall clock is trusted (NTP or GPS)",
             clk["synced"]),
            (GaugeMetricFamily, "up_seconds", "seconds since the gateway started", s["uptime_s"]),
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
            m.add_metric([], float("nan") if value is None else float(value))  # type: ignore[attr-defined]
            yield m
        events = CounterMetricFamily("pubcomp_store_events", "store counters", labels=["event"])
        for name, value in sorted(st["counters"].items()):
            events.add_metric([name], value)
        yield events
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


class HealthServer:
    def __init__(self, host: str, port: int, snapshot: Snapshot, health: Health) -> None:
        self.host, self.port = host, port
        self.snapshot, self.health = snapshot, health
        self.history: list[tuple[float, int]] = []  # (unix time, backlog), the last hour
        self._collector = _Collector()
        self._registry = CollectorRegistry(auto_describe=False)
        self._registry.register(self._collector)  # type: ignore[arg-type]
        self._server: asyncio.Server | None = None

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._handle, self.host, self.port)
        return self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()

    def record(self, backlog: int, now: float | None = None) -> None:
        now = time.time() if now is None else now
        self.history.append((now, backlog))
        while self.history and self.history[0][0] < now - 3600:
            self.history.pop(0)

    async def _handle(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 5.0)
            method, target, _ = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ", 2)
            status, ctype, body = await self._route(method, target.split("?", 1)[0])
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

    async def _route(self, method: str, path: str) -> tuple[str, str, bytes]:
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
            page = status_page(await self.snapshot(), self.history, self.health())
            return "200 OK", "text/html; charset=utf-8", page.encode()
        return "404 Not Found", "text/plain", b"not found\n"


def backlog_svg(history: list[tuple[float, int]], now: float, width: int = 640) -> str:
    """The backlog over the last hour as an SVG line chart."""
    height, pad = 160, 40
    top = max([b for _, b in history] + [1])
    pts = " ".join(
        f"{pad + (t - now + 3600) / 3600 * (width - pad - 8):.1f},"
        f"{height - 20 - b / top * (height - 36):.1f}"
        for t, b in history
    )
    return (
        f'<svg width="{width}" height="{height}" role="img" aria-label="backlog, last hour">'
        f'<rect x="{pad}" y="16" width="{width - pad - 8}" height="{height - 36}" '
        'fill="#f7f7f7" stroke="#ccc"/>'
        f'<text x="{pad - 4}" y="22" font-size="11" text-anchor="end">{top:,}</text>'
        f'<text x="{pad - 4}" y="{height - 20}" font-size="11" text-anchor="end">0</text>'
        f'<text x="{pad}" y="{height - 4}" font-size="11">60 min ago</text>'
        f'<text x="{width - 8}" y="{height - 4}" font-size="11" text-anchor="end">now</text>'
        f'<polyline fill="none" stroke="#1f77b4" stroke-width="2" points="{pts}"/></svg>'
    )


def _rows(pairs: Iterable[tuple[str, Any]]) -> str:
    return "".join(
        f"<tr><th>{html.escape(str(k))}</th><td>{html.escape(str(v))}</td></tr>" for k, v in pairs
    )


def status_page(
    snap: dict[str, Any], history: list[tuple[float, int]], health: tuple[bool, list[str]]
) -> str:
    from .status import node_rows, sensor_rows, summary_pairs

    ok, why = health
    sensors = "".join(
        "<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>"
        for row in sensor_rows(snap)
    )
    nodes = "".join(
        "<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>"
        for row in node_rows(snap)
    )
    title = html.escape(f"pubcomp gateway {snap['gateway']}")
    state = "healthy" if ok else "UNHEALTHY: " + "; ".join(why)
    return f"""<!doctype html><html><head><meta charset="utf-8">
<meta http-equiv="refresh" content="10"><title>{title}</title>
<style>body{{font-family:sans-serif;margin:1.5em}}td,th{{padding:2px 10px;text-align:left}}
th{{color:#555;font-weight:normal}}</style></head><body>
<h1>{title}</h1><p><b>{html.escape(state)}</b></p>
<h2>Backlog, last hour</h2>{backlog_svg(history, time.time())}
<table>{_rows(summary_pairs(snap))}</table>
<h2>Sensors</h2><table><tr><th>sensor</th><th>state</th><th>last value</th><th>readings</th>
<th>faults</th><th>restarts</th></tr>{sensors}</table>
<h2>Nodes</h2><table><tr><th>node</th><th>connected</th><th>last seen</th><th>messages</th>
<th>rejected</th></tr>{nodes}</table></body></html>"""
