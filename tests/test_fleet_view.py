"""The fleet's judgement (pipeline/fleet.py): worst first, the exit codes, offline and silent."""

from __future__ import annotations

from typing import Any

from pubcomp.pipeline import fleet
from pubcomp.pipeline.fleetcmd import Watch
from pubcomp.sync.wire import wire_time

NOW = 1_800_000_000.0


def _iso(t: float) -> str:

    return wire_time(t)


def status(gw: str, **over: Any) -> dict[str, Any]:
    """A valid online status message; ``over`` replaces parts (uplink, clock, store, ...)."""
    msg: dict[str, Any] = {
        "v": 1,
        "gateway": gw,
        "fleet": "f",
        "id": "ab12/1",
        "online": True,
        "reason": "heartbeat",
        "ts": _iso(NOW - 5),
        "version": "0.1.0",
        "started": _iso(NOW - 3600),
        "uptime_s": 3600.0,
        "verdict": {"level": "ok", "headline": "OK, delivering", "exit": 0},
        "problems": [],
        "uplink": {
            "state": "connected",
            "broker": "mqtt://cloud:1883",
            "qos": 2,
            "connected_since": _iso(NOW - 3000),
            "down_since": None,
            "backlog": 3,
            "inflight_messages": 1,
            "oldest_age_s": 1.0,
            "drain_rate": 5.0,
            "eta_s": None,
            "delivered": 1000,
            "last_error": None,
            "last_error_at": None,
        },
        "store": {"bytes": 10_000_000, "quota_bytes": None, "disk_free_bytes": 20_000_000_000},
        "flash": {"bytes_per_day": 1e8, "life_years": 100.0},
        "clock": {"source": "kernel", "synced": True, "corrections": 1},
        "sensors": {},
        "nodes": {},
    }
    for k, v in over.items():
        msg[k] = {**msg[k], **v} if isinstance(msg.get(k), dict) else v
    return msg


def offline(gw: str, reason: str = "will") -> dict[str, Any]:
    return {
        "v": 1,
        "gateway": gw,
        "fleet": "f",
        "id": "ab12/will-1" if reason == "will" else "ab12/9",
        "online": False,
        "reason": reason,
        "ts": _iso(NOW - 600),
        "version": "0.1.0",
        "started": _iso(NOW - 3600),
    }


def test_a_healthy_fleet_exits_0() -> None:
    views = [fleet.view(status(g), seen=NOW - 5) for g in ("a", "b")]
    assert fleet.code(views, NOW) == fleet.EXIT_OK
    assert fleet.render(views, NOW).startswith("OK: all 2 gateways online and delivering")
    assert fleet.code([], NOW) == fleet.EXIT_OFFLINE  # nothing known to deliver


def test_worst_first_and_the_exit_code_of_the_worst() -> None:
    down = {"state": "backoff", "backlog": 400, "oldest_age_s": 30.0, "drain_rate": 0.0}
    views = [
        fleet.view(status("ok"), seen=NOW),
        fleet.view(
            status("disk", store={"bytes": 950, "quota_bytes": 1000, "disk_free_bytes": 10**10}),
            seen=NOW,
        ),
        fleet.view(status("clock", clock={"source": "none", "synced": False}), seen=NOW),
        fleet.view(
            status("down", uplink=down, verdict={"level": "down", "headline": "uplink DOWN"}),
            seen=NOW - 10,
        ),
        fleet.view(offline("gone"), seen=NOW - 600, last_online=status("gone")),
    ]
    order = [v.gateway for v in fleet.rank(views, NOW)]
    assert order == ["gone", "down", "clock", "disk", "ok"]
    judged = {v.gateway: fleet.judge(v, NOW) for v in views}
    assert {g: j.code for g, j in judged.items()} == {
        "gone": 3,
        "down": 4,
        "clock": 5,
        "disk": 6,
        "ok": 0,
    }
    assert fleet.code(views, NOW) == 3
    assert fleet.code(views[:4], NOW) == 4  # without the offline one
    assert fleet.code(views[:3], NOW) == 5
    # The down gateway's oldest reading goes on ageing after its status.
    assert views[3].oldest_now(NOW) == 40.0
    # The offline one keeps the figures of its last online status.
    assert views[4].backlog == 3 and views[4].clock_synced is True
    text = fleet.render(views, NOW)
    assert text.splitlines()[0] == (
        "4 of 5 gateways need attention: 1 OFFLINE, 1 NOT DELIVERING, 1 CLOCK, 1 DISK"
    )
    assert "  gone: connection lost, the broker sent its Will" in text


def test_silent_stopped_and_unhealthy() -> None:
    silent = fleet.view(status("s"), seen=NOW - 3600)
    assert fleet.judge(silent, NOW).why == "silent: no status for 60 min"
    assert fleet.judge(silent, NOW, stale_s=7200).code == 0
    stopped = fleet.view(offline("x", "stopped"))
    assert fleet.judge(stopped, NOW).why.startswith("stopped cleanly at ")
    sick = fleet.view(
        status("u", verdict={"level": "unhealthy", "headline": "UNHEALTHY"}, problems=["probe"])
    )
    assert (fleet.judge(sick, NOW).code, fleet.judge(sick, NOW).why) == (1, "probe")
    # A reading waiting 2 minutes on a connected gateway is held; a second is in passing.
    slow = fleet.view(status("slow", uplink={"oldest_age_s": 120.0}), seen=NOW)
    quick = fleet.view(status("quick", uplink={"oldest_age_s": 1.0}), seen=NOW)
    clock = fleet.view(status("clk", clock={"source": "none", "synced": False}), seen=NOW)
    assert [v.gateway for v in fleet.rank([quick, clock, slow], NOW)] == ["slow", "clk", "quick"]


def test_the_watch_keeps_the_newest_and_ignores_what_is_no_status() -> None:
    import json

    w = Watch()
    assert w.add(json.dumps(status("a")).encode(), retained=True, now=NOW)
    assert not w.add(b"not json", retained=False, now=NOW)
    assert not w.add(json.dumps({**status("b"), "v": 2}).encode(), retained=False, now=NOW)
    assert w.add(json.dumps(offline("a")).encode(), retained=False, now=NOW)
    (v,) = w.views()
    assert not v.online and v.seen == NOW and v.backlog == 3  # figures from its last status
    assert w.invalid == 2


def test_one_line_errors(tmp_path: Any, capsys: Any) -> None:
    from pubcomp import cli

    (tmp_path / "warehouse").mkdir()
    (tmp_path / "warehouse" / "readings").mkdir()
    code = cli.main(["fleet", "status", "--warehouse", str(tmp_path / "warehuose")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert f"did you mean {tmp_path / 'warehouse'}?" in err
    assert err.startswith("pubcomp fleet status: warehouse ")
    code = cli.main(["fleet", "watch", "--broker", "http://x", "--once"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("pubcomp fleet watch: broker URL 'http://x'")


def test_the_status_schema_is_valid_and_the_documented_examples_follow_it() -> None:
    import json
    import re
    from pathlib import Path

    import jsonschema

    from pubcomp.sync import wire

    text = (Path(__file__).parent.parent / "sync/schemas/gateway-status.v1.json").read_text()
    jsonschema.Draft202012Validator.check_schema(json.loads(text))
    doc = (Path(__file__).parent.parent / "docs/wire-format.md").read_text()
    section = doc[doc.index("## Gateway status") :]
    examples = [json.loads(b) for b in re.findall(r"```json\n(.*?)```", section, re.S)]
    assert [e["online"] for e in examples] == [True, False]
    v = wire.validator("gateway-status.v1.json")
    for e in [*examples, status("a"), offline("b", "stopped")]:
        assert list(v.iter_errors(e)) == [], e
    # An offline message carries no figures; an online one must.
    assert not v.is_valid({**offline("c"), "uplink": status("c")["uplink"]})
    assert not v.is_valid({k: x for k, x in status("d").items() if k != "uplink"})
