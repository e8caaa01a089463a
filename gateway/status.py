"""``pubcomp status``: the running gateway's state as a table (from its health server).

The same rows feed the status page, so the terminal and the browser agree.
"""

from __future__ import annotations

import json
import time
import urllib.request
from typing import Any

from pubcomp.sync.exitcodes import EXIT_NOT_DELIVERING, EXIT_OK, EXIT_UNHEALTHY
from pubcomp.sync.gatewaystatus import Level
from pubcomp.sync.tables import text_table
from pubcomp.sync.units import counted, duration, size

# ``pubcomp status`` exits with the verdict's code (sync/exitcodes.py; docs/operations.md,
# "Reading status"): 0 delivering, 1 unhealthy (a task died, the store does not answer or
# cannot be written), 4 not delivering (the uplink is down or stalled: readings wait on
# disk); 2 a bad command, 3 not running (gateway/commands.py).
STALL_S = 60.0  # connected with messages in flight, and nothing delivered for this long
# Delivered readings not landed in the cloud for this long are worth the headline.
LANDING_LAG_S = 600.0


def _age(t: float | None, now: float) -> str:
    if t is None:
        return "never"
    return f"{duration(now - t)} ago"


def hms(t: float | None) -> str:
    """A wall time as the gateway's local HH:MM:SS."""
    return "-" if t is None else time.strftime("%H:%M:%S", time.localtime(t))


def store_headline(snap: dict[str, Any]) -> str | None:
    """The dying card in one line, or None while the store takes writes:
    "STORE READ-ONLY since 12:03:04: refusing new readings; delivering the 1,234 held
    (not durable)"."""
    st = snap.get("store") or {}
    bad = st.get("unwritable")
    if st.get("writable", True) or not bad:
        return None
    what = "STORE READ-ONLY" if bad["kind"] == "read-only" else "STORE WRITES FAIL (I/O errors)"
    up = snap.get("uplink") or {}
    held = up.get("backlog", 0)
    degraded = up.get("degraded") or {}
    if degraded.get("active"):
        sending = f"delivering the {held:,} held (not durable)"
    else:
        sending = f"{held:,} held, not being delivered (uplink {up.get('state', 'down')})"
    return f"{what} since {hms(bad['since'])}: refusing new readings; {sending}"


def verdict(snap: dict[str, Any]) -> tuple[Level, str, int]:
    """(level, headline, exit code) for the top of the page and of ``pubcomp status``.

    level is ``ok``, ``down`` (running but not delivering) or ``unhealthy``.
    """
    up, now = snap["uplink"], snap["time"]
    held = f"{up['backlog']:,} readings held safely on disk"
    dying = store_headline(snap)
    if dying is not None:  # before any other problem: it explains most of them
        return "unhealthy", dying, EXIT_UNHEALTHY
    if not snap["healthy"]:
        why = "; ".join(snap.get("health_problems") or []) or "see the gateway's log"
        return "unhealthy", f"UNHEALTHY: {why}", EXIT_UNHEALTHY
    if up["state"] != "connected":
        since = up.get("down_since") or now
        if up.get("last_error_at") is None and up["state"] in ("starting", "connecting"):
            head = f"uplink connecting (since {hms(since)}, {duration(now - since)})"
        else:
            head = f"uplink DOWN since {hms(since)} ({duration(now - since)})"
        return "down", f"{head}, {held}", EXIT_NOT_DELIVERING
    last = max(up.get("last_delivery_at") or 0, up.get("connected_since") or 0)
    if up["inflight_messages"] and now - last > STALL_S:
        return (
            "down",
            f"uplink STALLED: connected, but nothing delivered for {duration(now - last)}, {held}",
            EXIT_NOT_DELIVERING,
        )
    head = f"OK, delivering: uplink connected since {hms(up.get('connected_since'))}"
    outage, catch, drain = up.get("last_outage"), up.get("catch_up"), up.get("last_drain")
    if outage and now - outage["to"] < 3600:
        head = (
            f"OK, delivering again: uplink back since {hms(outage['to'])} "
            f"after {duration(outage['to'] - outage['from'])} down"
        )
    if catch:
        eta = up.get("eta_s")
        head += f", sending the {catch['backlog']:,} readings held" + (
            f" (ETA {duration(eta)})" if eta is not None else ""
        )
    elif drain and now - drain["at"] < 3600:
        head += (
            f"; the {drain['readings']:,} readings held were delivered "
            f"in {drain['seconds']:g} s (by {hms(drain['at'])})"
        )
    tail = f"; backlog {up['backlog']:,}"
    e2e = up.get("end_to_end") or {}
    age = e2e.get("awaiting_age_s")
    if age is not None and age > LANDING_LAG_S:
        tail += (
            f"; {e2e['awaiting_landing']:,} delivered readings not yet landed in the cloud "
            f"(oldest {duration(age)}): kept, and sent again"
        )
    return "ok", head + tail, EXIT_OK


def last_error(up: dict[str, Any], now: float) -> str:
    """The uplink's last error with its time, marked as past once the uplink is back."""
    text, at = up.get("last_error_text"), up.get("last_error_at")
    if not text or at is None:
        return up.get("last_error") or "-"
    when = f"{hms(at)} ({duration(now - at)} ago)"
    back = up.get("connected_since")
    if up["state"] == "connected" and back is not None and back >= at:
        return f"past: {when}, resolved {hms(back)}: {text}"
    return f"{when}: {text}"


def _num(v: float | None) -> str:
    return "null" if v is None else f"{v:.6g}"


def summary_pairs(snap: dict[str, Any]) -> list[tuple[str, str]]:
    up, st, clk, now = snap["uplink"], snap["store"], snap["clock"], snap["time"]
    eta = up.get("eta_s")
    connected = up["state"] == "connected"
    if connected:
        since = f"since {hms(up.get('connected_since'))}"
    else:
        since = f"DOWN since {hms(up.get('down_since'))}"
    return [
        ("gateway", f"{snap['gateway']} (fleet {snap['fleet']}), up {duration(snap['uptime_s'])}"),
        ("health", "ok (tasks and store)" if snap["healthy"] else "UNHEALTHY"),
        ("uplink", f"{up['state']} {since}, to {up['broker']} (QoS {up['qos']})"),
        (
            "backlog",
            f"{counted(up['backlog'], 'reading')}, "
            f"{counted(up['inflight_messages'], 'message')} in flight",
        ),
        ("oldest", duration(up["oldest_age_s"])),
        ("drain rate", f"{up['drain_rate']:,.1f} readings/s" if connected else "- (not connected)"),
        ("ETA", duration(eta) if eta is not None else "-"),
        ("delivered", f"{up['delivered']:,} readings since start"),
        ("landing", landing(up.get("end_to_end") or {})),
        ("clock", f"{clk['source']}" + ("" if clk["synced"] else " (readings flagged unsynced)")),
        (
            "store",
            f"{size(st['store_bytes'])} used"
            + (f" of {size(st['quota_bytes'])} quota" if st["quota_bytes"] else "")
            + f", disk free {size(st['disk_free_bytes'])}",
        ),
        ("flash", _flash(snap.get("flash"))),
        *_ingress(snap.get("ingress")),
        ("last error", last_error(up, now)),
    ]


def landing(e2e: dict[str, Any]) -> str:
    """End to end: what the broker has and the cloud has not yet said it landed."""
    if not e2e.get("enabled"):
        return (
            "end to end OFF (uplink.end_to_end: false): readings go at the broker's PUBCOMP, "
            "so a broker that loses them loses them"
        )
    n, age = e2e["awaiting_landing"], e2e["awaiting_age_s"]
    text = f"{counted(n, 'reading')} delivered, awaiting landing"
    if n and age is not None:
        text += f", oldest {duration(age)}"
    if e2e.get("resent_not_landed"):
        text += f"; {e2e['resent_not_landed']:,} re-sent (not landed in time)"
    code = e2e.get("subscription_refused")
    if code is not None:
        text += f"; acknowledgements REFUSED by the broker ({code:#04x}): check its ACL"
    refused = sum(v for k, v in (e2e.get("acks") or {}).items() if k != "accepted")
    if refused:
        text += f"; {refused:,} acknowledgements ignored (see the log)"
    return text


def _ingress(ing: dict[str, Any] | None) -> list[tuple[str, str]]:
    """The ingress's connections, and what it refused, when it refused anything."""
    if not ing:
        return []
    refused = sum(ing["refused_connections"].values())
    logins = sum(ing["refused_logins"].values())
    cut = sum(ing["closed"].values())
    if not (refused or logins or cut):
        return []
    return [
        (
            "ingress",
            f"{ing['open']} open, {ing['pending_logins']} logging in; refused "
            f"{counted(refused, 'connection')} over the limits and "
            f"{counted(logins, 'login')}; {cut:,} closed (floods, stalls, timeouts, errors)",
        )
    ]


def _flash(f: dict[str, Any] | None) -> str:
    if not f or f.get("bytes_per_day") is None:
        return "-"
    life = f["life_years"]
    text = (
        f"{size(f['bytes_per_day'])} written a day, {f['fsyncs_per_s'] or 0:,.1f} fsyncs/s; "
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


def software_text(sw: dict[str, Any] | None) -> str:
    """A node's software as it said it (gateway/nodeoffer.py): "3", "4 (trial)",
    "3, fetching 4: 41%", "3 (4 rolled back)"; "-" before it said anything."""
    if not sw or sw.get("version") is None:
        return "-"
    text = str(sw["version"])
    if sw.get("state") == "trial":
        text += " (trial)"
    offer, total = sw.get("offer"), sw.get("total") or 0
    if offer not in (None, sw["version"]) and total and sw.get("state") == "downloading":
        text += f", fetching {offer}: {100 * sw.get('served', 0) // total}%"
    if sw.get("bad"):
        text += f" ({sw['bad']} rolled back)"
    return text


def node_rows(snap: dict[str, Any]) -> list[list[str]]:
    now = snap["time"]
    return [
        [
            nid,
            "yes" if n["connected"] else "no",
            _age(n["last_seen"], now),
            str(n["messages"]),
            str(sum(n["rejected"].values())),
            software_text(n.get("software")),
        ]
        for nid, n in sorted(snap["nodes"].items())
    ]


def render(snap: dict[str, Any]) -> str:
    pairs = summary_pairs(snap)
    width = max(len(k) for k, _ in pairs)
    out = [verdict(snap)[1], ""] + [f"{k:<{width}}  {v}" for k, v in pairs]
    if snap["sensors"]:
        hdr = ["sensor", "state", "last value", "readings", "faults", "restarts"]
        out += ["", text_table(hdr, sensor_rows(snap))]
    if snap["nodes"]:
        hdr = ["node", "connected", "last seen", "messages", "rejected", "software"]
        out += ["", text_table(hdr, node_rows(snap))]
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
