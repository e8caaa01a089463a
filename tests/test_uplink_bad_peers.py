"""A scripted fake broker that misbehaves: the uplink must not crash, must send the right
packets, and must lose nothing."""

from __future__ import annotations

import asyncio
import collections
import itertools
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from devkit.uplink_helpers import fill_store
from pubcomp.sync.client import ConnectOptions
from pubcomp.sync.codec import Decoder, ProtocolError, encode
from pubcomp.sync.packets import (
    MQTT_5,
    Connack,
    Connect,
    Disconnect,
    Pingreq,
    Pingresp,
    Pubcomp,
    Publish,
    Pubrec,
    Pubrel,
    Suback,
    Subscribe,
)
from pubcomp.sync.store import Store
from pubcomp.sync.uplink import Uplink, UplinkConfig

# script(publish, nth_publish_seen) -> what to send back: packets or raw bytes
Script = Callable[[Publish, int], list[Any]]


def normal(pub: Publish, n: int) -> list[Any]:
    return [Pubrec(pub.packet_id)]  # type: ignore[arg-type]


class FakeBroker:
    """Speaks MQTT 5 through pubcomp's codec; delivers on PUBREL, like Mosquitto."""

    def __init__(
        self,
        script: Script = normal,
        extra_on_connect: list[Any] | None = None,
        connack_props: dict[str, Any] | None = None,
        answer_pings: bool = True,
        suback: list[int] | None = None,
    ) -> None:
        self.script = script
        self.suback = suback  # the reason codes a SUBSCRIBE gets (None: no SUBACK at all)
        self.extra_on_connect = extra_on_connect or []
        self.connack_props = {"receive_maximum": 5, **(connack_props or {})}
        self.answer_pings = answer_pings
        self.max_outstanding = 0  # most QoS>0 PUBLISHes unacknowledged at once
        self.delivered: collections.Counter[str] = collections.Counter()
        self.held: dict[int, Publish] = {}  # QoS 2 messages received, awaiting PUBREL
        self.seen: list[Any] = []  # every packet the uplink sent
        self.publishes = 0
        self.connections = 0
        self.has_session = False

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._client, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    async def _client(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        dec = Decoder(None)
        self.connections += 1

        def send(*items: Any) -> None:
            for it in items:
                w.write(it if isinstance(it, bytes) else encode(it, MQTT_5))

        try:
            while data := await r.read(65536):
                for pkt in dec.feed(data):
                    self.seen.append(pkt)
                    if isinstance(pkt, Connect):
                        present = self.has_session and not pkt.clean_start
                        self.has_session = pkt.properties.get("session_expiry_interval", 0) > 0
                        if pkt.clean_start:
                            self.held.clear()
                        send(Connack(present, 0, self.connack_props), *self.extra_on_connect)
                    elif isinstance(pkt, Publish):
                        self.publishes += 1
                        if pkt.qos == 1:
                            for rd in json.loads(pkt.payload)["readings"]:
                                self.delivered[rd["id"]] += 1
                            send(*self.script(pkt, self.publishes))
                            continue
                        if pkt.packet_id not in self.held:
                            self.held[pkt.packet_id] = pkt  # type: ignore[index]
                        self.max_outstanding = max(self.max_outstanding, len(self.held))
                        replies = self.script(pkt, self.publishes)
                        for rep in replies:
                            if isinstance(rep, Pubrec) and rep.reason_code >= 0x80:
                                self.held.pop(pkt.packet_id, None)  # type: ignore[arg-type]
                        send(*replies)
                    elif isinstance(pkt, Pubrel):
                        held = self.held.pop(pkt.packet_id, None)
                        if held is not None:
                            for rd in json.loads(held.payload)["readings"]:
                                self.delivered[rd["id"]] += 1
                        send(Pubcomp(pkt.packet_id))
                    elif isinstance(pkt, Subscribe) and self.suback is not None:
                        send(Suback(pkt.packet_id, self.suback))
                    elif isinstance(pkt, Pingreq) and self.answer_pings:
                        send(Pingresp())
                    elif isinstance(pkt, Disconnect):
                        return
                await w.drain()
        except (ProtocolError, ConnectionError):
            pass
        finally:
            w.close()


def run_uplink_against(
    tmp_path: Path,
    broker: FakeBroker,
    n: int = 200,
    timeout: float = 30,
    config: UplinkConfig | None = None,
    keepalive: int = 5,
) -> tuple[Uplink, set[str]]:
    store_path = tmp_path / "gw.db"
    expected = fill_store(store_path, n)

    async def main() -> Uplink:
        port = await broker.start()
        store = Store(store_path)
        up = Uplink(
            store,
            f"mqtt://127.0.0.1:{port}",
            ConnectOptions("gw1", MQTT_5, keepalive=keepalive),
            config or UplinkConfig(batch=10, end_to_end=False),
        )
        await asyncio.wait_for(up.run(exit_when_drained=True), timeout)
        broker.server.close()
        return up

    return asyncio.run(main()), expected


def sent(broker: FakeBroker, cls: type) -> list[Any]:
    return [p for p in broker.seen if isinstance(p, cls)]


def pubrel_after_refusal(broker: FakeBroker, nth_publish: int) -> bool:
    """Did the uplink send a PUBREL for the n-th PUBLISH's id before that id's next PUBLISH?"""
    seen = broker.seen
    idx = [i for i, p in enumerate(seen) if isinstance(p, Publish)][nth_publish - 1]
    pid = seen[idx].packet_id
    for p in seen[idx + 1 :]:
        if isinstance(p, Publish) and p.packet_id == pid:
            return False
        if isinstance(p, Pubrel) and p.packet_id == pid:
            return True
    return False


def test_pubrec_quota_exceeded_retries_with_a_new_id_without_pubrel(tmp_path: Path) -> None:
    """5.0 4.3.3-4: no PUBREL after a PUBREC >= 0x80; 4.4.0-2: never retransmitted as DUP."""

    def script(pub: Publish, n: int) -> list[Any]:
        return [Pubrec(pub.packet_id, 0x97 if n == 1 else 0)]  # type: ignore[arg-type]

    broker = FakeBroker(script)
    up, expected = run_uplink_against(tmp_path, broker)
    assert not pubrel_after_refusal(broker, 1)
    assert not any(p.dup for p in sent(broker, Publish))  # refused: a new message, not a DUP
    assert set(broker.delivered) == expected and max(broker.delivered.values()) == 1
    assert up.metrics()["refused_by_broker"] == 1


def test_pubrec_not_authorized_dead_letters_and_goes_on(tmp_path: Path) -> None:
    def script(pub: Publish, n: int) -> list[Any]:
        return [Pubrec(pub.packet_id, 0x87 if n == 3 else 0)]  # type: ignore[arg-type]

    broker = FakeBroker(script)
    up, expected = run_uplink_against(tmp_path, broker)
    assert not pubrel_after_refusal(broker, 3)
    m = up.metrics()
    assert m["dead_letter"] == 10 and m["backlog"] == 0
    # Nothing is lost: the refused readings are kept in dead_letter, the rest delivered once.
    dead = {d["id"] for d in up.store.dead_letters()}
    assert dead | set(broker.delivered) == expected and not dead & set(broker.delivered)
    assert max(broker.delivered.values()) == 1


def test_unknown_pubrel_and_stray_pubcomp_are_answered_or_ignored(tmp_path: Path) -> None:
    """MQTT-4.5.0-2-like politeness: an unknown PUBREL gets PUBCOMP 0x92; stray PUBCOMPs
    (for a free id, or before PUBREL) change nothing."""

    def script(pub: Publish, n: int) -> list[Any]:
        pid = pub.packet_id
        assert pid is not None
        if n == 2:
            return [Pubcomp(pid), Pubcomp(60000), Pubrec(pid)]  # PUBCOMP before PUBREC
        return [Pubrec(pid)]

    broker = FakeBroker(script, extra_on_connect=[Pubrel(4321)])
    up, expected = run_uplink_against(tmp_path, broker)
    answers = [p for p in sent(broker, Pubcomp) if p.packet_id == 4321]
    assert answers and answers[0].reason_code == 0x92
    assert set(broker.delivered) == expected and max(broker.delivered.values()) == 1
    assert up.status.ignored  # counted, not crashed


def test_malformed_packet_closes_the_connection_and_resumes(tmp_path: Path) -> None:
    """MQTT-4.8.0-1: a malformed packet closes the connection; the session resumes after."""

    def script(pub: Publish, n: int) -> list[Any]:
        if n == 4:
            # A PUBREL from the broker with flags 0000 instead of 0010 (MQTT-3.6.1-1).
            return [b"\x60\x02\x00\x01"]
        return [Pubrec(pub.packet_id)]  # type: ignore[arg-type]

    broker = FakeBroker(script)
    up, expected = run_uplink_against(tmp_path, broker)
    assert broker.connections >= 3  # clean + persistent, then the reconnect
    assert set(broker.delivered) == expected and max(broker.delivered.values()) == 1
    assert "ProtocolError" in (up.status.last_error or "")


def test_pubrels_follow_the_order_of_pubrecs_MQTT_4_6_0_3(tmp_path: Path) -> None:
    window: list[int] = []
    pubrec_order: list[int] = []

    def reversed_window(pub: Publish, n: int) -> list[Any]:
        window.append(pub.packet_id)  # type: ignore[arg-type]
        if len(window) < 5:
            return []
        out = [Pubrec(p) for p in reversed(window)]
        pubrec_order.extend(reversed(window))
        window.clear()
        return out

    broker = FakeBroker(reversed_window)
    _, expected = run_uplink_against(tmp_path, broker)  # 20 messages, window of 5
    assert [p.packet_id for p in sent(broker, Pubrel)] == pubrec_order
    assert set(broker.delivered) == expected


def test_a_message_refused_again_and_again_backs_off_then_dead_letters(tmp_path: Path) -> None:
    """A transient refusal (0x97) is retried under a new id, not every 0.5 s for ever:
    the back-off doubles while the broker goes on refusing, and after ``max_refusals``
    the message is dead-lettered (counted) while the rest is delivered once."""
    refused_payload: list[bytes] = []
    refused_at: list[float] = []

    def script(pub: Publish, n: int) -> list[Any]:
        if n == 1:
            refused_payload.append(pub.payload)
        if pub.payload == refused_payload[0]:
            refused_at.append(time.monotonic())
            return [Pubrec(pub.packet_id, 0x97)]  # type: ignore[arg-type]
        return [Pubrec(pub.packet_id)]  # type: ignore[arg-type]

    broker = FakeBroker(script)
    up, expected = run_uplink_against(
        tmp_path, broker, n=50, config=UplinkConfig(batch=10, max_refusals=3, end_to_end=False)
    )
    assert len(refused_at) == 3  # refused three times, then not sent again
    gaps = [b - a for a, b in itertools.pairwise(refused_at)]
    assert gaps[0] >= 0.5 and gaps[1] >= 1.0, gaps  # 0.5 s, then doubled
    m = up.metrics()
    assert m["dead_letter"] == 10 and m["backlog"] == 0 and m["refused_by_broker"] == 2
    dead = {d["id"] for d in up.store.dead_letters()}
    assert dead | set(broker.delivered) == expected and not dead & set(broker.delivered)
    assert max(broker.delivered.values()) == 1


def test_a_refused_landed_subscription_is_said_and_nothing_is_let_go(tmp_path: Path) -> None:
    """A broker that refuses the subscription to the landed topics (SUBACK 0x87, its ACL):
    the uplink says so (the status's landing row: acknowledgements REFUSED, check the
    ACL), keeps every delivered reading, and its SUBSCRIBE's id was one no PUBLISH held
    (MQTT-2.3.1-2: tests/test_session.py)."""
    from pubcomp.gateway.status import landing

    broker = FakeBroker(suback=[0x87])
    store_path = tmp_path / "gw.db"
    fill_store(store_path, 50)

    async def main() -> dict[str, Any]:
        port = await broker.start()
        with Store(store_path) as store:
            up = Uplink(
                store,
                f"mqtt://127.0.0.1:{port}",
                ConnectOptions("gw1", MQTT_5),
                UplinkConfig(batch=10, landed_timeout=600),
            )
            stop = asyncio.Event()
            task = asyncio.create_task(up.run(stop))
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                e2e = up.metrics()["end_to_end"]
                if e2e["subscription_refused"] is not None and e2e["awaiting_landing"] == 50:
                    break
                await asyncio.sleep(0.05)
            stop.set()
            await asyncio.wait_for(task, 20)
            broker.server.close()
            return up.metrics()["end_to_end"]

    e2e = asyncio.run(main())
    assert e2e["subscription_refused"] == 0x87 and e2e["awaiting_landing"] == 50, e2e
    assert "acknowledgements REFUSED by the broker (0x87)" in landing(e2e)
    subscribe = next(p for p in broker.seen if isinstance(p, Subscribe))
    assert [(s.topic_filter, s.qos) for s in subscribe.subscriptions] == [
        ("telemetry/gw1/landed/+", 1)
    ]
