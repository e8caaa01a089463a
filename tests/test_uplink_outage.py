"""A long uplink outage as the numbers show it: backlog, oldest age, drain rate, ETA, and
the order the held readings reach the cloud.

A real ``pubcomp gateway run`` whose cloud broker (Mosquitto with persistence) is stopped
while two nodes hand it readings, then started again. The link to the cloud has a fixed
latency (50 ms each way), and each PUBLISH carries one reading (the nodes send one per
message, the store never splits a node message between PUBLISHes, the uplink's batch
is 1): with 20 in flight, each for two round trips, the drain takes seconds, not
milliseconds, and the status can be watched while it lasts. Nothing else produces
readings, so every figure has an exact expected value:

- while the broker is down: the backlog is exactly the readings the nodes had
  acknowledged since, the oldest age is that of the first of them (bracketed by the
  wall clock around its publish and the status request), no drain rate, no ETA
  (``/status.json`` and ``pubcomp status``: exit 4, "ETA -");
- while the held readings drain: a drain rate, and an ETA that is the backlog over
  that rate, the backlog only falling;
- after: no ETA, the drain logged with the count held;
- the independent paho subscriber gets every reading once (before any dedup), each
  node's readings in the order of their ids (seq, then index) and every reading of
  the first outage batch before any of the second: oldest first (design 4, "drains
  oldest first"; MQTT-4.6.0-1 and 5.0 MQTT-4.6.0-1 keep the order on resends).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest

from devkit.broker import Mosquitto
from devkit.checker import Checker
from devkit.gateway_helpers import GatewayProc
from devkit.link import SlowLink
from sync.uplink import UplinkStatus

LATENCY_S = 0.05
READINGS_PER_MESSAGE = 1
NODES = {"n1": "pw-1", "n2": "pw-2"}


class Node:
    """A node handing the gateway messages (paho, QoS 1, READINGS_PER_MESSAGE each); one is
    acknowledged (committed by the gateway) when ``send`` returns."""

    def __init__(self, node: str, password: str, port: int) -> None:
        self.node, self.seq = node, 0
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=node)
        self.client.username_pw_set(node, password)
        self.client.connect("127.0.0.1", port, keepalive=30)
        self.client.loop_start()

    def send(self, messages: int) -> set[str]:
        """Publish ``messages`` messages, wait for every PUBACK; the reading ids."""
        ids: set[str] = set()
        infos = []
        for _ in range(messages):
            ts = time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime())
            readings = [{"sensor": "t", "value": self.seq + i / 100, "unit": "C"}
                        for i in range(READINGS_PER_MESSAGE)]  # fmt: skip
            body = {"v": 1, "node": self.node, "boot": 1, "seq": self.seq, "ts": ts,
                    "readings": readings}  # fmt: skip
            topic = f"nodes/{self.node}/readings"
            infos.append(self.client.publish(topic, json.dumps(body), qos=1))
            ids |= {f"{self.node}/1/{self.seq}.{i}" for i in range(READINGS_PER_MESSAGE)}
            self.seq += 1
        for info in infos:
            info.wait_for_publish(30)
            assert info.is_published(), f"{self.node}: no PUBACK"
        return ids

    def stop(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()


def wait_for(what: str, check: Callable[[], Any], timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        assert time.monotonic() < deadline, f"waited {timeout:.0f} s for {what}"
        time.sleep(0.05)


def timed_status(gw: GatewayProc) -> tuple[float, float, dict[str, Any]]:
    """(wall time before the request, after it, the uplink's figures)."""
    before = time.time()
    up = gw.status()["uplink"]
    return before, time.time(), up


def status_lines(text: str) -> dict[str, str]:
    """The summary rows of ``pubcomp status`` (``key  value``, after the headline)."""
    rows = text.split("\n\n")[1].splitlines()
    return dict(re.split(r"\s{2,}", row, maxsplit=1) for row in rows)  # type: ignore[misc]


def reading_key(rid: str) -> tuple[str, tuple[int, int]]:
    """A node reading id ``node/boot/seq.index`` as (origin, (seq, index))."""
    origin, _boot, tail = rid.split("/")
    seq, index = tail.split(".")
    return origin, (int(seq), int(index))


@pytest.fixture
def cloud(tmp_path: Path) -> Iterator[Mosquitto]:
    broker = Mosquitto(tmp_path / "broker", persistence=True).start()
    yield broker
    broker.kill()


def test_long_outage_backlog_oldest_age_drain_rate_eta_and_oldest_first(
    tmp_path: Path, cloud: Mosquitto
) -> None:
    link = SlowLink(cloud.port, LATENCY_S, up=False)  # the latency on the way back
    checker = Checker(cloud.port, "telemetry/#", client_id="outage-checker").start()
    extra = {
        "uplink": {"batch": 1, "linger_ms": 0},
        "ingress": {"max_messages_per_second": 1000},
    }
    gw = GatewayProc(tmp_path, link.port, nodes=NODES, extra=extra)
    gw.start()
    nodes = {n: Node(n, pw, gw.ingress_port) for n, pw in NODES.items()}
    try:
        # Connected and caught up: what the nodes hand over is delivered; no ETA.
        before = set().union(*(n.send(1) for n in nodes.values()))
        wait_for("the first readings at the cloud", lambda: before <= checker.snapshot().keys())
        up = wait_for(
            "an empty backlog", lambda: (u := gw.status()["uplink"])["backlog"] == 0 and u
        )
        assert up["state"] == "connected" and up["eta_s"] is None, up

        # The cloud broker stops (gracefully: it keeps the sessions, ours and the checker's).
        cloud.stop()
        down = wait_for(
            "the uplink to notice",
            lambda: (u := gw.status()["uplink"])["state"] != "connected" and u,
        )
        assert down["backlog"] == 0 and down["oldest_age_s"] is None, down
        assert down["drain_rate"] == 0.0 and down["eta_s"] is None, down

        # First batch held: 600 readings from 2 nodes.
        t0 = time.time()
        first = nodes["n1"].send(1)
        t_first_ack = time.time()
        first |= nodes["n2"].send(300) | nodes["n1"].send(299)
        a0, a1, up = timed_status(gw)
        assert up["backlog"] == len(first) == 600, up
        # The oldest is the first reading of the outage: stored between t0 and its PUBACK.
        assert a0 - t_first_ack - 0.01 <= up["oldest_age_s"] <= a1 - t0 + 0.01, (up, t0, a1)
        assert up["state"] != "connected", up
        assert up["drain_rate"] == 0.0 and up["eta_s"] is None, up

        out = subprocess.run(
            [sys.executable, "-m", "pubcomp", "status", "--config", str(gw.fleet)],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert out.returncode == 4, out.stdout + out.stderr  # running, not delivering
        lines = status_lines(out.stdout)
        assert lines["backlog"].startswith("600 readings"), out.stdout
        assert lines["ETA"] == "-" and lines["drain rate"] == "- (not connected)", out.stdout
        assert re.fullmatch(r"\d+ s", lines["oldest"]), out.stdout

        # The outage goes on: the oldest grows older, the backlog grows.
        age = up["oldest_age_s"]
        wait_for("the oldest to age", lambda: gw.status()["uplink"]["oldest_age_s"] >= age + 1)
        second = nodes["n2"].send(300) | nodes["n1"].send(300)
        b0, b1, up = timed_status(gw)
        assert up["backlog"] == len(first) + len(second) == 1200, up
        assert b0 - t_first_ack - 0.01 <= up["oldest_age_s"] <= b1 - t0 + 0.01, up
        assert up["oldest_age_s"] >= age + 1, up  # still the first batch's oldest
        assert up["drain_rate"] == 0.0 and up["eta_s"] is None, up

        # The broker returns: the held readings drain, watched all the way.
        # (monotonic time before the request, the figures, the time after it)
        samples: list[tuple[float, dict[str, Any], float]] = []

        def drained() -> dict[str, Any] | None:
            asked = time.monotonic()
            u = gw.status()["uplink"]
            samples.append((asked, u, time.monotonic()))
            return u if u["backlog"] == 0 and u["catch_up"] is None and u["last_drain"] else None

        assert drained() is None  # the first sample is from before the broker is back
        cloud.start()

        after = wait_for("the drain", drained, timeout=120)
        expected = before | first | second
        counts = checker.wait_for(expected, 30)
        arrivals = checker.arrival_order()
    finally:
        for n in nodes.values():
            n.stop()
        checker.stop()
        link.close()
    assert gw.terminate() == 0

    # While it drained: a rate and an ETA, the ETA the backlog over the rate.
    draining = [(t, u) for t, u, _ in samples if u["state"] == "connected" and u["backlog"] > 0]
    with_eta = [(t, u) for t, u in draining if u["eta_s"] is not None]
    assert len(with_eta) >= 3, [u for _, u, _ in samples]
    for _, u in with_eta:
        assert u["drain_rate"] > 0, u
        # eta_s is backlog / rate before the rate is rounded to 0.1 for the output
        assert u["eta_s"] == pytest.approx(u["backlog"] / u["drain_rate"], rel=0.05, abs=0.2), u
    for _, u, _ in samples:
        if u["state"] != "connected":
            assert u["eta_s"] is None and u["drain_rate"] == 0.0, u
    backlogs = [u["backlog"] for _, u in draining]
    assert backlogs == sorted(backlogs, reverse=True), "the backlog grew with nothing produced"
    assert after["eta_s"] is None and after["last_drain"]["readings"] == 1200, after
    assert after["last_outage"] is not None, after
    # The rate is a real one: the deliveries since the connection's first one, over the
    # time since then. The samples bracket that first delivery (the last sample before
    # it, the first after it), which bounds what the rate may be at any later sample;
    # a rate off by a factor (a pace from before the outage, a window that lags) falls
    # outside. A busy machine only widens the bracket, it cannot fail the check.
    d0 = samples[0][1]["delivered"]
    k = max(i for i, (_, u, _) in enumerate(samples) if u["delivered"] == d0)
    m = k + 1
    (tk, uk, _), (_, um, tm) = samples[k], samples[m]
    checked = 0
    for ask, u, got in samples[m + 1 :]:
        if u["eta_s"] is None or got - tk > 29.0:
            continue  # not draining, or the 30 s horizon slid past the first delivery
        low = (u["delivered"] - um["delivered"]) / (got - tk)
        high = (u["delivered"] - uk["delivered"]) / max(ask - tm, 1e-3)
        assert low - 0.05 <= u["drain_rate"] <= high + 0.05, (low, high, u)
        checked += 1
    assert checked >= 1, [u for _, u, _ in samples]
    (ta, ua) = with_eta[0]
    # And the first ETA foretold the end: the drain ended within a factor of 3 of it
    # (plus the 2 s a last PUBCOMP may wait to be committed: uplink completion_delay).
    end = next(t for t, u, _ in samples if u["backlog"] == 0)
    assert ua["eta_s"] / 3 <= end - ta <= 3 * ua["eta_s"] + 2.5, (ua, end - ta)
    assert gw.log.read_text().count("backlog drained: 1200 readings delivered in ") == 1

    # At the independent subscriber: each reading once, oldest first.
    assert {k for k, n in counts.items() if n != 1} == set(), "a duplicate before any dedup"
    assert counts.keys() == expected
    per_origin: dict[str, list[tuple[int, int]]] = {}
    for rid in arrivals:
        origin, key = reading_key(rid)
        per_origin.setdefault(origin, []).append(key)
    for origin, keys in per_origin.items():
        assert keys == sorted(keys), f"{origin}'s readings out of order at the cloud"
    position = {rid: i for i, rid in enumerate(arrivals)}
    assert max(position[r] for r in first) < min(position[r] for r in second), (
        "a reading of the second outage batch reached the cloud before one of the first"
    )


def test_drain_rate_reaches_back_to_the_first_delivery_however_many_there_were(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A drain of thousands of one-reading messages: the rate is deliveries over time.

    The window once kept the last 600 deliveries, so a long drain of small messages lost
    its base and reported half its pace (CI saw 50.5/s for 101/s).
    """
    clock = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    status = UplinkStatus()
    status.record_connected()
    status.record_delivery(1)  # the first delivery: the window starts after it
    for _ in range(2000):  # 100 readings/s, one per delivery, for 20 s
        clock[0] += 0.01
        status.record_delivery(1)
    assert status.drain_rate() == pytest.approx(100.0, rel=0.01)
    for _ in range(2000):  # on past the 30 s horizon: the last 30 s, still 100/s
        clock[0] += 0.01
        status.record_delivery(1)
    assert status.drain_rate() == pytest.approx(100.0, rel=0.01)
    assert len(status._rate_window) <= 3002  # pruned by age, not grown without end
    status.record_down()
    assert status.drain_rate() == 0.0
