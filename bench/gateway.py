"""Gateway benchmark: durable intake from 20 nodes, acknowledgement latency, peak RSS.

System A is ``pubcomp gateway run`` (a PUBACK only after the readings are fsynced).
The peer, measured in the same run with the same load, is Mosquitto's bridge with
``persistence true``, ``autosave_on_changes true`` and ``autosave_interval 1``: the
nearest thing to durable a stock broker offers (it still acknowledges from RAM and
saves its whole database after each change).

- intake: N node clients (paho-mqtt, one thread each) publish QoS 1 messages of R
  readings, one at a time, each waiting for its PUBACK (as the firmware does);
  readings/s acknowledged, PUBACK latency p50/p99, bytes the system wrote per
  reading (/proc/PID/io). A cloud Mosquitto receives what both forward; a cloud
  ``pubcomp ingest run`` lands what pubcomp delivers and acknowledges it, so the
  gateway runs end to end (issue 24) as in the field.
- in-process drivers: readings/s the intake commits from 10 producer tasks.
- peak RSS of the gateway with 10 sensors, 20 connected nodes and a backlog of
  1,000,000 readings drained to the cloud, against the edge Mosquitto holding the
  same backlog (as 100-reading messages) for a disconnected bridge.

Targets (issue 4): >= 20,000 readings/s; peak RSS <= 80 MB.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # devkit/ runs from the checkout

import paho.mqtt.client as mqtt  # noqa: E402
import yaml  # noqa: E402

from devkit.broker import Mosquitto, free_port  # noqa: E402
from devkit.ingest_helpers import IngestProc  # noqa: E402
from devkit.store_helpers import append  # noqa: E402
from pubcomp.gateway.credentials import hash_password  # noqa: E402
from pubcomp.gateway.intake import Intake  # noqa: E402
from pubcomp.gateway.status import fetch as fetch_status  # noqa: E402
from pubcomp.sync.store import Reading, Store  # noqa: E402
from pubcomp.sync.wire import wire_time  # noqa: E402

PASSWORD = "bench-pw"


def payload(node: str, seq: int, per_msg: int) -> bytes:
    ts = wire_time()
    rd = [{"sensor": f"s{i % 8}", "value": seq + i / 1000, "unit": "C"} for i in range(per_msg)]
    return json.dumps(
        {"v": 1, "node": node, "boot": 1, "seq": seq, "ts": ts, "readings": rd},
        separators=(",", ":"),
    ).encode()


class Node(threading.Thread):
    """One node: publish, wait for the PUBACK, publish the next."""

    def __init__(self, name: str, port: int, per_msg: int, until: float, auth: bool) -> None:
        super().__init__(daemon=True)
        self.name_, self.per_msg, self.until = name, per_msg, until
        self.latencies: list[float] = []
        self.c = mqtt.Client(
            mqtt.CallbackAPIVersion.VERSION2, client_id=name, protocol=mqtt.MQTTv311
        )
        if auth:
            self.c.username_pw_set(name, PASSWORD)
        self._acked = threading.Event()
        self.c.on_publish = lambda *a: self._acked.set()
        self.c.connect("127.0.0.1", port, keepalive=30)
        self.c.loop_start()

    def run(self) -> None:
        seq = 0
        while time.monotonic() < self.until:
            body = payload(self.name_, seq, self.per_msg)
            self._acked.clear()
            t0 = time.perf_counter()
            self.c.publish(f"nodes/{self.name_}/readings", body, qos=1)
            if not self._acked.wait(10):
                break
            self.latencies.append(time.perf_counter() - t0)
            seq += 1
        self.c.loop_stop()
        self.c.disconnect()


def load(port: int, nodes: int, per_msg: int, seconds: float, auth: bool) -> dict[str, float]:
    until = time.monotonic() + seconds
    threads = [Node(f"node-{i:02d}", port, per_msg, until, auth) for i in range(nodes)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - t0
    lat = sorted(x for t in threads for x in t.latencies)
    msgs = len(lat)
    return {
        "readings_per_s": msgs * per_msg / elapsed,
        "messages": msgs,
        "readings": msgs * per_msg,
        "p50_ms": statistics.median(lat) * 1000,
        "p99_ms": lat[int(len(lat) * 0.99) - 1] * 1000,
    }


def write_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        if line.startswith("write_bytes:"):
            return int(line.split()[1])
    return 0


def vm_hwm_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


class GatewayRun:
    def __init__(self, tmp: Path, cloud: Mosquitto, nodes: int, sensors: int) -> None:
        self.tmp = tmp
        tmp.mkdir(parents=True, exist_ok=True)
        self.db = tmp / "gw.db"
        self.ingress, self.health = free_port(), free_port()
        h = hash_password(PASSWORD)
        gw = {
            "uplink": {"broker": cloud.url, "client_id": "gw-bench"},
            "store": {"path": str(self.db)},
            "ingress": {
                "host": "127.0.0.1",
                "port": self.ingress,
                # The default (50 msg/s per node) is a field setting; lifted to measure.
                "max_messages_per_second": 100000,
            },
            "health": {"port": self.health},
            "gpio": "simulated",
            "sensors": [
                {"id": f"sim{i}", "type": "simulated", "interval_s": 1.0} for i in range(sensors)
            ],
            "nodes": [{"id": f"node-{i:02d}", "password_hash": h} for i in range(nodes)],
        }
        self.fleet = tmp / "fleet.yaml"
        self.fleet.write_text(yaml.safe_dump({"fleet": "bench", "gateways": {"gw-bench": gw}}))
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> GatewayRun:
        cmd = [sys.executable, "-m", "pubcomp", "gateway", "run", "--config", str(self.fleet)]
        self.proc = subprocess.Popen(
            [*cmd, "--gateway", "gw-bench", "--log-level", "WARNING"],
            stderr=open(self.tmp / "gw.log", "ab"),  # noqa: SIM115
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.health}/healthz", timeout=1):
                    return self
            except OSError:
                time.sleep(0.1)
        raise RuntimeError((self.tmp / "gw.log").read_text())

    def status(self) -> dict[str, object]:
        return fetch_status("127.0.0.1", self.health, timeout=10)

    def stop(self) -> None:
        assert self.proc is not None
        self.proc.terminate()
        self.proc.wait(60)


def bridge(tmp: Path, cloud_port: int, autosave_on_changes: bool) -> Mosquitto:
    extra = (
        "connection cloud\n"
        f"address 127.0.0.1:{cloud_port}\n"
        "topic nodes/# out 1\n"
        "cleansession false\n"
        "bridge_protocol_version mqttv311\n"
    )
    if autosave_on_changes:
        extra = "autosave_on_changes true\nautosave_interval 1\n" + extra
    return Mosquitto(tmp, persistence=True, extra_config=extra).start()


def intake_in_process(tmp: Path, readings: int) -> float:
    """Readings/s the intake commits from 10 producer tasks (as drivers call ``add``)."""

    async def main(store: Store) -> float:
        intake = Intake(store)
        task = asyncio.create_task(intake.run())
        t0 = time.perf_counter()

        async def producer(k: int) -> None:
            for i in range(readings // 10):
                intake.add(Reading(f"sim{k}", float(i), "2026-11-21T00:00:00.000Z", "C"))
                if i % 100 == 99:
                    await asyncio.sleep(0)  # a driver yields between readings

        await asyncio.gather(*(producer(k) for k in range(10)))
        intake.close()
        await task
        return readings / (time.perf_counter() - t0)

    with Store(tmp / "inproc.db", gateway_id="gw") as store:
        return asyncio.run(main(store))


def fill(db: Path, n: int) -> None:
    with Store(db, gateway_id="gw-bench") as store:
        chunk = 100_000
        for start in range(0, n, chunk):
            append(
                store,
                (
                    Reading(f"s{i % 10}", float(i), "2026-11-21T00:00:00.000Z", "C")
                    for i in range(start, min(n, start + chunk))
                ),
            )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", type=int, default=20)
    ap.add_argument("--per-msg", type=int, default=100, help="readings per node message")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--inproc-readings", type=int, default=200_000)
    ap.add_argument("--rss-backlog", type=int, default=1_000_000)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        cloud = Mosquitto(tmp / "cloud").start()
        ingest = IngestProc(cloud.port, tmp / "landing", "bench-ingest").start()
        try:
            gw = GatewayRun(tmp / "a", cloud, args.nodes, sensors=0).start()
            assert gw.proc is not None
            w0 = write_bytes(gw.proc.pid)
            a = load(gw.ingress, args.nodes, args.per_msg, args.seconds, auth=True)
            a["bytes_per_reading"] = (write_bytes(gw.proc.pid) - w0) / a["readings"]
            gw.stop()
            peer = bridge(tmp / "b", cloud.port, autosave_on_changes=True)
            assert peer.proc is not None
            w0 = write_bytes(peer.proc.pid)
            b = load(peer.port, args.nodes, args.per_msg, args.seconds, auth=False)
            b["bytes_per_reading"] = (write_bytes(peer.proc.pid) - w0) / b["readings"]
            peer.stop()
            inproc = intake_in_process(tmp, args.inproc_readings)

            # Peak RSS: 10 sensors, the nodes connected and publishing, a large backlog.
            rss_gw = GatewayRun(tmp / "r", cloud, args.nodes, sensors=10)
            t0 = time.monotonic()
            fill(rss_gw.db, args.rss_backlog)
            fill_s = time.monotonic() - t0
            rss_gw.start()
            assert rss_gw.proc is not None
            nodes_load = threading.Thread(
                target=load, args=(rss_gw.ingress, args.nodes, 10, 5.0, True), daemon=True
            )
            nodes_load.start()
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline:
                up = rss_gw.status()["uplink"]
                if up["backlog"] < 1000:  # type: ignore[index]
                    break
                time.sleep(0.5)
            nodes_load.join()
            rss_a = vm_hwm_mb(rss_gw.proc.pid)
            rss_gw.stop()
            # The peer holding the same backlog: a bridge whose cloud is down.
            dead = free_port()
            held = Mosquitto(
                tmp / "held",
                persistence=True,
                extra_config=(
                    f"connection cloud\naddress 127.0.0.1:{dead}\ntopic nodes/# out 1\n"
                    "cleansession false\n"
                ),
            ).start()
            assert held.proc is not None
            msgs = args.rss_backlog // 100
            c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="filler")
            c.connect("127.0.0.1", held.port)
            c.loop_start()
            infos = [
                c.publish("nodes/node-00/readings", payload("node-00", i, 100), qos=1)
                for i in range(msgs)
            ]
            for info in infos:
                info.wait_for_publish(60)
            c.loop_stop()
            c.disconnect()
            rss_b = vm_hwm_mb(held.proc.pid)
            held.kill()
        finally:
            ingest.stop()
            cloud.kill()

    print(f"gateway intake, {args.nodes} nodes x {args.per_msg} readings/message, QoS 1, "
          f"one message in flight per node, {args.seconds:.0f} s each")  # fmt: skip
    print(f"{'':34}{'pubcomp':>14}{'mosquitto bridge':>20}{'ratio':>8}")
    rows = [
        ("readings/s acknowledged", "readings_per_s", "{:,.0f}"),
        ("PUBACK latency p50 (ms)", "p50_ms", "{:.1f}"),
        ("PUBACK latency p99 (ms)", "p99_ms", "{:.1f}"),
        ("bytes written per reading", "bytes_per_reading", "{:,.0f}"),
    ]
    for label, key, fmt in rows:
        ratio = a[key] / b[key] if b[key] else float("inf")
        print(f"  {label:32}{fmt.format(a[key]):>14}{fmt.format(b[key]):>20}{ratio:>8.2f}")
    print("  (the bridge: persistence true, autosave_on_changes true, autosave_interval 1;")
    print("   it acknowledges before saving, so its PUBACK promises nothing about the disk)")
    print(f"in-process drivers -> intake: {inproc:,.0f} readings/s committed (10 producers)")
    print(
        f"peak RSS, gateway with 10 sensors, {args.nodes} nodes, {args.rss_backlog:,}-reading "
        f"backlog drained (filled in {fill_s:.0f} s): {rss_a:.1f} MB; "
        f"mosquitto holding the same backlog: {rss_b:.1f} MB; ratio {rss_a / rss_b:.2f}"
    )
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
