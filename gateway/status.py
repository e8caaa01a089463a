"""``pubcomp status``: the running gateway's state as a table (from its health server).

The same rows feed the status page, so the terminal and the browser agree.
"""

from __future__ import annotations

import json
import urllib.request
from typing import Any


def _age(t: float | None, now: float) -> str:
    if t is None:
        return "never"
    return f"{_duration(now - t)} ago"


def _duration(s: float | None) -> str:
    if s is None:
        return "-"
    s = max(0.0, s)
    if s < 120:
        return f"{s:.0f} s"
    if s < 7200:
        return f"{s / 60:.0f} min"
    if s < 172800:
        return f"{s / 3600:.1f} h"
    return f"{s / 86400:.1f} d"


def _mb(n: float | None) -> str:
    return "-" if n is None else f"{n / 1e6:,.1f} MB"


def _num(v: float | None) -> str:
    return "null" if v is None else f"{v:.6g}"


def summary_pairs(snap: dict[str, Any]) -> list[tuple[str, str]]:
    up, st, clk = snap["uplink"], snap["store"], snap["clock"]
    eta = up.get("eta_s")
    return [
        ("gateway", f"{snap['gateway']} (fleet {snap['fleet']}), up {_duration(snap['uptime_s'])}"),
        ("health", "ok" if snap["healthy"] else "UNHEALTHY"),
        ("uplink", f"{up['state']} to {up['broker']} (QoS {up['qos']})"),
        ("backlog", f"{up['backlog']:,} readings, {up['inflight_messages']} messages in flight"),
        ("oldest", _duration(up["oldest_age_s"])),
        ("drain rate", f"{up['drain_rate']:,.1f} readings/s"),
        ("ETA", _duration(eta) if eta is not None else "-"),
        ("delivered", f"{up['delivered']:,} readings since start"),
        ("clock", f"{clk['source']}" + ("" if clk["synced"] else " (readings flagged unsynced)")),
        (
            "store",
            f"{_mb(st['store_bytes'])} used"
            + (f" of {_mb(st['quota_bytes'])} quota" if st["quota_bytes"] else "")
            + f", disk free {_mb(st['disk_free_bytes'])}",
        ),
        ("flash", _flash(snap.get("flash"))),
        ("last error", up.get("last_error") or "-"),
    ]


def _flash(f: dict[str, Any] | None) -> str:
    if not f or f.get("bytes_per_day") is None:
        return "-"
    life = f["life_years"]
    text = (
        f"{_mb(f['bytes_per_day'])} written a day, {f['fsyncs_per_s'] or 0:,.1f} fsyncs/s; "
        f"card life {'-' if life is None else f'{life:,.0f} years'} "
        f"at {f['endurance_tbw']:g} TB endurance"
    )
    return text + (" (WARNING: under 5 years)" if f["life_warning"] else "")


def sensor_rows(snap: dict[str, Any]) -> list[list[str]]:
    rows = []
    for sid, s in sorted(snap["sensors"].items()):
        last = ", ".join(
            f"{ch.removeprefix(sid + '.')}={_num(v['value'])}"
            + (f" {v['unit']}" if v["unit"] else "")
            for ch, v in sorted(s["last"].items())
        )
        rows.append(
            [sid, s["state"], last or "-", str(s["readings"]), str(s["faults"]), str(s["restarts"])]
        )
    return rows


def node_rows(snap: dict[str, Any]) -> list[list[str]]:
    now = snap["time"]
    return [
        [
            nid,
            "yes" if n["connected"] else "no",
            _age(n["last_seen"], now),
            str(n["messages"]),
            str(sum(n["rejected"].values())),
        ]
        for nid, n in sorted(snap["nodes"].items())
    ]


def table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
        for r in [header, *rows]
    )


def render(snap: dict[str, Any]) -> str:
    pairs = summary_pairs(snap)
    width = max(len(k) for k, _ in pairs)
    out = [f"{k:<{width}}  {v}" for k, v in pairs]
    if snap["sensors"]:
        hdr = ["sensor", "state", "last value", "readings", "faults", "restarts"]
        out += ["", table(hdr, sensor_rows(snap))]
    if snap["nodes"]:
        hdr = ["node", "connected", "last seen", "messages", "rejected"]
        out += ["", table(hdr, node_rows(snap))]
    return "\n".join(out)


def fetch(host: str, port: int, timeout: float = 5.0) -> dict[str, Any]:
    host = "127.0.0.1" if host in ("0.0.0.0", "") else host
    url = f"http://{host}:{port}/status.json"
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        data: dict[str, Any] = json.loads(resp.read())
    return data


def not_running_hint(store_path: str) -> str:
    return (
        f"no gateway answers on its health port; is it running?  "
        f"(systemctl status pubcomp-gateway; the store is {store_path}; "
        f"`pubcomp store stats --store {store_path}` reads it directly)"
    )
