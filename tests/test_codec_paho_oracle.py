"""paho-mqtt as an independent oracle for the codec.

A real paho-mqtt client talks to a scripted server that uses only pubcomp's
codec: whatever paho encodes, we must decode to the fields paho was given;
whatever we encode, paho must understand (its callbacks prove it).
"""

from __future__ import annotations

import socket
import threading

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from pubcomp.sync.codec import Decoder, encode
from pubcomp.sync.packets import (
    MQTT_5,
    MQTT_311,
    Connack,
    Connect,
    Disconnect,
    Packet,
    Pubcomp,
    Publish,
    Pubrec,
    Pubrel,
    Suback,
    Subscribe,
)


class ScriptedServer:
    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(1)
        self.port = self.sock.getsockname()[1]
        self.conn: socket.socket | None = None
        self.decoder = Decoder(None)
        self.pending: list[Packet] = []

    def accept(self) -> None:
        self.sock.settimeout(10)
        self.conn, _ = self.sock.accept()
        self.conn.settimeout(10)

    def expect(self, cls: type) -> Packet:
        assert self.conn is not None
        while not self.pending:
            data = self.conn.recv(65536)
            assert data, "client closed the connection"
            self.pending += self.decoder.feed(data)
        pkt = self.pending.pop(0)
        assert isinstance(pkt, cls), f"expected {cls.__name__}, got {pkt!r}"
        return pkt

    def send(self, pkt: Packet) -> None:
        assert self.conn is not None and self.decoder.version is not None
        self.conn.sendall(encode(pkt, self.decoder.version))

    def close(self) -> None:
        if self.conn:
            self.conn.close()
        self.sock.close()


@pytest.mark.parametrize("version", [MQTT_311, MQTT_5], ids=["3.1.1", "5.0"])
def test_paho_and_pubcomp_understand_each_other(version: int) -> None:
    server = ScriptedServer()
    events: dict[str, object] = {}
    done = {k: threading.Event() for k in ("connect", "publish", "message", "subscribe")}
    v5 = version == MQTT_5
    kwargs: dict[str, object] = {
        "client_id": "oracle-1",
        "protocol": mqtt.MQTTv5 if v5 else mqtt.MQTTv311,
    }
    if not v5:
        kwargs["clean_session"] = False
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, **kwargs)  # type: ignore[arg-type]
    client.username_pw_set("node-7", "s3cret")
    will_props = None
    if v5:
        will_props = Properties(PacketTypes.WILLMESSAGE)
        will_props.WillDelayInterval = 5
    client.will_set("nodes/node-7/status", b"offline", qos=1, retain=True, properties=will_props)

    def on_connect(c, u, flags, reason, props):  # type: ignore[no-untyped-def]
        events["session_present"] = flags.session_present
        done["connect"].set()

    def on_message(c, u, msg):  # type: ignore[no-untyped-def]
        events["message"] = (msg.topic, msg.payload, msg.qos)
        done["message"].set()

    def on_subscribe(c, u, mid, reason_codes, props):  # type: ignore[no-untyped-def]
        events["granted"] = [rc.value if hasattr(rc, "value") else rc for rc in reason_codes]
        done["subscribe"].set()

    client.on_connect = on_connect
    client.on_message = on_message
    client.on_subscribe = on_subscribe
    client.on_publish = lambda *a: done["publish"].set()
    connect_props = None
    if v5:
        connect_props = Properties(PacketTypes.CONNECT)
        connect_props.SessionExpiryInterval = 600
        connect_props.ReceiveMaximum = 9
    try:
        if v5:
            client.connect_async(
                "127.0.0.1", server.port, keepalive=45, clean_start=False, properties=connect_props
            )
        else:
            client.connect_async("127.0.0.1", server.port, keepalive=45)
        client.loop_start()
        server.accept()

        # paho -> pubcomp: CONNECT with credentials, will and properties
        c = server.expect(Connect)
        assert isinstance(c, Connect)
        assert (c.client_id, c.protocol_level, c.keepalive) == ("oracle-1", version, 45)
        assert (c.username, c.password, c.clean_start) == ("node-7", b"s3cret", False)
        assert c.will is not None
        assert (c.will.topic, c.will.payload, c.will.qos, c.will.retain) == (
            "nodes/node-7/status",
            b"offline",
            1,
            True,
        )
        if v5:
            assert c.properties == {"session_expiry_interval": 600, "receive_maximum": 9}
            assert c.will.properties == {"will_delay_interval": 5}

        # pubcomp -> paho: CONNACK with session present
        server.send(Connack(True, 0, {"receive_maximum": 7} if v5 else {}))
        assert done["connect"].wait(5) and events["session_present"] is True

        # paho -> pubcomp: a QoS 2 PUBLISH with a user property, through PUBCOMP
        pub_props = None
        if v5:
            pub_props = Properties(PacketTypes.PUBLISH)
            pub_props.UserProperty = ("unit", "C")
        client.publish("nodes/node-7/readings", b'{"t":21.5}', qos=2, properties=pub_props)
        p = server.expect(Publish)
        assert isinstance(p, Publish)
        assert (p.topic, p.payload, p.qos, p.dup, p.retain) == (
            "nodes/node-7/readings",
            b'{"t":21.5}',
            2,
            False,
            False,
        )
        assert p.packet_id and p.packet_id > 0
        if v5:
            assert p.properties == {"user_property": [("unit", "C")]}
        server.send(Pubrec(p.packet_id))
        rel = server.expect(Pubrel)  # decoding checks flags 0010 (MQTT-3.6.1-1)
        assert rel.packet_id == p.packet_id  # type: ignore[union-attr]
        server.send(Pubcomp(p.packet_id))
        assert done["publish"].wait(5)

        # pubcomp -> paho: a QoS 2 PUBLISH; paho answers PUBREC, then PUBCOMP
        server.send(Publish("cmd/node-7", b"reboot", 2, packet_id=4242))
        rec = server.expect(Pubrec)
        assert rec.packet_id == 4242  # type: ignore[union-attr]  # MQTT-2.3.1-6
        server.send(Pubrel(4242))
        comp = server.expect(Pubcomp)
        assert comp.packet_id == 4242  # type: ignore[union-attr]
        assert done["message"].wait(5) and events["message"] == ("cmd/node-7", b"reboot", 2)

        # SUBSCRIBE / SUBACK
        client.subscribe("cmd/#", qos=1)
        s = server.expect(Subscribe)
        assert isinstance(s, Subscribe)
        assert [(x.topic_filter, x.qos) for x in s.subscriptions] == [("cmd/#", 1)]
        server.send(Suback(s.packet_id, [1]))
        assert done["subscribe"].wait(5) and events["granted"] == [1]

        client.disconnect()
        server.expect(Disconnect)
    finally:
        client.loop_stop()
        server.close()
