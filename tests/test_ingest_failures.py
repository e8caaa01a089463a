"""The ingest as a whole stops when a part of it fails (issue 25): a writer that cannot
write must not leave the process running with its other part, looking alive while it
lands nothing. It exits non-zero, and systemd restarts it."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest

from devkit.broker import Mosquitto
from devkit.ingest_helpers import IngestProc, landed
from devkit.powercut import PowerCutMount, fuse_missing

pytestmark = pytest.mark.skipif(fuse_missing() is not None, reason=str(fuse_missing()))


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[PowerCutMount]:
    with PowerCutMount(tmp_path / "backing", tmp_path / "disk") as d:
        yield d


def _message(n: int) -> bytes:
    reading = {"id": f"gw1/e/{n}", "origin": "gw1", "sensor": "t", "ts": None, "value": 1.0,
               "unit": "C", "flags": []}  # fmt: skip
    return json.dumps({"v": 1, "gateway": "gw1", "readings": [reading]}).encode()


def test_a_landing_disk_that_refuses_writes_stops_the_whole_ingest(
    tmp_path: Path, disk: PowerCutMount, mosquitto: Mosquitto
) -> None:
    landing = disk.path / "landing"
    ing = IngestProc(mosquitto.port, landing)
    ing.log = tmp_path / "ingest.log"  # off the failing disk, to read why it stopped
    ing.start()  # readings and status landing both
    pub = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="pub")
    pub.connect("127.0.0.1", mosquitto.port)
    pub.loop_start()
    try:
        pub.publish("telemetry/gw1/readings", _message(1), qos=2).wait_for_publish(10)
        deadline = time.monotonic() + 30
        while "gw1/e/1" not in landed(landing, rolled_only=False):
            assert time.monotonic() < deadline, "the first message never landed"
            time.sleep(0.05)
        disk.readonly()  # the landing file system remounted read-only (a dying disk)
        pub.publish("telemetry/gw1/readings", _message(2), qos=2)
        assert ing.proc is not None
        rc = ing.proc.wait(60)  # before: the status landing ran on, and this never ended
    finally:
        pub.loop_stop()
        pub.disconnect()
        disk.heal()
    assert rc != 0
    assert "Read-only file system" in ing.log.read_text() or "EROFS" in ing.log.read_text()
