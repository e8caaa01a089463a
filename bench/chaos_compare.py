"""The same load and the same power cuts for pubcomp's gateway and for Mosquitto's bridge.

One harness, three systems under test, each between the same node publishers
and the same cloud Mosquitto, with its state directory on the power-cut file
system (devkit/powercut: only fsynced data survives a cut):

- pubcomp: ``pubcomp gateway run`` (node ingress, SQLite session store, QoS 2 uplink);
  its cloud side also runs ``pubcomp ingest run`` and the Spark pipeline, so its
  row is counted after deduplication too;
- bridge (defaults): Mosquitto 2 as the edge broker, bridging ``nodes/#`` to the
  cloud, ``persistence true`` and the default ``autosave_interval 1800``;
- bridge (autosave): the same with ``autosave_on_changes true`` and
  ``autosave_interval 1`` (save after every change).

Load: ``--publishers`` node publishers (paho-mqtt, QoS 1, each message retried
with the same sequence number until its PUBACK), ``--messages`` in all at up to
``--rate`` a second. Trouble: ``--cuts`` power cuts; before each, the uplink
goes down for ``--stall`` seconds so a store-and-forward queue holds data when
the power goes; it comes back once the system is up again. A checker with a
persistent session at the cloud counts every sequence number it receives.

Printed: acknowledged (PUBACKed to a publisher), delivered (distinct at the
cloud), lost (acknowledged, never delivered), duplicates (extra copies at the
cloud; for pubcomp also after the pipeline), readings/s acknowledged, bytes
applications wrote to the disk per acknowledged reading.

    python bench/chaos_compare.py [--messages 10000 --rate 500 --cuts 7 --runs 1]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import getpass
import json
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import paho.mqtt.client as mqtt  # noqa: E402

from devkit.broker import Mosquitto, free_port, mosquitto_binary  # noqa: E402
from devkit.gateway_helpers import GatewayProc, PahoNode  # noqa: E402
from devkit.ingest_helpers import IngestProc  # noqa: E402
from devkit.link import LinkProxy  # noqa: E402
from devkit.powercut import PowerCutMount, fuse_missing  # noqa: E402

PASSWORD = "chaos-pw"


@dataclass
class Row:
    system: str
    acknowledged: int = 0
    delivered: int = 0
    lost: int = 0
    duplicates: int = 0
    after_pipeline: str = "-"
    per_s: float = 0.0
    bytes_per_reading: float = 0.0
    notes: list[str] = field(default_factory=list)


class CloudCounter:
    """paho, persistent session, QoS 2: every sequence number the cloud delivers."""

    def __init__(self, port: int) -> None:
        self.counts: collections.Counter[str] = collections.Counter()
        self.last_change = time.monotonic()
        self._lock = threading.Lock()
        self.client = mqtt.Client(
            mqtt.CallbackAPIVersion.VERSION2, client_id="chaos-checker", clean_session=False,
            protocol=mqtt.MQTTv311,
        )  # fmt: skip
        self.client.on_connect = lambda c, *a: c.subscribe([("telemetry/#", 2), ("nodes/#", 2)])
        self.client.on_message = self._on_message
        self.client.connect("127.0.0.1", port)
        self.client.loop_start()

    def _on_message(self, client: Any, userdata: Any, msg: Any) -> None:
        if msg.topic.endswith("/status") or "/landed/" in msg.topic:
            return  # a gateway's health, the ingest's acknowledgements: no readings
        doc = json.loads(msg.payload)
        if "node" in doc:  # a node's own message, forwarded as is (the bridge)
            keys = [f"{doc['node']}/{doc['seq']}"]
        else:  # pubcomp's uplink: reading ids node/boot/seq.index
            keys = [r["id"].rsplit(".", 1)[0].replace("/1/", "/", 1) for r in doc["readings"]]
        with self._lock:
            self.counts.update(keys)
            self.last_change = time.monotonic()

    def settle(self, drained: Any, quiet_s: float = 15.0, timeout: float = 180.0) -> None:
        """Until the system says its queue is empty and nothing arrived for ``quiet_s`` since
        the trouble ended (a bridge may take its time to reconnect: it is given it)."""
        start = time.monotonic()
        deadline = start + timeout
        while time.monotonic() < deadline:
            if drained() and time.monotonic() - max(self.last_change, start) > quiet_s:
                return
            time.sleep(0.2)

    def stop(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()


class Publisher(threading.Thread):
    """One node: QoS 1, one message in flight, the same seq again until its PUBACK."""

    def __init__(self, node: str, port: int, count: int, interval: float) -> None:
        super().__init__(daemon=True)
        self.node, self.count, self.interval = node, count, interval
        self.acked: list[int] = []
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=node)
        self.client.username_pw_set(node, PASSWORD)
        self.client.reconnect_delay_set(0.05, 0.5)
        self.client.connect_async("127.0.0.1", port, keepalive=5)
        self.client.loop_start()

    def payload(self, seq: int) -> bytes:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime())
        msg = {"v": 1, "node": self.node, "boot": 1, "seq": seq, "ts": ts,
               "readings": [{"sensor": "s", "value": seq, "unit": "u"}]}  # fmt: skip
        return json.dumps(msg).encode()

    def run(self) -> None:
        next_at = time.monotonic()
        for seq in range(self.count):
            next_at = max(next_at + self.interval, time.monotonic() - 1)
            time.sleep(max(0.0, next_at - time.monotonic()))
            payload = self.payload(seq)
            while True:
                if self.client.is_connected():
                    info = self.client.publish(f"nodes/{self.node}/readings", payload, qos=1)
                    if PahoNode._acked(info):
                        break
                else:
                    time.sleep(0.02)
            self.acked.append(seq)

    def stop(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()


# ---------------------------------------------------------------- the systems


class PubcompSystem:
    name = "pubcomp gateway"

    def __init__(self, work: Path, disk: PowerCutMount, uplink_port: int, nodes: list[str]):
        self.gw = GatewayProc(work, uplink_port, nodes={n: PASSWORD for n in nodes},
                              extra={"ingress": {"max_messages_per_second": 1000}})  # fmt: skip
        self.gw.db = disk.path / "state" / "gateway.db"
        self.gw.write()
        self.port = self.gw.ingress_port

    def start(self) -> None:
        self.gw.start()

    def drained(self) -> bool:
        up = self.gw.status()["uplink"]
        return bool(up["backlog"] == 0 and up["inflight_messages"] == 0)

    @property
    def proc(self) -> subprocess.Popen[str]:
        assert self.gw.proc is not None
        return self.gw.proc

    def stop(self) -> None:
        if self.gw.proc is not None and self.gw.proc.poll() is None:
            self.gw.terminate()


class BridgeSystem:
    def __init__(self, work: Path, disk: PowerCutMount, uplink_port: int, autosave: bool):
        self.name = "mosquitto bridge, " + ("autosave on changes" if autosave else "defaults")
        self.port = free_port()
        self.conf = work / "edge.conf"
        save = ["autosave_on_changes true", "autosave_interval 1"] if autosave else []
        lines = [
            f"listener {self.port} 127.0.0.1", "allow_anonymous true", f"user {getpass.getuser()}",
            "max_queued_messages 0", "max_queued_bytes 0",
            "persistence true", f"persistence_location {disk.path}/", *save,
            f"log_dest file {work / 'edge.log'}",
            "connection cloud", f"address 127.0.0.1:{uplink_port}", "topic nodes/# out 1",
            "cleansession false", "remote_clientid edge-bridge", "restart_timeout 1",
        ]  # fmt: skip
        self.conf.write_text("\n".join(lines) + "\n")
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        quiet = subprocess.DEVNULL
        cmd = [mosquitto_binary(), "-c", str(self.conf)]
        self._proc = subprocess.Popen(cmd, stdout=quiet, stderr=quiet)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            time.sleep(0.02)
        raise RuntimeError("the edge Mosquitto did not start")

    def drained(self) -> bool:
        return True  # the bridge does not say: the checker waits until the cloud is quiet

    @property
    def proc(self) -> subprocess.Popen[bytes]:
        assert self._proc is not None
        return self._proc

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            self._proc.wait(30)


# ---------------------------------------------------------------- one run


def run_system(kind: str, args: argparse.Namespace, spark: Any) -> Row:
    work = Path(tempfile.mkdtemp(prefix=f"chaos-{kind}-"))
    cloud = Mosquitto(work / "cloud").start()
    link = LinkProxy(cloud.port)
    counter = CloudCounter(cloud.port)
    nodes = [f"n{i}" for i in range(args.publishers)]
    with PowerCutMount(work / "backing", work / "disk", journal=True) as disk:
        system: PubcompSystem | BridgeSystem
        if kind == "pubcomp":
            system = PubcompSystem(work, disk, link.port, nodes)
            ingest = IngestProc(cloud.port, work / "landing").start()
        else:
            system = BridgeSystem(work, disk, link.port, autosave=kind == "autosave")
        row = Row(system.name)
        system.start()
        per = args.messages // args.publishers
        pubs = [Publisher(n, system.port, per, args.publishers / args.rate) for n in nodes]
        t0 = time.monotonic()
        for p in pubs:
            p.start()
        planned = args.messages / args.rate
        for i in range(args.cuts):
            time.sleep(max(0.0, t0 + planned * (i + 1) / (args.cuts + 1) - time.monotonic()))
            link.down()  # the uplink stalls: the edge queues
            time.sleep(args.stall)
            disk.cut(system.proc)
            system.start()
            link.up()
        for p in pubs:
            p.join()
        elapsed = time.monotonic() - t0
        counter.settle(system.drained)
        fs = disk.stats()
        system.stop()
        for p in pubs:
            p.stop()
    acked = {f"{p.node}/{s}" for p in pubs for s in p.acked}
    row.acknowledged = len(acked)
    row.delivered = len(acked & counter.counts.keys())
    row.lost = len(acked - counter.counts.keys())
    row.duplicates = sum(counter.counts.values()) - len(counter.counts)
    row.per_s = len(acked) / elapsed
    row.bytes_per_reading = fs["bytes_written"] / max(len(acked), 1)
    if kind == "pubcomp":
        row.after_pipeline = pipeline_duplicates(spark, work, ingest, acked, row)
    counter.stop()
    link.close()
    cloud.stop()
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return row


def pipeline_duplicates(
    spark: Any, work: Path, ingest: IngestProc, acked: set[str], row: Row
) -> str:
    from pubcomp.pipeline.audit import delivered
    from pubcomp.pipeline.job import Pipeline

    ingest.stop()
    Pipeline(spark, str(work / "landing"), str(work / "wh")).run()
    by_id = delivered(spark, work / "wh").by_id
    keys = collections.Counter(i.rsplit(".", 1)[0].replace("/1/", "/", 1) for i in by_id.elements())
    lost = len(acked - keys.keys())
    row.notes.append(f"after the pipeline: {lost} lost")
    return f"{sum(keys.values()) - len(keys)} dup, {lost} lost"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--messages", type=int, default=10_000)
    ap.add_argument("--rate", type=float, default=500.0, help="messages/s offered, all publishers")
    ap.add_argument("--publishers", type=int, default=4)
    ap.add_argument("--cuts", type=int, default=7)
    ap.add_argument("--stall", type=float, default=2.0, help="uplink down before each cut, s")
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--keep", action="store_true", help="keep each run's directory (logs)")
    ap.add_argument("--systems", default="pubcomp,defaults,autosave")
    args = ap.parse_args()
    if (why := fuse_missing()) is not None:
        sys.exit(f"chaos_compare needs the power-cut file system: {why}")
    from pubcomp.pipeline.job import spark_session

    spark = spark_session(app="chaos-compare")
    rows = []
    for run in range(1, args.runs + 1):
        for kind in args.systems.split(","):
            print(f"run {run}: {kind} ...", file=sys.stderr, flush=True)
            rows.append(run_system(kind, args, spark))
    spark.stop()
    print(f"\n{args.messages:,} messages offered at {args.rate:.0f}/s by {args.publishers} "
          f"QoS 1 publishers; {args.cuts} power cuts, the uplink down {args.stall:.0f} s "
          f"before each; Mosquitto {mosquitto_version()}\n")  # fmt: skip
    head = ("system", "acknowledged", "delivered", "lost", "duplicates", "after pipeline",
            "readings/s", "bytes/reading")  # fmt: skip
    print(f"{head[0]:<38} {head[1]:>12} {head[2]:>10} {head[3]:>7} {head[4]:>10} "
          f"{head[5]:>16} {head[6]:>10} {head[7]:>13}")  # fmt: skip
    for r in rows:
        print(f"{r.system:<38} {r.acknowledged:>12,} {r.delivered:>10,} {r.lost:>7,} "
              f"{r.duplicates:>10,} {r.after_pipeline:>16} {r.per_s:>10.0f} "
              f"{r.bytes_per_reading:>13,.0f}")  # fmt: skip
    ours = [r for r in rows if r.system.startswith("pubcomp")]
    peers = [r for r in rows if not r.system.startswith("pubcomp")]
    if ours and peers:
        lost_peer = sum(r.lost for r in peers) / len(peers)
        print(f"\nratio: pubcomp lost {sum(r.lost for r in ours) / len(ours):.0f} per run, "
              f"the bridges {lost_peer:.0f} per run")  # fmt: skip


def mosquitto_version() -> str:
    out = subprocess.run([mosquitto_binary(), "-h"], capture_output=True, text=True).stdout
    first = out.splitlines()[0] if out else ""
    return first.split("version")[-1].strip() if "version" in first else "?"


if __name__ == "__main__":
    main()
