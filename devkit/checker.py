"""An independent checker: a paho-mqtt subscriber that counts every reading id.

It has nothing of pubcomp in it: paho-mqtt's own client, a persistent session
at QoS 2, and a plain JSON parse of the wire format (design section 3).
"""

from __future__ import annotations

import collections
import json
import threading
import time

import paho.mqtt.client as mqtt


class Checker:
    def __init__(
        self,
        port: int,
        topic: str = "#",
        client_id: str = "checker",
        protocol: int = 5,
        username: str | None = None,
        password: str | None = None,
    ) -> None:
        self.counts: collections.Counter[str] = collections.Counter()
        self.readings: dict[str, tuple] = {}  # id -> (sensor, ts, value) as delivered
        self.records: dict[str, dict] = {}  # id -> a gateway's record ($ledger, ...) as delivered
        self.arrivals: list[str] = []  # every id delivered, in the order it arrived
        self.packets: dict[str, list[tuple[int, bool]]] = {}  # id -> (packet id, DUP) per delivery
        self.messages = 0
        self.bad_payloads = 0
        self.subscriptions = 0  # SUBACKs received: one per (re)connection
        self._lock = threading.Lock()
        self._subscribed = threading.Event()
        self.topic = topic
        self.protocol = mqtt.MQTTv5 if protocol == 5 else mqtt.MQTTv311
        kwargs = {"client_id": client_id, "protocol": self.protocol}
        if self.protocol == mqtt.MQTTv311:
            kwargs["clean_session"] = False
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, **kwargs)
        self.client.on_message = self._on_message
        self.client.on_connect = self._on_connect
        self.client.on_subscribe = self._on_subscribe
        self.client.reconnect_delay_set(0.05, 0.5)
        if username is not None:
            self.client.username_pw_set(username, password)
        self.port = port

    def _on_connect(self, client, userdata, flags, reason, properties):
        client.subscribe(self.topic, qos=2)

    def _on_subscribe(self, *_args):
        with self._lock:
            self.subscriptions += 1
        self._subscribed.set()

    def _on_message(self, client, userdata, msg):
        if "/landed/" in msg.topic:
            return  # the ingest's acknowledgements to a gateway: no readings
        try:
            readings = json.loads(msg.payload)["readings"]
            ids = [r["id"] for r in readings]
            what = {r["id"]: (r["sensor"], r["ts"], r["value"]) for r in readings}
            records = {r["id"]: r["record"] for r in readings if "record" in r}
        except (ValueError, KeyError, TypeError):
            with self._lock:
                self.bad_payloads += 1
            return
        with self._lock:
            self.messages += 1
            self.counts.update(ids)
            self.arrivals.extend(ids)
            for i in ids:
                self.packets.setdefault(i, []).append((msg.mid, bool(msg.dup)))
            self.readings.update(what)
            self.records.update(records)

    def start(self) -> Checker:
        if self.protocol == mqtt.MQTTv5:
            props = mqtt.Properties(mqtt.PacketTypes.CONNECT)
            props.SessionExpiryInterval = 3600
            self.client.connect("127.0.0.1", self.port, clean_start=False, properties=props)
        else:
            self.client.connect("127.0.0.1", self.port)
        self.client.loop_start()
        if not self._subscribed.wait(10):
            raise RuntimeError("checker did not subscribe")
        return self

    def wait_subscribed(self, after: int, timeout: float = 30.0) -> None:
        """Wait for a SUBACK beyond the first ``after``: the subscription of a new
        connection (after a broker restart), before anything is published to it."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if self.subscriptions > after:
                    return
            time.sleep(0.02)
        raise RuntimeError(f"checker did not subscribe again within {timeout:g} s")

    def stop(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()

    def snapshot(self) -> collections.Counter[str]:
        with self._lock:
            return collections.Counter(self.counts)

    def count(self) -> int:
        """Deliveries so far: what a waiting test watches for progress."""
        with self._lock:
            return sum(self.counts.values())

    def readings_seen(self, prefix: str = "") -> dict[str, tuple]:
        """What each reading id (starting with ``prefix``) carried: (sensor, ts, value)."""
        with self._lock:
            return {k: v for k, v in self.readings.items() if k.startswith(prefix)}

    def records_seen(self) -> dict[str, dict]:
        """Every gateway record delivered (a ``$...`` sensor's ``record``), by reading id."""
        with self._lock:
            return dict(self.records)

    def copies(self) -> dict[str, list[tuple[int, bool]]]:
        """Each id delivered more than once: (packet id, DUP flag) of every delivery."""
        with self._lock:
            return {k: v for k, v in sorted(self.packets.items()) if len(v) > 1}

    def undup(self) -> collections.Counter[str]:
        """Deliveries per id of PUBLISH packets without the DUP flag: a broker sets DUP
        only on its own redeliveries (it does not pass on the publisher's, MQTT-3.3.1-3),
        so each of these is a message some publisher sent."""
        with self._lock:
            return collections.Counter(
                {k: n for k, v in self.packets.items() if (n := sum(not d for _, d in v))}
            )

    def arrival_order(self) -> list[str]:
        with self._lock:
            return list(self.arrivals)

    def wait_for(self, expected: set[str], timeout: float = 60.0) -> collections.Counter[str]:
        """Wait until every expected id has arrived, then a little longer for stray duplicates."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            snap = self.snapshot()
            if expected <= snap.keys():
                time.sleep(0.3)
                return self.snapshot()
            time.sleep(0.05)
        return self.snapshot()


def exactly_once_report(counts: collections.Counter[str], expected: set[str]) -> dict[str, object]:
    missing = expected - counts.keys()
    dups = {k: n for k, n in counts.items() if n > 1}
    unexpected = counts.keys() - expected
    return {
        "missing": len(missing),
        "duplicated": len(dups),
        "unexpected": len(unexpected),
        "missing_sample": sorted(missing)[:5],
        "dup_sample": sorted(dups.items())[:5],
    }


class Recorder:
    """Every message on a topic filter as paho-mqtt received it, (topic, payload): what a
    test reads when it checks the payloads themselves, not only the reading ids."""

    def __init__(self, port: int, topic: str = "telemetry/#", client_id: str = "recorder"):
        self._got: list[tuple[str, bytes]] = []
        self._lock = threading.Lock()
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id)
        self.client.on_message = lambda _c, _u, m: self._add(m.topic, m.payload)
        subscribed = threading.Event()
        self.client.on_subscribe = lambda *_: subscribed.set()
        self.client.on_connect = lambda c, *_: c.subscribe(topic, qos=2)
        self.client.connect("127.0.0.1", port)
        self.client.loop_start()
        if not subscribed.wait(10):
            raise RuntimeError("recorder did not subscribe")

    def _add(self, topic: str, payload: bytes) -> None:
        with self._lock:
            self._got.append((topic, payload))

    def messages(self) -> list[tuple[str, bytes]]:
        with self._lock:
            return list(self._got)

    def payloads(self, suffix: str = "/readings") -> list[bytes]:
        return [p for t, p in self.messages() if t.endswith(suffix)]

    def stop(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()


def publish_retained(
    port: int, topic: str, payload: bytes, user: str | None = None, password: str | None = None
) -> int:
    """One retained QoS 1 message from an independent paho client (MQTT 5), as ``user``
    when given: the reason code of its PUBACK (0x87 when the broker's ACL refuses it)."""
    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
    if user is not None:
        c.username_pw_set(user, password)
    codes: list[int] = []
    c.on_publish = lambda _c, _u, _mid, rc, _p: codes.append(rc.value)
    c.connect("127.0.0.1", port)
    c.loop_start()
    try:
        c.publish(topic, payload, qos=1, retain=True).wait_for_publish(10)
        deadline = time.monotonic() + 10
        while not codes and time.monotonic() < deadline:
            time.sleep(0.01)
        assert codes, f"no PUBACK for {topic}"
    finally:
        c.loop_stop()
        c.disconnect()
    return codes[0]
