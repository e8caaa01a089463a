"""Power cuts, not kills: the gateway's state and the ingest's landing zone on the power-cut
file system (devkit/powercut), cut at random moments while readings flow and the uplink comes
and goes. Acknowledged (to a node) or committed (from a sensor) means: survives, and after
the pipeline appears exactly once."""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest

from devkit.broker import Mosquitto
from devkit.gateway_helpers import GatewayProc, PahoNode
from devkit.ingest_helpers import IngestProc, landed
from devkit.link import LinkProxy
from devkit.node_helpers import wait_until
from devkit.powercut import PowerCutMount, fuse_missing
from pubcomp.gateway import commitlog
from pubcomp.pipeline.audit import delivered
from pubcomp.pipeline.job import Pipeline

pytestmark = pytest.mark.skipif(fuse_missing() is not None, reason=str(fuse_missing()))

CUTS = 10


@pytest.fixture
def disk(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[PowerCutMount]:
    """The strict model, or writeback with the seed a test passes (``indirect``)."""
    seed = getattr(request, "param", None)
    with PowerCutMount(tmp_path / "backing", tmp_path / "disk", writeback=seed) as d:
        yield d


# The writeback model (devkit/powercut rules 4-6): a seeded subset of the unsynced pages
# survives the cut too, some torn, holes reading as zeros; the store's WAL frames carry
# checksums, its -shm is rebuilt, a checkpoint fsyncs the database before the WAL goes.
MODELS = pytest.mark.parametrize(
    "disk", [None, 20261125], indirect=True, ids=["strict", "writeback"]
)


@MODELS
def test_gateway_power_cuts_lose_nothing_acknowledged_or_committed(
    tmp_path: Path, disk: PowerCutMount, mosquitto: Mosquitto, spark: Any
) -> None:
    """In writeback, every other cut comes right after one of the gateway's writes
    reached the page cache, before its fsync (``arm``)."""
    rng = random.Random(20261122)
    link = LinkProxy(mosquitto.port)
    sensors = [
        {"id": "counter", "type": "simulated", "signal": "counter", "interval_s": 0.2},
        {"id": "rain", "type": "pulse", "pin": 17, "interval_s": 0.5, "simulated_rate_hz": 20},
    ]
    commits = tmp_path / "commits.jsonl"
    witness = {"store": {"commit_log": str(commits)}}
    nodes = {"n1": "pw-1", "n2": "pw-2"}
    gw = GatewayProc(tmp_path, link.port, sensors=sensors, nodes=nodes, extra=witness)
    gw.db = disk.path / "state" / "gateway.db"
    gw.write()
    landing, wh = tmp_path / "landing", tmp_path / "wh"
    ingest = IngestProc(mosquitto.port, landing).start()
    gw.start()
    nodes = [PahoNode(n, f"pw-{i}", gw.ingress_port).start() for i, n in ((1, "n1"), (2, "n2"))]
    outages = 0
    for _ in range(CUTS):
        time.sleep(rng.uniform(0.5, 2.0))
        if rng.random() < 0.4:  # the uplink goes down (or comes back) before this cut
            if link.is_down:
                link.up()
            else:
                link.down()
                outages += 1
        assert gw.proc is not None
        if disk.writeback is not None and disk.cuts % 2:
            disk.arm(rng.randint(1, 8))
            assert disk.wait_frozen(10), "the gateway wrote nothing"
        disk.cut(gw.proc)
        gw.start()
    link.up()
    time.sleep(1.0)
    for n in nodes:
        n.stop()

    acked = set().union(*(n.reading_ids() for n in nodes))
    # The sensors go quiet, so the set of committed readings is final and the
    # backlog can reach 0 (a lingering short batch never does while they run).
    assert gw.terminate() == 0
    gw.sensors = []
    gw.write()
    gw.start()
    sensor_committed = commitlog.read(commits)

    def drained() -> bool:
        up = gw.status()["uplink"]
        return up["backlog"] == 0 and up["inflight_messages"] == 0

    assert wait_until(drained, 60), gw.status()["uplink"]
    gw.terminate()
    assert wait_until(lambda: acked <= landed(landing, rolled_only=False).keys(), 30)
    ingest.stop()

    summary = Pipeline(spark, str(landing), str(wh)).run()
    print(f"gateway: {disk.stats()}, {len(acked)} acked, {len(sensor_committed)} committed")
    got = delivered(spark, wh)
    by_id, by_key = got.by_id, got.by_key
    assert outages >= 1 and disk.cuts == CUTS
    assert len(acked) > 500 and len(sensor_committed) > 50
    assert not list((disk.path / "state").glob("*corrupt*")), "the store was moved aside"
    assert {i for i in acked if by_id[i] != 1} == set(), "a node's acknowledged reading"
    missing = {k for k in sensor_committed if by_key[k] != 1}
    assert missing == set(), f"{len(missing)} committed sensor readings not delivered once"
    assert max(by_id.values()) == 1
    assert summary.readings_written == len(by_id)


PUBLISHED = 3000


def publish_all(port: int, gateway: str) -> set[str]:
    """A gateway stand-in (paho, QoS 2): wire-format messages of 10 readings; returns the ids
    of every message the cloud broker completed (PUBCOMP)."""
    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="pub-" + gateway)
    c.max_inflight_messages_set(20)
    c.connect("127.0.0.1", port)
    c.loop_start()
    ids: set[str] = set()
    infos = []
    for m in range(PUBLISHED // 10):
        readings = []
        for i in range(10):
            seq = m * 10 + i + 1
            ts = f"2026-11-22T10:{seq // 60 % 60:02d}:{seq % 60:02d}.000Z"
            rid = f"{gateway}/e1/{seq}"
            readings.append({"id": rid, "origin": gateway, "sensor": "t", "ts": ts,
                             "value": seq, "unit": "C", "flags": []})  # fmt: skip
        payload = json.dumps({"v": 1, "gateway": gateway, "readings": readings})
        infos.append((c.publish(f"telemetry/{gateway}/readings", payload, qos=2), readings))
        time.sleep(0.003)
    for info, readings in infos:
        info.wait_for_publish(60)
        ids |= {r["id"] for r in readings}
    c.loop_stop()
    c.disconnect()
    return ids


def test_ingest_power_cuts_lose_nothing_it_received(
    tmp_path: Path, disk: PowerCutMount, persistent_mosquitto: Mosquitto, spark: Any
) -> None:
    """The landing zone on the power-cut disk, the ingest cut 10 times while a gateway
    publishes: every message the broker took lands (the broker redelivers what the ingest
    had not PUBRECed after its fsync), and lands once: the landing files' receive records
    survive the cuts with the lines they describe, so a redelivered message is recognised
    (MQTT-4.3.3-2). The pipeline then has each reading once."""
    rng = random.Random(7)
    landing, wh = disk.path / "landing", tmp_path / "wh"
    ingest = IngestProc(persistent_mosquitto.port, landing)
    ingest.log = tmp_path / "ingest.log"  # the log is the witness: off the cut disk
    ingest.start()
    result: dict[str, set[str]] = {}
    pub = threading.Thread(
        target=lambda: result.update(ids=publish_all(persistent_mosquitto.port, "gw1"))
    )
    pub.start()
    for _ in range(CUTS):
        time.sleep(rng.uniform(0.3, 1.2))
        assert ingest.proc is not None
        disk.cut(ingest.proc)
        ingest.start()
    pub.join(120)
    ids = result["ids"]
    assert len(ids) == PUBLISHED
    assert wait_until(lambda: ids <= landed(landing, rolled_only=False).keys(), 60)
    ingest.stop()
    counts = landed(landing)
    summary = Pipeline(spark, str(landing), str(wh)).run()
    print(f"ingest: {disk.stats()}, landed {sum(counts.values())} for {len(ids)} readings")
    by_id = delivered(spark, wh).by_id
    assert by_id.keys() == ids and set(by_id.values()) == {1}
    assert summary.duplicates_removed == sum(counts.values()) - len(ids)
    assert sum(counts.values()) == len(ids), "a redelivered message landed twice"


class WindowNode:
    """A node with up to 20 QoS 1 messages in flight (paho), one reading each; it records
    which messages were acknowledged, and in what order on each connection."""

    def __init__(self, node: str, password: str, port: int) -> None:
        self.node = node
        self.sent = 0
        self.acked: list[tuple[int, int]] = []  # (connection number, seq), in arrival order
        self.connection = 0
        self._mids: dict[int, int] = {}
        self._early: dict[int, int] = {}  # acknowledged before publish() returned its mid
        self._lock = threading.Lock()
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=node)
        self.client.max_inflight_messages_set(20)
        self.client.username_pw_set(node, password)
        self.client.reconnect_delay_set(0.05, 0.5)
        self.client.on_connect = self._on_connect
        self.client.on_publish = self._on_publish
        self.port = port
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _on_connect(self, *_: Any) -> None:
        with self._lock:
            self.connection += 1

    def _on_publish(self, _c: Any, _u: Any, mid: int, *_: Any) -> None:
        with self._lock:
            if mid in self._mids:
                self.acked.append((self.connection, self._mids.pop(mid)))
            else:
                self._early[mid] = self.connection

    def start(self) -> WindowNode:
        self.client.connect_async("127.0.0.1", self.port, keepalive=5)
        self.client.loop_start()
        self._thread.start()
        return self

    def in_flight(self) -> int:
        with self._lock:
            return self.sent - len(self.acked)

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self.client.is_connected() or self.in_flight() >= 20:
                time.sleep(0.002)
                continue
            seq = self.sent
            ts = time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime())
            body = {"v": 1, "node": self.node, "boot": 1, "seq": seq, "ts": ts,
                    "readings": [{"sensor": "t", "value": seq, "unit": "C"}]}  # fmt: skip
            # Not under our lock: paho calls on_publish holding a lock of its own.
            info = self.client.publish(f"nodes/{self.node}/readings", json.dumps(body), qos=1)
            with self._lock:
                self.sent += 1
                if info.mid in self._early:
                    self.acked.append((self._early.pop(info.mid), seq))
                else:
                    self._mids[info.mid] = seq

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def acked_ids(self) -> set[str]:
        with self._lock:
            return {f"{self.node}/1/{seq}.0" for _, seq in self.acked}


@pytest.mark.parametrize("writeback", [None, 20261126], ids=["strict", "writeback"])
def test_power_cut_while_acknowledgements_are_held_for_a_group(
    tmp_path: Path, mosquitto: Mosquitto, writeback: int | None
) -> None:
    """PUBACKs held back for a group commit (commit_delay 100 ms, 20 ms fsyncs) while a node
    keeps 20 messages in flight; the power goes with acknowledgements held. Every message
    acknowledged reaches the cloud exactly once (counted by paho before any dedup), nothing
    arrives that the node did not send, and on every connection the PUBACKs came in the
    order of the PUBLISHes (MQTT-4.6.0-2, MQTT-4.6.0-3)."""
    from devkit.checker import Checker

    rng = random.Random(20261123)
    checker = Checker(mosquitto.port, topic="telemetry/#", client_id="held-checker").start()
    gw = GatewayProc(
        tmp_path,
        mosquitto.port,
        nodes={"n1": "pw-1"},
        extra={"store": {"commit_delay_ms": 100}, "ingress": {"max_messages_per_second": 1e5}},
    )
    held_at_cut: list[int] = []
    with PowerCutMount(
        tmp_path / "backing", tmp_path / "disk", fsync_delay=0.02, writeback=writeback
    ) as disk:
        gw.db = disk.path / "state" / "gateway.db"
        gw.write()
        gw.start()
        node = WindowNode("n1", "pw-1", gw.ingress_port).start()
        try:
            for _ in range(5):
                acked = len(node.acked)
                assert wait_until(lambda a=acked: len(node.acked) >= a + rng.randint(5, 200), 30)
                assert wait_until(lambda: node.in_flight() >= 5, 10)
                held_at_cut.append(node.in_flight())
                assert gw.proc is not None
                disk.cut(gw.proc)
                gw.start()
            after_cuts = len(node.acked)
            assert wait_until(lambda: len(node.acked) >= after_cuts + 100, 30)
        finally:
            node.stop()
        assert wait_until(lambda: node.in_flight() == 0, 30), "paho resends what it holds"
        acked = node.acked_ids()
        counts = checker.wait_for(acked, timeout=60)
        assert gw.terminate() == 0
    checker.stop()
    assert disk.cuts == 5 and min(held_at_cut) >= 5, held_at_cut
    assert len(acked) > 200
    missing = acked - counts.keys()
    assert not missing, f"{len(missing)} acknowledged readings never arrived: {sorted(missing)[:5]}"
    assert max(counts.values()) == 1, "a duplicate at the cloud, before any dedup"
    sent = {f"n1/1/{seq}.0" for seq in range(node.sent)}
    assert counts.keys() <= sent, "the cloud has a reading the node never sent"
    by_connection: dict[int, list[int]] = {}
    for conn, seq in node.acked:
        by_connection.setdefault(conn, []).append(seq)
    for conn, seqs in by_connection.items():
        assert seqs == sorted(seqs), f"PUBACKs out of order on connection {conn}"
