"""Messages the gateway cannot store are refused, never left unacknowledged (issue 25).

An abuse run found five payloads that passed the node schema and were then
dropped with no PUBACK and no reason code, each leaving "Task exception was
never retrieved" in the log: a ``ts`` that matches the pattern but is no date
(month 13, year 0), a ``dt`` of 1e12 or one that reaches before year 1, and
``boot`` = 2**64 (SQLite's integer overflows). The firmware resends a message
until its PUBACK, so a node would have resent such a message forever, with
everything it measured afterwards waiting behind it.

Now: MQTT 5 gets PUBACK 0x99 (payload format invalid), 3.1.1 a PUBACK (it has
no refusal code: MQTT-4.5.0-2 lets a server acknowledge and discard); both are
counted by reason, and the node's next message goes through.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest

from devkit.broker import Mosquitto
from tests.hostile_helpers import Siege


def _msg(**over: Any) -> bytes:
    msg: dict[str, Any] = {"v": 1, "node": "poison", "boot": 1, "seq": 1}
    msg["ts"] = "2026-11-25T10:00:00.000Z"
    msg["readings"] = [{"sensor": "t", "value": 1.0, "unit": "C"}]
    msg.update(over)
    return json.dumps(msg).encode()


def _reading(**over: Any) -> list[dict[str, Any]]:
    return [{"sensor": "t", "value": 1.0, "unit": "C", **over}]


# (what it is, payload, the reason it is counted under)
POISON = [
    ("ts month 13", _msg(seq=1, ts="2026-13-01T00:00:00.000Z"), "invalid_schema"),
    ("ts year 0", _msg(seq=2, ts="0000-01-01T00:00:00.000Z"), "invalid_schema"),
    ("dt 1e12", _msg(seq=3, readings=_reading(dt=1e12)), "invalid_schema"),
    ("dt before year 1", _msg(seq=4, ts="0001-01-01T00:00:01Z", readings=_reading(dt=2)),
     "invalid_time"),
    ("boot 2**64", _msg(seq=5, boot=2**64), "invalid_schema"),
    ("ts 30 February", _msg(seq=6, ts="2026-02-30T00:00:00.000Z"), "invalid_time"),
]  # fmt: skip


class Poisoner:
    """A paho node that publishes each poison message, then a good one, once."""

    def __init__(self, port: int, v5: bool) -> None:
        proto = mqtt.MQTTv5 if v5 else mqtt.MQTTv311
        self.c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="poison", protocol=proto)
        self.c.username_pw_set("poison", "pw-poison")
        self.acks: dict[int, int] = {}
        self.lock = threading.Lock()
        self.c.on_publish = self._on_publish
        self.c.connect("127.0.0.1", port)
        self.c.loop_start()

    def _on_publish(self, c: Any, u: Any, mid: int, reason: Any, props: Any) -> None:
        with self.lock:
            self.acks[mid] = reason.value

    def run(self, payloads: list[bytes], timeout: float = 10) -> list[int | None]:
        mids = [self.c.publish("nodes/poison/readings", p, qos=1).mid for p in payloads]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not all(m in self.acks for m in mids):
            time.sleep(0.02)
        self.c.disconnect()
        self.c.loop_stop()
        return [self.acks.get(m) for m in mids]


@pytest.mark.parametrize("v5", [False, True], ids=["mqtt311", "mqtt5"])
def test_poison_messages_are_refused_with_a_reason_and_the_node_goes_on(
    tmp_path: Path, mosquitto: Mosquitto, v5: bool
) -> None:
    siege = Siege(tmp_path, mosquitto, nodes={"poison": "pw-poison"})
    good = _msg(seq=100)
    with siege.watch():
        acks = Poisoner(siege.gw.ingress_port, v5).run([p for _, p, _ in POISON] + [good])
    node = siege.gw.status()["nodes"]["poison"]
    figures = siege.finish(rss_mb=20, fds=20, log_kb=8)
    refused = 0x99 if v5 else 0  # 3.1.1: acknowledged and counted as refused (MQTT-4.5.0-2)
    assert dict(zip([w for w, _, _ in POISON] + ["good"], acks, strict=True)) == {
        **{w: refused for w, _, _ in POISON},
        "good": 0,
    }, figures
    expected: dict[str, int] = {}
    for _, _, reason in POISON:
        expected[reason] = expected.get(reason, 0) + 1
    assert node["rejected"] == expected
    assert node["messages"] == 1  # the good one, stored after the poison
    ids = [k for k in siege.checker.snapshot() if k.startswith("poison/")]
    assert ids == ["poison/1/100.0"]
