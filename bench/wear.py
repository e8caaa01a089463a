"""Flash wear: what durable intake costs the SD card, under four load shapes.

Systems, each between the same node publishers and the same cloud Mosquitto:

- pubcomp: ``pubcomp gateway run`` (PUBACK after an fsynced group commit, QoS 2 uplink),
  end to end: a cloud ``pubcomp ingest run`` lands what it delivers and says so, and
  the gateway keeps each message until then (issue 24);
- pubcomp-hop: the same with ``uplink.end_to_end: false`` (readings go at the broker's
  PUBCOMP, as before issue 24): what end to end costs the card, in the same run;
- bridge: Mosquitto 2 as the edge broker bridging ``nodes/#`` to the cloud, with
  ``persistence true`` and its defaults (saves every 30 minutes);
- bridge-autosave: the same with ``autosave_on_changes true``, ``autosave_interval 1``.

Shapes (node publishers are paho-mqtt at QoS 1, the node wire format):

- busy:  4 nodes x 50 one-reading messages/s, one message in flight each (it waits
  for the PUBACK, as the firmware does);
- fleet: 20 nodes, one 3-reading message every 10 s each, one in flight;
- bulk:  20 nodes x 5 messages/s x 100 readings, one in flight;
- burst: one node, 500 one-reading messages/s, up to 20 in flight.

Disks: ``plain`` (this machine's file system; bytes from the system's own
``write_bytes`` in /proc/PID/io, fsyncs from pubcomp's counter) and ``slow``
(the power-cut file system, devkit/powercut, with 5 ms added to every fsync as
on slow flash; bytes are the 4 KiB pages its fsyncs made durable, fsyncs its own
count, for every system alike).

Printed per shape and disk: readings/s acknowledged, PUBACK p50/p99, fsyncs per
reading, bytes written per reading, GB written per day at that rate.

    python bench/wear.py [--shapes busy,fleet,bulk,burst,flood] [--disks plain,slow]
                         [--systems pubcomp,pubcomp-hop,bridge,bridge-autosave] [--seconds 15]
                         [--ledger-interval-s 300]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import paho.mqtt.client as mqtt  # noqa: E402

from devkit.broker import Mosquitto  # noqa: E402
from devkit.gateway_helpers import GatewayProc  # noqa: E402
from devkit.ingest_helpers import IngestProc  # noqa: E402
from devkit.powercut import PowerCutMount, fuse_missing  # noqa: E402
from pubcomp.gateway.wear import process_write_bytes  # noqa: E402
from pubcomp.sync.wire import wire_time  # noqa: E402

PASSWORD = "wear-pw"
SLOW_FSYNC_S = 0.005
SETTINGS: dict[str, Any] = {}  # the gateway's own settings, from the command line


@dataclass(frozen=True)
class Shape:
    name: str
    nodes: int
    rate: float  # messages/s per node
    per_msg: int  # readings per message
    inflight: int
    seconds: float  # default run length (the fleet shape needs longer to be seen)


SHAPES = {
    "busy": Shape("busy", 4, 50.0, 1, 1, 15.0),
    "fleet": Shape("fleet", 20, 0.1, 3, 1, 60.0),
    "bulk": Shape("bulk", 20, 5.0, 100, 1, 15.0),
    "burst": Shape("burst", 1, 500.0, 1, 20, 15.0),
    # The burst node offered more than it can be acknowledged: what each system
    # sustains (burst offers 500/s, so it cannot show more than 500).
    "flood": Shape("flood", 1, 2000.0, 1, 20, 15.0),
}


def payload(node: str, seq: int, per_msg: int) -> bytes:
    ts = wire_time()
    rd = [{"sensor": f"s{i % 8}", "value": seq + i / 1000, "unit": "C"} for i in range(per_msg)]
    msg = {"v": 1, "node": node, "boot": 1, "seq": seq, "ts": ts, "readings": rd}
    return json.dumps(msg, separators=(",", ":")).encode()


class Node(threading.Thread):
    """A node publisher: paced at ``rate``, at most ``inflight`` messages unacknowledged."""

    def __init__(self, name: str, port: int, shape: Shape, until: float, auth: bool) -> None:
        super().__init__(daemon=True)
        self.node, self.shape, self.until = name, shape, until
        self.latencies: list[float] = []
        self._sent: dict[int, float] = {}  # mid -> when sent
        self._early: dict[int, float] = {}  # mid -> when acknowledged, if before publish returned
        self._lock = threading.Condition()
        self.c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=name)
        self.c.max_inflight_messages_set(shape.inflight)
        if auth:
            self.c.username_pw_set(name, PASSWORD)
        self.c.on_publish = self._on_publish
        self.connected = threading.Event()
        self.c.on_connect = lambda *_: self.connected.set()
        self.c.connect("127.0.0.1", port, keepalive=30)
        self.c.loop_start()

    def _on_publish(self, _c: Any, _u: Any, mid: int, *_: Any) -> None:
        with self._lock:
            t0 = self._sent.pop(mid, None)
            if t0 is None:
                self._early[mid] = time.perf_counter()  # before publish() returned
            else:
                self.latencies.append(time.perf_counter() - t0)
            self._lock.notify_all()

    def run(self) -> None:
        interval = 1.0 / self.shape.rate
        # Nodes of a fleet are not in step: each starts somewhere in its interval.
        next_at = time.monotonic() + random.uniform(0, min(interval, 1.0))
        seq = 0
        while True:
            delay = next_at - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            if time.monotonic() >= self.until:
                break
            with self._lock:
                while len(self._sent) >= self.shape.inflight:
                    if not self._lock.wait(10):
                        return
                self._sent[-seq - 1] = time.perf_counter()  # a slot, until paho names its mid
            body = payload(self.node, seq, self.shape.per_msg)
            t0 = time.perf_counter()
            # Not under our lock: paho calls on_publish holding a lock of its own.
            info = self.c.publish(f"nodes/{self.node}/readings", body, qos=1)
            with self._lock:
                del self._sent[-seq - 1]
                if info.mid in self._early:
                    self.latencies.append(self._early.pop(info.mid) - t0)
                else:
                    self._sent[info.mid] = t0
            seq += 1
            next_at = max(next_at + interval, time.monotonic() - interval)
        with self._lock:  # the last messages' acknowledgements
            deadline = time.monotonic() + 10
            while self._sent and time.monotonic() < deadline:
                self._lock.wait(0.1)

    def close(self) -> None:
        self.c.loop_stop()
        self.c.disconnect()


@dataclass
class Result:
    system: str
    readings: int
    seconds: float
    p50_ms: float
    p99_ms: float
    fsyncs: int | None
    bytes_written: int

    @property
    def per_s(self) -> float:
        return self.readings / self.seconds

    def row(self) -> str:
        n = max(self.readings, 1)
        fs = "-" if self.fsyncs is None else f"{self.fsyncs / n:.3f}"
        gb_day = self.bytes_written / self.seconds * 86400 / 1e9
        return (
            f"  {self.system:<16} {self.per_s:>10,.0f} {self.p50_ms:>8.1f} {self.p99_ms:>8.1f} "
            f"{fs:>10} {self.bytes_written / n:>10,.0f} {gb_day:>9.2f}"
        )


HEADER = (
    f"  {'system':<16} {'readings/s':>10} {'p50 ms':>8} {'p99 ms':>8} "
    f"{'fsync/rdg':>10} {'B/reading':>10} {'GB/day':>9}"
)


class Disk:
    """Where a system keeps its state, and how its writes are counted there."""

    def __init__(self, kind: str, tmp: Path) -> None:
        self.kind, self.tmp = kind, tmp
        self.mount: PowerCutMount | None = None

    @contextlib.contextmanager
    def state_dir(self, name: str) -> Iterator[Path]:
        if self.kind == "plain":
            path = self.tmp / f"{name}-state"
            path.mkdir(parents=True)
            yield path
            return
        self.mount = PowerCutMount(
            self.tmp / f"{name}-backing", self.tmp / f"{name}-disk", fsync_delay=SLOW_FSYNC_S
        )
        with self.mount:
            yield self.mount.path
        self.mount = None

    def counters(self, pid: int, own_fsyncs: int | None) -> tuple[int | None, int]:
        """(fsyncs, bytes written) so far."""
        if self.mount is not None:
            st = self.mount.stats()
            return st["fsyncs"], st["pages_synced"] * 4096
        return own_fsyncs, process_write_bytes(pid) or 0


def drive(port: int, shape: Shape, seconds: float, auth: bool) -> tuple[list[Node], float]:
    nodes = [Node(f"node-{i:02d}", port, shape, 0.0, auth) for i in range(shape.nodes)]
    for n in nodes:  # connected first: a password check at CONNECT is not a PUBACK's wait
        if not n.connected.wait(30):
            raise RuntimeError(f"{n.node} did not connect")
    until = time.monotonic() + seconds
    for n in nodes:
        n.until = until
    t0 = time.monotonic()
    for n in nodes:
        n.start()
    for n in nodes:
        n.join()
    elapsed = time.monotonic() - t0
    for n in nodes:
        n.close()
    return nodes, elapsed


def summarise(system: str, nodes: list[Node], shape: Shape, elapsed: float) -> Result:
    lat = sorted(x for n in nodes for x in n.latencies) or [float("nan")]
    return Result(
        system,
        len(lat) * shape.per_msg if lat[0] == lat[0] else 0,
        elapsed,
        statistics.median(lat) * 1000,
        lat[max(0, int(len(lat) * 0.99) - 1)] * 1000,
        None,
        0,
    )


def run_pubcomp(
    tmp: Path, disk: Disk, cloud: Mosquitto, shape: Shape, seconds: float, end_to_end: bool
) -> Result:
    name = "pubcomp" if end_to_end else "pubcomp-hop"
    (tmp / name).mkdir(parents=True)
    with disk.state_dir(name) as state:
        uplink = {**SETTINGS.get("uplink", {}), "end_to_end": end_to_end}
        gw = GatewayProc(
            tmp / name,
            cloud.port,
            gid="gw-wear",
            nodes={f"node-{i:02d}": PASSWORD for i in range(shape.nodes)},
            extra={"ingress": {"max_messages_per_second": 100000}} | SETTINGS | {"uplink": uplink},
        )
        gw.db = state / "gateway.db"
        gw.write()
        gw.start()
        assert gw.proc is not None
        try:
            f0, b0 = disk.counters(gw.proc.pid, gw.status()["flash"]["fsyncs"])
            nodes, elapsed = drive(gw.ingress_port, shape, seconds, auth=True)
            f1, b1 = disk.counters(gw.proc.pid, gw.status()["flash"]["fsyncs"])
        finally:
            gw.terminate()
    r = summarise(name, nodes, shape, elapsed)
    r.fsyncs = None if f0 is None or f1 is None else f1 - f0
    r.bytes_written = b1 - b0
    return r


def run_bridge(
    tmp: Path, disk: Disk, cloud: Mosquitto, shape: Shape, seconds: float, autosave: bool
) -> Result:
    name = "bridge-autosave" if autosave else "bridge"
    extra = (
        "connection cloud\n"
        f"address 127.0.0.1:{cloud.port}\n"
        "topic nodes/# out 1\n"
        "cleansession false\n"
        "bridge_protocol_version mqttv311\n"
    )
    if autosave:
        extra = "autosave_on_changes true\nautosave_interval 1\n" + extra
    with disk.state_dir(name) as state:
        edge = Mosquitto(state, persistence=True, extra_config=extra).start()
        assert edge.proc is not None
        try:
            f0, b0 = disk.counters(edge.proc.pid, None)
            nodes, elapsed = drive(edge.port, shape, seconds, auth=False)
            f1, b1 = disk.counters(edge.proc.pid, None)
        finally:
            edge.stop()
    r = summarise(name, nodes, shape, elapsed)
    r.fsyncs = None if f0 is None or f1 is None else f1 - f0
    r.bytes_written = b1 - b0
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="busy,fleet,bulk,burst,flood")
    ap.add_argument("--disks", default="plain,slow")
    ap.add_argument("--systems", default="pubcomp,pubcomp-hop,bridge,bridge-autosave")
    ap.add_argument("--seconds", type=float, default=None, help="each run (default per shape)")
    ap.add_argument("--commit-delay-ms", type=float, help="pubcomp's store.commit_delay_ms")
    ap.add_argument("--commit-delay-max-ms", type=float, help="pubcomp's store.commit_delay_max_ms")
    ap.add_argument("--linger-ms", type=float, help="pubcomp's uplink.linger_ms")
    ap.add_argument(
        "--ledger-interval-s", type=float, help="pubcomp's ledger.interval_s (its $ledger records)"
    )
    args = ap.parse_args()
    if args.commit_delay_ms is not None:
        SETTINGS.setdefault("store", {})["commit_delay_ms"] = args.commit_delay_ms
    if args.commit_delay_max_ms is not None:
        SETTINGS.setdefault("store", {})["commit_delay_max_ms"] = args.commit_delay_max_ms
    if args.linger_ms is not None:
        SETTINGS["uplink"] = {"linger_ms": args.linger_ms}
    if args.ledger_interval_s is not None:
        SETTINGS["ledger"] = {"interval_s": args.ledger_interval_s}
    disks = args.disks.split(",")
    if "slow" in disks and fuse_missing():
        print(f"slow disk skipped: {fuse_missing()}")
        disks.remove("slow")
    tmp = Path(tempfile.mkdtemp(prefix="pubcomp-wear-"))
    cloud = Mosquitto(tmp / "cloud").start()
    # The cloud's ingest: lands what the gateway delivers and acknowledges it, as in the
    # field; its landing zone is not on the disk measured.
    ingest = IngestProc(cloud.port, tmp / "landing", "wear-ingest").start()
    try:
        for shape_name in args.shapes.split(","):
            shape = SHAPES[shape_name]
            seconds = args.seconds or shape.seconds
            offered = shape.nodes * shape.rate * shape.per_msg
            for disk_kind in disks:
                print(
                    f"\n{shape.name} on the {disk_kind} disk: {shape.nodes} nodes x "
                    f"{shape.rate:g} msg/s x {shape.per_msg} readings, {shape.inflight} in "
                    f"flight ({offered:,.0f} readings/s offered), {seconds:g} s"
                )
                print(HEADER)
                for system in args.systems.split(","):
                    run_dir = tmp / f"{shape.name}-{disk_kind}-{system}"
                    disk = Disk(disk_kind, run_dir)
                    if system in ("pubcomp", "pubcomp-hop"):
                        e2e = system == "pubcomp"
                        r = run_pubcomp(run_dir, disk, cloud, shape, seconds, e2e)
                    else:
                        r = run_bridge(
                            run_dir, disk, cloud, shape, seconds, system == "bridge-autosave"
                        )
                    print(r.row(), flush=True)
    finally:
        ingest.stop()
        cloud.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
