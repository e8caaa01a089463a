"""The gateway's status link: a retained status on its own connection, a Will marking it offline."""

from __future__ import annotations

import asyncio
import json
import textwrap
import time
from pathlib import Path

import aiomqtt
import paho.mqtt.client as mqtt

from devkit.broker import Mosquitto
from devkit.gateway_helpers import GatewayProc
from devkit.ingest_helpers import IngestProc, rejected
from devkit.link import SlowLink
from pubcomp.gateway.config import Fleet
from pubcomp.gateway.fleetstatus import _keep_the_disconnect

from .fleet_helpers import StatusWatcher
from .test_fleet_view import status

SIM = [{"id": "t", "type": "simulated", "interval_s": 0.2, "unit": "C"}]
FAST = {"status": {"min_interval_s": 1, "heartbeat_s": 5}}


def test_status_is_retained_and_the_will_marks_a_killed_gateway_offline(
    tmp_path: Path, mosquitto: Mosquitto
) -> None:
    (tmp_path / "gw").mkdir()
    gw = GatewayProc(tmp_path / "gw", mosquitto.port, gid="gw-s", sensors=SIM, extra=FAST)
    watcher = StatusWatcher(mosquitto.port)
    try:
        gw.start(env={"PUBCOMP_CLOCK_KERNEL": "synced"})
        first = watcher.wait("gw-s", lambda m: m["online"])
        assert first["reason"] == "connected" and first["_topic"] == "telemetry/gw-s/status"
        ok = watcher.wait(
            "gw-s", lambda m: m["online"] and m["sensors"]["t"]["readings"] > 0, timeout=30
        )
        assert ok["clock"]["source"] == "kernel" and ok["clock"]["synced"] is True
        assert ok["sensors"]["t"]["last"]["t"]["unit"] == "C"
        assert ok["uplink"]["broker"] == mosquitto.url
        assert ok["store"]["disk_free_bytes"] > 0
        # The same figures as the gateway's own status page.
        snap = gw.status()
        assert snap["gateway"] == ok["gateway"] and snap["fleet"] == ok["fleet"] == "e2e"
        # A heartbeat comes even when nothing changes.
        watcher.wait("gw-s", lambda m: m.get("reason") == "heartbeat", timeout=30)

        gw.kill()
        will = watcher.wait("gw-s", lambda m: not m["online"], timeout=30)
        assert will["reason"] == "will" and will["id"].split("/")[0] == ok["id"].split("/")[0]
        # Retained: a subscriber that comes later is told at once.
        late = StatusWatcher(mosquitto.port, name="late")
        try:
            seen = late.wait("gw-s", lambda m: True, timeout=10)
            assert seen["_retained"] and seen["reason"] == "will"
        finally:
            late.close()

        # Again with MQTT 3.1.1 (the status link follows the uplink's protocol) and no clock.
        gw.extra["uplink"] = {"protocol": "3.1.1"}
        gw.write()
        gw.start(env={"PUBCOMP_CLOCK_KERNEL": "unsynced"})
        run1 = ok["id"].split("/")[0]
        back = watcher.wait("gw-s", lambda m: m["online"] and not m["id"].startswith(run1))
        assert back["reason"] == "connected"
        assert back["clock"]["synced"] is False and back["clock"]["source"] == "none"
        assert gw.terminate() == 0
        run2 = back["id"].split("/")[0]
        stopped = watcher.wait("gw-s", lambda m: not m["online"] and m["id"].startswith(run2))
        assert stopped["reason"] == "stopped"
        # The clean stop's DISCONNECT kept the Will from following it.
        assert watcher.all("gw-s")[-1]["id"] == stopped["id"]
        assert watcher.invalid == []
    finally:
        watcher.close()


def test_a_clean_stop_over_a_slow_link_says_stopped_not_will(
    tmp_path: Path, mosquitto: Mosquitto
) -> None:
    """A cellular uplink (0.5 s each way): the clean stop's goodbye waits a round trip
    for its PUBACK, longer than the 0.25 s after which the gateway's stop cancels its
    chores again (sync/running.cancel_all); the status link is closed before that
    (``StatusPublisher.close``), so the goodbye is whole and the DISCONNECT follows it.
    (Not seen failing on the old code here: its goodbye was already on the wire when the
    second cancel came.)"""
    link = SlowLink(mosquitto.port, delay=0.5)
    (tmp_path / "gw").mkdir()
    gw = GatewayProc(tmp_path / "gw", link.port, gid="gw-slow", sensors=SIM, extra=FAST)
    watcher = StatusWatcher(mosquitto.port)
    try:
        gw.start()
        online = watcher.wait("gw-slow", lambda m: m["online"], timeout=30)
        assert gw.terminate() == 0
        run = online["id"].split("/")[0]
        last = watcher.wait("gw-slow", lambda m: not m["online"], timeout=30)
        assert (last["reason"], last["id"].split("/")[0]) == ("stopped", run), last
        assert watcher.all("gw-slow")[-1]["id"] == last["id"]  # no Will after it
    finally:
        watcher.close()
        link.close()


def test_status_keys_are_validated_like_the_others(tmp_path: Path) -> None:
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(
        textwrap.dedent(
            """
            fleet: test
            defaults:
              uplink: {broker: "mqtt://cloud:1883", topic_prefix: t}
              status: {min_interval_s: 30, heartbeat_s: 10}
            gateways:
              gw1:
                status: {topic: "fleet/+/x", hartbeat_s: 60}
              gw2: {}
            """
        ).lstrip()
    )
    problems = Fleet(fleet).check()
    assert any(
        p.startswith(f"{fleet}:7: gateways.gw1.status.topic: Value error, expected a topic name")
        for p in problems
    ), problems
    assert (
        f"{fleet}:7: gateways.gw1.status.hartbeat_s: unknown key (did you mean 'heartbeat_s'?)"
        in problems
    )
    assert any("heartbeat_s 10 is shorter than min_interval_s 30" in p for p in problems), problems
    fleet.write_text(fleet.read_text().replace("heartbeat_s: 10", "heartbeat_s: 60"))
    gw2 = Fleet(fleet).gateway("gw2")
    assert gw2.status_topic() == "t/gw2/status" and gw2.status.enabled


def test_the_ingest_lands_statuses_apart_and_rejects_what_is_no_status(
    tmp_path: Path, mosquitto: Mosquitto
) -> None:
    landing = tmp_path / "landing"
    ing = IngestProc(mosquitto.port, landing).start()
    good = status("gw-x")
    pub = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="pub")
    pub.connect("127.0.0.1", mosquitto.port)
    pub.loop_start()
    try:
        for payload in (json.dumps(good), json.dumps({**good, "v": 2}), b"\xff not json"):
            pub.publish("telemetry/gw-x/status", payload, qos=1).wait_for_publish(10)
    finally:
        pub.loop_stop()
        pub.disconnect()

    def count(pattern: str) -> int:
        return sum(len(f.read_text().splitlines()) for f in landing.glob(pattern))

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if count("_incoming/_status/*.jsonl") == 1 and count("_incoming/_rejected/status-*") == 2:
            break
        time.sleep(0.05)
    stats = ing.stop()
    assert stats["status"] == {"messages": 1, "rejected": 2, "connections": 1, "last_error": None}
    (f,) = landing.glob("_status/date=*/status-ingest-1-*.jsonl")  # rolled at the stop
    line = json.loads(f.read_text())
    assert line.pop("received").endswith("Z") and line == good
    reasons = [r["reason"] for r in rejected(landing)]
    assert sorted(r.split(":")[0] for r in reasons) == ["not_json", "schema"], reasons
    assert not list(landing.glob("date=*/*")), "no status among the readings"


def test_the_keepalive_task_the_clean_disconnect_stops_is_there(mosquitto: Mosquitto) -> None:
    """``fleetstatus._keep_the_disconnect`` stops aiomqtt's keepalive task (paho-mqtt's
    keepalive check could close the socket with the DISCONNECT queued): a private
    attribute of aiomqtt's, so an aiomqtt that renames it fails here, not as a Will at
    one release switch in several."""

    async def check() -> None:
        async with aiomqtt.Client("127.0.0.1", mosquitto.port, identifier="misc-check") as c:
            deadline = time.monotonic() + 10
            while getattr(c, "_misc_task", None) is None and time.monotonic() < deadline:
                await asyncio.sleep(0.01)  # made by a callback after the connect
            task = getattr(c, "_misc_task", None)
            assert isinstance(task, asyncio.Task) and not task.done(), task
            _keep_the_disconnect(c)
            await asyncio.wait({task}, timeout=10)
            assert task.cancelled()

    asyncio.run(check())
