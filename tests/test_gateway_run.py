"""End to end with real processes: ``pubcomp gateway run``, a paho node, a real Mosquitto
as the cloud, and an independent paho checker counting every reading id."""

from __future__ import annotations

import json
import random
import re
import sqlite3
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from devkit.broker import Mosquitto
from devkit.checker import Checker
from devkit.gateway_helpers import GatewayProc, PahoNode
from devkit.node_helpers import wait_until

SENSORS = [
    {"id": "temp", "type": "simulated", "signal": "sine", "unit": "C", "interval_s": 0.1},
    {"id": "rain", "type": "pulse", "pin": 17, "interval_s": 0.5, "simulated_rate_hz": 20},
]


def _split(counts: dict[str, int], gid: str, epoch: str) -> tuple[set[int], set[str]]:
    """Sensor reading seqs of this gateway's epoch, and every other id."""
    own = re.compile(rf"^{re.escape(gid)}/{re.escape(epoch)}/(\d+)$")
    seqs = {int(m.group(1)) for k in counts if (m := own.match(k))}
    return seqs, {k for k in counts if not own.match(k)}


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def test_gateway_exactly_once_across_sigkills(tmp_path: Path, mosquitto: Mosquitto) -> None:
    checker = Checker(mosquitto.port, topic="telemetry/#", client_id="e2e-checker").start()
    # The witness of committed sensor readings, written after each commit returns.
    witness = {"store": {"commit_log": str(tmp_path / "commits.jsonl")}}
    gw = GatewayProc(
        tmp_path, mosquitto.port, sensors=SENSORS, nodes={"node-1": "pw-1"}, extra=witness
    )
    gw.start()
    node = PahoNode("node-1", "pw-1", gw.ingress_port).start()
    rng = random.Random(7)
    kills = 0
    commits = tmp_path / "commits.jsonl"

    def running_for(acks: int) -> None:
        # Each kill falls after the node has had some more PUBACKs (a random number, so
        # the kills land at different points of a commit) and the sensors have committed
        # more: waiting for what the test needs, however busy the machine is.
        want, lines = len(node.acked) + acks, _lines(commits) + 15
        deadline = time.monotonic() + 60
        while len(node.acked) < want or _lines(commits) < lines:
            assert time.monotonic() < deadline, (len(node.acked), want, _lines(commits), lines)
            time.sleep(0.05)

    try:
        for _ in range(3):
            running_for(rng.randint(30, 45))
            gw.kill()  # SIGKILL: no flush, no DISCONNECT; the store's fsyncs are all there is
            kills += 1
            gw.start()
        running_for(30)
    finally:
        node.stop()  # returns once every message it sent has its PUBACK
    assert gw.terminate() == 0
    epoch, last_seq = gw.store_facts()
    committed = {
        (r["sensor"], r["ts"], r["value"])
        for r in map(json.loads, (tmp_path / "commits.jsonl").read_text().splitlines())
    }
    # Drain what is left with the sensors removed, so the set of readings is final.
    gw.sensors = []
    gw.write()
    gw.start()
    node_ids = node.reading_ids()

    def sensor_readings() -> set[tuple[str, str, float]]:
        with checker._lock:
            return {v for k, v in checker.readings.items() if k.startswith(f"{gw.gid}/")}

    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            _, others = _split(checker.snapshot(), gw.gid, epoch)
            if node_ids <= others and committed <= sensor_readings():
                break
            time.sleep(0.2)
        time.sleep(0.5)  # let any stray duplicate arrive
        counts = checker.snapshot()
    finally:
        assert gw.terminate() == 0
        checker.stop()
    seqs, others = _split(counts, gw.gid, epoch)
    assert kills == 3 and len(node.acked) > 100 and len(seqs) > 50
    dups = {k: n for k, n in counts.items() if n > 1}
    assert not dups, f"duplicated at the checker: {sorted(dups.items())[:5]}"
    # Every message the node got a PUBACK for is delivered, and nothing the node did not send.
    assert others == node_ids, (len(node_ids - others), sorted(others - node_ids)[:5])
    # Every sensor reading a commit reported (the witness) was delivered, under a seq the
    # store never gives twice (seqs may skip after a restart, never repeat).
    missing = committed - sensor_readings()
    assert not missing, f"{len(missing)} committed sensor readings never arrived"
    assert max(seqs) <= last_seq
    assert node.interrupted >= 1, "the kills should have cut at least one publish short"


def test_health_metrics_and_status(tmp_path: Path, mosquitto: Mosquitto) -> None:
    gw = GatewayProc(tmp_path, mosquitto.port, sensors=SENSORS, nodes={"node-1": "pw-1"})
    gw.start()
    node = PahoNode("node-1", "pw-1", gw.ingress_port).start()
    bad = PahoNode("node-1", "wrong", gw.ingress_port).start()  # refused: counted
    try:
        refused = (("node", "node-1"), ("reason", "bad_credentials"))
        wanted = {
            ("pubcomp_sensor_readings_total", (("sensor", "temp"),)): 10,
            ("pubcomp_node_messages_total", (("node", "node-1"),)): 10,
            ("pubcomp_node_rejected_total", refused): 1,
            ("pubcomp_intake_committed_readings_total", ()): 30,
        }
        value: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}

        def counted() -> bool:
            value.clear()
            try:
                value.update(_metrics(gw))
            except OSError:  # the health endpoint not listening yet
                return False
            return value.get(("pubcomp_uplink_connected", ())) == 1.0 and all(
                value.get(k, 0) >= n for k, n in wanted.items()
            )

        # Waits for the counts (a loaded machine starts the gateway slowly), then asserts them.
        wait_until(counted, 60)
        assert value[("pubcomp_uplink_connected", ())] == 1.0
        for key, least in wanted.items():
            assert value[key] >= least, (key, value.get(key))
        with urllib.request.urlopen(gw.url("/"), timeout=5) as r:
            page = r.read().decode()
        assert "<svg" in page and "<polyline" in page and "node-1" in page
        out = _status(gw)
        assert out.returncode == 0, out.stderr
        lines = out.stdout.splitlines()
        assert any(
            re.match(r"uplink\s+connected since [\d:]{8}, to mqtt://127\.0\.0\.1:\d+ \(QoS 2\)", x)
            for x in lines
        )
        assert any(re.match(r"backlog\s+\d+ readings", x) for x in lines)
        assert any(
            re.match(r"temp\s+running\s+temp=-?\d+(\.\d+)? C\s+\d+\s+0\s+0$", x) for x in lines
        ), out.stdout
        assert any(re.match(r"node-1\s+yes\s+\d+ s ago\s+\d+\s+[1-9]", x) for x in lines), (
            out.stdout
        )
    finally:
        node.stop()
        bad.client.loop_stop()
        assert gw.terminate() == 0
    # Stopped: status says so and exits 3.
    out = _status(gw)
    assert out.returncode == 3 and "is it running?" in out.stderr


def _metrics(gw: GatewayProc) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(gw.url("/metrics"), timeout=5) as r:
        text = r.read().decode()
    # Parsed by prometheus-client's own parser, not by us.
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }


def _status(gw: GatewayProc) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "pubcomp", "status", "--config", str(gw.fleet)]
    return subprocess.run([*cmd, "--gateway", gw.gid], capture_output=True, text=True, timeout=30)


def test_a_graceful_stop_delivers_what_lingers(tmp_path: Path, mosquitto: Mosquitto) -> None:
    """With a long linger, short batches wait in the store; SIGTERM stops the sensor, then
    the uplink sends what waits before its DISCONNECT (uplink.drain_on_stop_s)."""
    checker = Checker(mosquitto.port, topic="telemetry/#", client_id="drain-checker").start()
    sensors = [{"id": "c", "type": "simulated", "signal": "counter", "interval_s": 0.1}]
    gw = GatewayProc(
        tmp_path,
        mosquitto.port,
        sensors=sensors,
        extra={"uplink": {"linger_ms": 60_000, "drain_on_stop_s": 20}},
    )
    gw.start()
    try:
        assert wait_until(lambda: gw.status()["uplink"]["backlog"] >= 20, 30)
        assert checker.snapshot() == {}  # lingering: a batch of 100 is far from full
    finally:
        assert gw.terminate() == 0
    db = sqlite3.connect(gw.db)
    left = db.execute("SELECT COALESCE(SUM(n), 0) FROM outbox").fetchone()[0]
    # End to end, delivered readings stay until the cloud says they are landed (no ingest
    # here): they are not left undelivered.
    awaiting = db.execute("SELECT COALESCE(SUM(readings), 0) FROM awaiting_landing").fetchone()[0]
    delivered = db.execute("SELECT value FROM counters WHERE name = 'delivered'").fetchone()[0]
    db.close()
    assert left == awaiting, f"{left - awaiting} readings not delivered after a graceful stop"
    assert delivered >= 20
    assert wait_until(lambda: len(checker.snapshot()) >= delivered, 30)
    counts = checker.snapshot()
    checker.stop()
    assert len(counts) == delivered and set(counts.values()) == {1}
