"""Node firmware benchmark: RAM, flash writes, and readings/s to the gateway ingress.

- RAM held by a 500-reading buffer, under the real MicroPython (WebAssembly port,
  ``gc.mem_alloc()``), against the same rounds held as the wire format's dicts.
- Flash bytes written per reading in spill "always" mode through an outage of
  200 messages and its drain, against rewriting one JSON queue file per change.
- Readings/s one node pushes to the gateway's ingress at QoS 1 over loopback
  (the firmware under CPython with its stand-ins, one publish in flight like
  umqtt), against paho-mqtt publishing the same messages the same way.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import paho.mqtt.client as mqtt  # noqa: E402

from devkit.broker import Mosquitto  # noqa: E402
from devkit.gateway_helpers import GatewayProc  # noqa: E402
from devkit.node_helpers import NodeProc, node_config  # noqa: E402

WASM = ROOT / "tests" / "firmware"


def micropython_figures() -> dict[str, tuple[int, int, int]]:
    done = subprocess.run(
        ["node", str(WASM / "run_mpy.mjs"), str(ROOT / "firmware" / "lib"), __file__.replace(
            "firmware.py", "firmware_mpy.py")],
        capture_output=True, text=True, timeout=120, cwd=WASM, check=True,
    )  # fmt: skip
    out = {}
    for name, a, b, c in re.findall(r"^RESULT (\w+) (\d+) (\d+) (\d+)$", done.stdout, re.M):
        out[name] = (int(a), int(b), int(c))
    return out


def node_rate(tmp: Path, port: int, messages: int, spill: str) -> float:
    cfg = node_config(
        "node-b", "pw-b", port, rounds=messages, interval_s=0, buffer_readings=4 * messages,
        spill={"mode": spill}, wdt_ms=0,
    )  # fmt: skip
    node = NodeProc(tmp / f"flash-{spill}", cfg)
    t0 = time.monotonic()
    node.start()
    assert node.wait(600) == 0, node.output()[-2000:]
    return messages * 2 / (time.monotonic() - t0)


def paho_rate(port: int, messages: int) -> float:
    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="node-p", protocol=mqtt.MQTTv311)
    c.username_pw_set("node-p", "pw-p")
    t0 = time.monotonic()
    c.connect("127.0.0.1", port, keepalive=30)
    c.loop_start()
    for seq in range(messages):
        ts = time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime())
        readings = [
            {"sensor": s, "value": seq / 1000, "unit": u} for s, u in (("a", "V"), ("b", "mA"))
        ]
        body = {"v": 1, "node": "node-p", "boot": 1, "seq": seq, "ts": ts, "readings": readings}
        c.publish("nodes/node-p/readings", json.dumps(body), qos=1).wait_for_publish(10)
    elapsed = time.monotonic() - t0
    c.loop_stop()
    c.disconnect()
    return messages * 2 / elapsed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--messages", type=int, default=3000)
    args = ap.parse_args()
    fig = micropython_figures()
    n, ours, peer = fig["ram"]
    print(f"firmware: RAM for a {n}-reading buffer (MicroPython, gc.mem_alloc)")
    print(f"  pubnode ring (tuples, integer values) {ours:>10,} B  {ours / n:6.1f} B/reading")
    print(f"  wire-format dicts (peer)              {peer:>10,} B  {peer / n:6.1f} B/reading")
    print(f"  ratio {ours / peer:.2f}")
    n, ours, peer = fig["flash"]
    print("flash written per reading, spill 'always', 200-message outage then drain")
    print(f"  pubnode append-only log               {ours / n:10.1f} B/reading")
    print(f"  one JSON queue file rewritten (peer)  {peer / n:10.1f} B/reading")
    print(f"  ratio {ours / peer:.3f}")
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        broker = Mosquitto(tmp / "cloud").start()
        gw = GatewayProc(
            tmp, broker.port, nodes={"node-b": "pw-b", "node-p": "pw-p"},
            extra={"ingress": {"max_messages_per_second": 100000}},
        ).start()  # fmt: skip
        try:
            off = node_rate(tmp, gw.ingress_port, args.messages, "off")
            always = node_rate(tmp, gw.ingress_port, args.messages, "always")
            paho = paho_rate(gw.ingress_port, args.messages)
        finally:
            gw.kill()
            broker.kill()
    print(f"node -> gateway ingress, QoS 1, one in flight, {args.messages:,} messages x 2 readings")
    for label, rate in (
        ("firmware (CPython), spill off", off),
        ("firmware (CPython), spill always", always),
        ("paho-mqtt, same messages (peer)", paho),
    ):
        print(f"  {label:38}{rate:10,.0f} readings/s  ratio {rate / paho:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
