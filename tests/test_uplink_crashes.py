"""The four break points of the QoS 2 handshake (five kill points), against a real Mosquitto.

The uplink process SIGKILLs itself (a real kill, no cleanup) at a named point;
restarted, it must finish the handshake so that an independent paho-mqtt
subscriber sees every reading exactly once (MQTT-4.3.3-1, MQTT-4.4.0-1,
5.0 4.3.3-6: a PUBLISH is never resent after its PUBREL).
"""

from __future__ import annotations

import json
import random
import signal
import time
from pathlib import Path

import pytest

from devkit.broker import Mosquitto
from devkit.checker import Checker, exactly_once_report
from devkit.uplink_helpers import fill_store, run_uplink, start_uplink, store_states, summary

PROTOCOLS = [("5", 5), ("3.1.1", 4)]

# point -> the in-flight states the store must hold at the kill (design rule table)
EXPECTED_AT_KILL = {
    "publish_persisted": "PUBLISH_SENT",
    "publish_written": "PUBLISH_SENT",
    "pubrec_received": "PUBLISH_SENT",
    "pubrel_written": "PUBREL_SENT",
    "pubcomp_received": "PUBREL_SENT",
}


@pytest.mark.parametrize("protocol", [p for p, _ in PROTOCOLS], ids=["mqtt5", "mqtt311"])
@pytest.mark.parametrize("point", list(EXPECTED_AT_KILL))
def test_kill_at_break_point_then_resume_exactly_once(
    tmp_path: Path, mosquitto: Mosquitto, point: str, protocol: str
) -> None:
    checker = Checker(mosquitto.port, "telemetry/#").start()
    store = tmp_path / "gw.db"
    expected = fill_store(store, 600)
    try:
        first = run_uplink(
            store, mosquitto.url, "--protocol", protocol, "--batch", "10", crash_at=f"{point}:3"
        )
        assert first.returncode == -signal.SIGKILL, first.stderr
        states = store_states(store)
        assert EXPECTED_AT_KILL[point] in states
        second = run_uplink(store, mosquitto.url, "--protocol", protocol, "--batch", "10")
        assert second.returncode == 0, second.stderr
        assert summary(second)["backlog"] == 0
        counts = checker.wait_for(expected, 20)
    finally:
        checker.stop()
    report = exactly_once_report(counts, expected)
    assert report["missing"] == 0 and report["duplicated"] == 0, report
    assert report["unexpected"] == 0, report
    # The broker never saw a packet id reused while live (the failure paho causes).
    assert "Reused message ID" not in mosquitto.log()


def test_random_kills_20000_readings(tmp_path: Path, mosquitto: Mosquitto) -> None:
    """20,000 readings, the uplink killed 12 times at random moments while a producer appends."""
    rng = random.Random(20261121)
    checker = Checker(mosquitto.port, "telemetry/#").start()
    store = tmp_path / "gw.db"
    expected: set[str] = set()
    kills = 0
    points = list(EXPECTED_AT_KILL)
    try:
        for round_ in range(12):
            expected |= fill_store(store, 1700)
            if round_ % 2 == 0:
                # A random break point after a random number of passes through it.
                crash = f"{rng.choice(points)}:{rng.randint(1, 30)}"
                res = run_uplink(store, mosquitto.url, "--batch", "2", crash_at=crash)
                assert res.returncode == -signal.SIGKILL, (crash, res.stderr)
            else:
                # From outside, at a random time (after start-up, mid-traffic or idle).
                proc = start_uplink(store, mosquitto.url, "--batch", "2")
                time.sleep(rng.uniform(0.3, 0.7))
                proc.kill()
                proc.wait()
            kills += 1
        final = run_uplink(store, mosquitto.url, "--batch", "2", progress=checker.count)
        assert final.returncode == 0, final.stderr
        counts = checker.wait_for(expected, 60)
    finally:
        checker.stop()
    assert kills >= 10 and len(expected) == 20_400
    report = exactly_once_report(counts, expected)
    assert report["missing"] == 0 and report["duplicated"] == 0, report
    assert report["unexpected"] == 0, report


@pytest.mark.parametrize("protocol", [p for p, _ in PROTOCOLS], ids=["mqtt5", "mqtt311"])
def test_sigterm_leaves_the_session_resumable(
    tmp_path: Path, mosquitto: Mosquitto, protocol: str
) -> None:
    checker = Checker(mosquitto.port, "telemetry/#").start()
    store = tmp_path / "gw.db"
    expected = fill_store(store, 20_000)
    try:
        proc = start_uplink(store, mosquitto.url, "--protocol", protocol, "--batch", "2")
        deadline = time.monotonic() + 20
        while not checker.snapshot() and time.monotonic() < deadline:
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=20)
        assert proc.returncode == 0, err
        first = json.loads(out.strip().splitlines()[-1])
        assert first["backlog"] > 0, "stopped too late to show a resume"
        res = run_uplink(
            store, mosquitto.url, "--protocol", protocol, "--batch", "2", progress=checker.count
        )
        assert res.returncode == 0, res.stderr
        counts = checker.wait_for(expected, 30)
    finally:
        checker.stop()
    report = exactly_once_report(counts, expected)
    assert report["missing"] == 0 and report["duplicated"] == 0, report
    assert summary(res)["resent_after_session_loss"] == 0  # resumed, not lost
