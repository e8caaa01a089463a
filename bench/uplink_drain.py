"""Uplink drain benchmark: pubcomp (every transition fsynced) against paho-mqtt (memory only).

Prints, measured in the same run against the same local Mosquitto:
- readings/s delivered at QoS 2 for batch 1 and batch 100, and paho-mqtt's QoS 2
  messages/s for the same number of messages of the same size;
- bytes written to disk per delivered reading (from /proc/self/io);
- peak RSS of ``pubcomp uplink run`` draining a large backlog, against a paho-mqtt
  publisher holding the same backlog in memory.

Targets (issue 2): batch 100 >= 20,000 readings/s; batch 1 >= 0.5x paho's messages/s;
<= 300 bytes written per reading at batch 100; peak RSS <= 60 MB for 1,000,000 readings.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # devkit/ runs from the checkout

import paho.mqtt.client as mqtt  # noqa: E402

from devkit.broker import Mosquitto  # noqa: E402
from devkit.store_helpers import append  # noqa: E402
from pubcomp.sync.client import ConnectOptions  # noqa: E402
from pubcomp.sync.store import Reading, Store  # noqa: E402
from pubcomp.sync.uplink import Uplink, UplinkConfig  # noqa: E402
from pubcomp.sync.wire import encode_payload  # noqa: E402

PAHO_RSS_SCRIPT = """
import sys, threading, resource
import paho.mqtt.client as mqtt
port, messages, payload_size = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
done = threading.Event(); n = [0]
def on_publish(c, u, mid, rc, p):
    n[0] += 1
    if n[0] == messages: done.set()
c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="paho-rss", protocol=mqtt.MQTTv5)
c.on_publish = on_publish
c.connect("127.0.0.1", port); c.loop_start()
for i in range(messages):  # the whole backlog is queued in memory, as paho holds it
    c.publish("bench/paho", bytes(payload_size), qos=2)
done.wait(600); c.loop_stop()
hwm = [l for l in open("/proc/self/status") if l.startswith("VmHWM:")][0]
print(int(hwm.split()[1]) / 1024)
"""


def write_bytes() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("write_bytes:"):
            return int(line.split()[1])
    raise RuntimeError("no write_bytes in /proc/self/io")


def fill(path: Path, n: int) -> Store:
    store = Store(path, gateway_id="gw-bench")
    chunk = 50_000
    for start in range(0, n, chunk):
        append(
            store,
            [
                Reading(f"s{i % 50}", i * 0.001, "2026-11-21T12:00:00.000Z", "C")
                for i in range(start, min(n, start + chunk))
            ],
        )
    store.checkpoint()  # start the measurement with an empty WAL
    return store


def pubcomp_drain(port: int, work: Path, n: int, batch: int) -> tuple[float, float, int]:
    """(readings/s, bytes written per reading, payload bytes per message)."""
    store = fill(work / f"drain-{batch}.db", n)
    sample = store.waiting_rows(0, batch)
    payload = len(encode_payload("gw-bench", [body for _, _, body in sample]))
    up = Uplink(
        store,
        f"mqtt://127.0.0.1:{port}",
        ConnectOptions(f"bench-{batch}"),
        UplinkConfig(batch=batch, end_to_end=False),  # the hop to the broker, as paho
    )
    before = write_bytes()
    t0 = time.perf_counter()
    asyncio.run(up.run(exit_when_drained=True))
    elapsed = time.perf_counter() - t0
    written = write_bytes() - before
    assert store.stats()["backlog"] == 0 and up.status.delivered == n
    store.close()
    return n / elapsed, written / n, payload


def paho_qos2(port: int, messages: int, payload_size: int) -> float:
    """Messages/s for paho-mqtt publishing at QoS 2 with its default in-flight window."""
    done = threading.Event()
    count = [0]

    def on_publish(c, u, mid, rc, p):  # type: ignore[no-untyped-def]
        count[0] += 1
        if count[0] == messages:
            done.set()

    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="paho-bench", protocol=mqtt.MQTTv5)
    c.on_publish = on_publish
    c.connect("127.0.0.1", port)
    c.loop_start()
    payload = bytes(payload_size)
    t0 = time.perf_counter()
    for _ in range(messages):
        c.publish("bench/paho", payload, qos=2)
    if not done.wait(600):
        raise RuntimeError("paho did not finish")
    elapsed = time.perf_counter() - t0
    c.loop_stop()
    c.disconnect()
    return messages / elapsed


def rss_of_pubcomp(port: int, work: Path, n: int) -> float:
    """Peak RSS in MB as the uplink reports it (its own VmHWM: ru_maxrss of a child
    would include this parent's memory, carried over by Linux across fork and exec)."""
    path = work / "rss.db"
    fill(path, n).close()
    cmd = [
        sys.executable,
        "-m",
        "pubcomp",
        "uplink",
        "run",
        "--store",
        str(path),
        "--broker",
        f"mqtt://127.0.0.1:{port}",
        "--client-id",
        "bench-rss",
        "--exit-when-drained",
        "--no-end-to-end",  # the hop to the broker, as paho's
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["backlog"] == 0 and summary["delivered"] == n
    return float(summary["peak_rss_mb"])


def rss_of_paho(port: int, messages: int, payload: int) -> float:
    out = subprocess.run(
        [sys.executable, "-c", PAHO_RSS_SCRIPT, str(port), str(messages), str(payload)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return float(out.strip())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--readings", type=int, default=200_000, help="readings per drain run")
    ap.add_argument("--batch1-readings", type=int, default=20_000)
    ap.add_argument("--rss-readings", type=int, default=1_000_000)
    args = ap.parse_args()

    with tempfile.TemporaryDirectory(prefix="pubcomp-bench-") as tmp:
        work = Path(tmp)
        broker = Mosquitto(work / "broker").start()
        try:
            rows = []
            for batch, n in ((100, args.readings), (1, args.batch1_readings)):
                rate, per_reading, payload = pubcomp_drain(broker.port, work, n, batch)
                paho = paho_qos2(broker.port, n // batch, payload)
                rows.append((batch, n, rate, rate / batch, paho, per_reading, payload))
            rss = rss_of_pubcomp(broker.port, work, args.rss_readings)
            rss_paho = rss_of_paho(broker.port, args.rss_readings // 100, rows[0][6])
        finally:
            broker.kill()

    print("uplink drain, QoS 2 to a local Mosquitto (pubcomp fsyncs every transition)")
    print(
        f"{'batch':>5} {'readings':>9} {'pubcomp rd/s':>13} {'pubcomp msg/s':>14} "
        f"{'paho msg/s':>11} {'ratio msg/s':>12} {'disk B/reading':>15}"
    )
    for batch, n, rate, msgs, paho, per_reading, _ in rows:
        print(
            f"{batch:>5} {n:>9} {rate:>13,.0f} {msgs:>14,.0f} {paho:>11,.0f} "
            f"{msgs / paho:>12.2f} {per_reading:>15,.0f}"
        )
    print(
        f"peak RSS draining {args.rss_readings:,} readings: pubcomp {rss:.1f} MB, "
        f"paho holding them in memory {rss_paho:.1f} MB (ratio {rss / rss_paho:.2f})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
