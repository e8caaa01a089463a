"""The MQTT codec: round trips, malformed input, incremental decoding."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pubcomp.sync.codec import (
    PROPERTIES,
    Decoder,
    ProtocolError,
    decode_one,
    encode,
    encode_properties,
)
from pubcomp.sync.packets import (
    MQTT_5,
    MQTT_311,
    Auth,
    Connack,
    Connect,
    Disconnect,
    PacketType,
    Pingreq,
    Pingresp,
    Puback,
    Pubcomp,
    Publish,
    Pubrec,
    Pubrel,
    Reason,
    Suback,
    Subscribe,
    Subscription,
    Unsuback,
    Unsubscribe,
    Will,
)

VERSIONS = st.sampled_from([MQTT_311, MQTT_5])

# The reason codes of each packet type, copied from the MQTT 5.0 tables (section 3)
# by name, not from the codec: Table 3-1 Connect Reason Codes, 3-4 PUBACK, 3-5 PUBREC,
# 3-6 PUBREL, 3-7 PUBCOMP, 3-8 Subscribe, 3-9 Unsubscribe, 3-10 Disconnect, 3-11 Authenticate.
R = Reason
_PUB = {R.SUCCESS, R.NO_MATCHING_SUBSCRIBERS, R.UNSPECIFIED_ERROR,
        R.IMPLEMENTATION_SPECIFIC_ERROR, R.NOT_AUTHORIZED, R.TOPIC_NAME_INVALID,
        R.PACKET_IDENTIFIER_IN_USE, R.QUOTA_EXCEEDED, R.PAYLOAD_FORMAT_INVALID}  # fmt: skip
SPEC_REASON_CODES: dict[PacketType, set[int]] = {
    PacketType.CONNACK: {
        R.SUCCESS, R.UNSPECIFIED_ERROR, R.MALFORMED_PACKET, R.PROTOCOL_ERROR,
        R.IMPLEMENTATION_SPECIFIC_ERROR, R.UNSUPPORTED_PROTOCOL_VERSION,
        R.CLIENT_IDENTIFIER_NOT_VALID, R.BAD_USER_NAME_OR_PASSWORD, R.NOT_AUTHORIZED,
        R.SERVER_UNAVAILABLE, R.SERVER_BUSY, R.BANNED, R.BAD_AUTHENTICATION_METHOD,
        R.TOPIC_NAME_INVALID, R.PACKET_TOO_LARGE, R.QUOTA_EXCEEDED, R.PAYLOAD_FORMAT_INVALID,
        R.RETAIN_NOT_SUPPORTED, R.QOS_NOT_SUPPORTED, R.USE_ANOTHER_SERVER, R.SERVER_MOVED,
        R.CONNECTION_RATE_EXCEEDED,
    },
    PacketType.PUBACK: _PUB,
    PacketType.PUBREC: _PUB,
    PacketType.PUBREL: {R.SUCCESS, R.PACKET_IDENTIFIER_NOT_FOUND},
    PacketType.PUBCOMP: {R.SUCCESS, R.PACKET_IDENTIFIER_NOT_FOUND},
    PacketType.SUBACK: {
        R.SUCCESS, R.GRANTED_QOS_1, R.GRANTED_QOS_2, R.UNSPECIFIED_ERROR,
        R.IMPLEMENTATION_SPECIFIC_ERROR, R.NOT_AUTHORIZED, R.TOPIC_FILTER_INVALID,
        R.PACKET_IDENTIFIER_IN_USE, R.QUOTA_EXCEEDED, R.SHARED_SUBSCRIPTIONS_NOT_SUPPORTED,
        R.SUBSCRIPTION_IDENTIFIERS_NOT_SUPPORTED, R.WILDCARD_SUBSCRIPTIONS_NOT_SUPPORTED,
    },
    PacketType.UNSUBACK: {
        R.SUCCESS, R.NO_SUBSCRIPTION_EXISTED, R.UNSPECIFIED_ERROR,
        R.IMPLEMENTATION_SPECIFIC_ERROR, R.NOT_AUTHORIZED, R.TOPIC_FILTER_INVALID,
        R.PACKET_IDENTIFIER_IN_USE,
    },
    PacketType.DISCONNECT: {
        R.SUCCESS, R.DISCONNECT_WITH_WILL, R.UNSPECIFIED_ERROR, R.MALFORMED_PACKET,
        R.PROTOCOL_ERROR, R.IMPLEMENTATION_SPECIFIC_ERROR, R.NOT_AUTHORIZED, R.SERVER_BUSY,
        R.SERVER_SHUTTING_DOWN, R.KEEP_ALIVE_TIMEOUT, R.SESSION_TAKEN_OVER,
        R.TOPIC_FILTER_INVALID, R.TOPIC_NAME_INVALID, R.RECEIVE_MAXIMUM_EXCEEDED,
        R.TOPIC_ALIAS_INVALID, R.PACKET_TOO_LARGE, R.MESSAGE_RATE_TOO_HIGH, R.QUOTA_EXCEEDED,
        R.ADMINISTRATIVE_ACTION, R.PAYLOAD_FORMAT_INVALID, R.RETAIN_NOT_SUPPORTED,
        R.QOS_NOT_SUPPORTED, R.USE_ANOTHER_SERVER, R.SERVER_MOVED,
        R.SHARED_SUBSCRIPTIONS_NOT_SUPPORTED, R.CONNECTION_RATE_EXCEEDED,
        R.MAXIMUM_CONNECT_TIME, R.SUBSCRIPTION_IDENTIFIERS_NOT_SUPPORTED,
        R.WILDCARD_SUBSCRIPTIONS_NOT_SUPPORTED,
    },
    PacketType.AUTH: {R.SUCCESS, R.CONTINUE_AUTHENTICATION, R.RE_AUTHENTICATE},
}  # fmt: skip
text = st.text(
    st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=20
)
topic = text.filter(lambda t: t and "+" not in t and "#" not in t)
pid = st.integers(1, 0xFFFF)
u16 = st.integers(0, 0xFFFF)
u32 = st.integers(0, 0xFFFFFFFF)


def props_for(where: object) -> st.SearchStrategy[dict[str, object]]:
    """Hypothesis strategy for a valid property set of one packet type."""
    kinds = {
        0: st.integers(0, 1),
        1: st.integers(1, 0xFFFF),
        2: st.integers(1, 0xFFFFFFFF),
        3: st.integers(1, 268_435_455),
        4: st.binary(max_size=10),
        5: text,
        6: st.tuples(text, text),
    }
    fields = {}
    for _pid, (name, kind, allowed) in PROPERTIES.items():
        if where not in allowed:
            continue
        value = kinds[kind]
        if name in ("user_property", "subscription_identifier"):
            value = st.lists(value, min_size=1, max_size=3)
        fields[name] = value
    return st.fixed_dictionaries({}, optional=fields)


@st.composite
def packets(draw: st.DrawFn, version: int) -> object:
    v5 = version == MQTT_5

    def props(where: object) -> dict[str, object]:
        return draw(props_for(where)) if v5 else {}

    def reason(kind: PacketType) -> int:
        return draw(st.sampled_from(sorted(SPEC_REASON_CODES[kind]))) if v5 else 0

    kind = draw(st.sampled_from(list(PacketType)))
    if kind == PacketType.AUTH and not v5:
        kind = PacketType.PINGREQ
    if kind == PacketType.CONNECT:
        will = None
        if draw(st.booleans()):
            will = Will(
                draw(topic),
                draw(st.binary(max_size=20)),
                draw(st.integers(0, 2)),
                draw(st.booleans()),
                props("will"),
            )
        user = draw(st.none() | text)
        password = draw(st.none() | st.binary(max_size=10)) if (user is not None or v5) else None
        return Connect(
            draw(text),
            version,
            draw(st.booleans()),
            draw(u16),
            user,
            password,
            will,
            props(PacketType.CONNECT),
        )
    if kind == PacketType.CONNACK:
        return Connack(
            draw(st.booleans()),
            draw(st.integers(0, 5)) if not v5 else reason(kind),
            props(PacketType.CONNACK),
        )
    if kind == PacketType.PUBLISH:
        qos = draw(st.integers(0, 2))
        return Publish(
            draw(topic),
            draw(st.binary(max_size=50)),
            qos,
            draw(st.booleans()),
            draw(st.booleans()) if qos else False,
            draw(pid) if qos else None,
            props(PacketType.PUBLISH),
        )
    if kind in (PacketType.PUBACK, PacketType.PUBREC, PacketType.PUBREL, PacketType.PUBCOMP):
        cls = {4: Puback, 5: Pubrec, 6: Pubrel, 7: Pubcomp}[kind]
        return cls(draw(pid), reason(kind), props(kind))
    if kind == PacketType.SUBSCRIBE:
        subs = draw(
            st.lists(
                st.builds(
                    Subscription,
                    text.filter(bool),
                    st.integers(0, 2),
                    st.booleans() if v5 else st.just(False),
                    st.booleans() if v5 else st.just(False),
                    st.integers(0, 2) if v5 else st.just(0),
                ),
                min_size=1,
                max_size=3,
            )
        )
        return Subscribe(draw(pid), subs, props(PacketType.SUBSCRIBE))
    if kind == PacketType.SUBACK:
        allowed = sorted(SPEC_REASON_CODES[kind]) if v5 else [0, 1, 2, 0x80]
        codes = draw(st.lists(st.sampled_from(allowed), min_size=1, max_size=4))
        return Suback(draw(pid), codes, props(PacketType.SUBACK))
    if kind == PacketType.UNSUBSCRIBE:
        return Unsubscribe(
            draw(pid), draw(st.lists(text, min_size=1, max_size=3)), props(PacketType.UNSUBSCRIBE)
        )
    if kind == PacketType.UNSUBACK:
        allowed = sorted(SPEC_REASON_CODES[kind])
        codes = draw(st.lists(st.sampled_from(allowed), min_size=1, max_size=3)) if v5 else []
        return Unsuback(draw(pid), codes, props(PacketType.UNSUBACK))
    if kind == PacketType.PINGREQ:
        return Pingreq()
    if kind == PacketType.PINGRESP:
        return Pingresp()
    if kind == PacketType.DISCONNECT:
        return Disconnect(reason(kind), props(PacketType.DISCONNECT))
    return Auth(reason(kind), props(PacketType.AUTH))


@st.composite
def versioned_packet(draw: st.DrawFn) -> tuple[int, object]:
    v = draw(VERSIONS)
    return v, draw(packets(v))


@settings(max_examples=600, deadline=None)
@given(versioned_packet())
def test_every_packet_type_round_trips(vp: tuple[int, object]) -> None:
    version, pkt = vp
    assert decode_one(encode(pkt, version), version) == pkt  # type: ignore[arg-type]


@settings(max_examples=150, deadline=None)
@given(st.lists(versioned_packet(), min_size=1, max_size=8), st.data())
def test_incremental_decoder_any_split(vps: list[tuple[int, object]], data: st.DataObject) -> None:
    """Feeding a stream in arbitrary pieces yields the same packets in the same order."""
    version = vps[0][0]
    pkts = [p for v, p in vps if v == version and not isinstance(p, Connect)]
    stream = b"".join(encode(p, version) for p in pkts)  # type: ignore[arg-type]
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=10)))
    dec = Decoder(version)
    out = []
    prev = 0
    for c in [*cuts, len(stream)]:
        out += dec.feed(stream[prev:c])
        prev = c
    assert out == pkts


def test_pubrel_fixed_header_flags_are_0010() -> None:
    # MQTT-3.6.1-1
    assert encode(Pubrel(7), MQTT_311)[0] == 0x62
    with pytest.raises(ProtocolError, match="PUBREL flags 0000"):
        decode_one(b"\x60\x02\x00\x07", MQTT_311)


MALFORMED = [
    # (description, bytes, version, message fragment)
    ("remaining length of five bytes", b"\x30\xff\xff\xff\xff\x01", MQTT_5, "longer than 4"),
    ("PUBLISH with QoS 3 (MQTT-3.3.1-4)", b"\x36\x05\x00\x01a\x00\x01", MQTT_5, "both QoS"),
    ("QoS 0 PUBLISH with DUP (MQTT-3.3.1-2)", b"\x38\x03\x00\x01a", MQTT_311, "DUP=1"),
    ("PUBLISH packet id 0 (MQTT-2.3.1-1)", b"\x32\x05\x00\x01a\x00\x00", MQTT_311, "identifier 0"),
    ("PUBACK with reserved flags", b"\x41\x02\x00\x01", MQTT_311, "PUBACK flags"),
    ("SUBSCRIBE with flags 0000", b"\x80\x06\x00\x01\x00\x01a\x00", MQTT_311, "SUBSCRIBE flags"),
    ("reserved packet type 0", b"\x00\x00", MQTT_311, "reserved packet type"),
    ("truncated topic", b"\x30\x03\x00\x05a", MQTT_311, "truncated"),
    ("topic with wildcard", b"\x30\x05\x00\x03a/#", MQTT_311, "wildcard"),
    ("invalid UTF-8 topic", b"\x30\x04\x00\x02\xc3\x28", MQTT_311, "UTF-8"),
    ("U+0000 in topic", b"\x30\x04\x00\x02a\x00", MQTT_311, r"U\+0000"),
    ("PINGREQ with a body", b"\xc0\x01\x00", MQTT_311, "trailing"),
    ("property length past packet", b"\x40\x05\x00\x01\x00\x09\x1f", MQTT_5, "property length"),
    ("truncated property", b"\x40\x06\x00\x01\x00\x02\x1f\x00", MQTT_5, "truncated"),
    ("unknown property id", b"\x40\x06\x00\x01\x00\x02\x7f\x00", MQTT_5, "unknown property"),
    (
        "property not allowed in PUBACK",
        b"\x40\x07\x00\x01\x00\x03\x21\x00\x05",
        MQTT_5,
        "not allowed",
    ),
    ("duplicate property", b"\x40\x0c\x00\x01\x00\x08" + b"\x1f\x00\x01a" * 2, MQTT_5, "twice"),
    ("receive maximum 0", b"\x20\x06\x00\x00\x03\x21\x00\x00", MQTT_5, "invalid value"),
    (
        "CONNECT reserved flag (MQTT-3.1.2-3)",
        b"\x10\x0d\x00\x04MQTT\x04\x03\x00\x3c\x00\x01c",
        None,
        "reserved flag",
    ),
    ("CONNECT with will QoS 3", b"\x10\x0d\x00\x04MQTT\x04\x1c\x00\x3c\x00\x01c", None, "will QoS"),
    (
        "CONNECT with an unknown protocol level",
        b"\x10\x0d\x00\x04MQTT\x03\x02\x00\x3c\x00\x01c",
        None,
        "unsupported protocol",
    ),
    ("first packet not CONNECT", b"\xc0\x00", None, "not CONNECT"),
    ("AUTH in MQTT 3.1.1", b"\xf0\x00", MQTT_311, "AUTH"),
    ("CONNACK reserved flags", b"\x20\x02\x02\x00", MQTT_311, "CONNACK reserved"),
]


@pytest.mark.parametrize(
    ("data", "version", "fragment"),
    [m[1:] for m in MALFORMED],
    ids=[m[0] for m in MALFORMED],
)
def test_malformed_input_raises_protocol_error(
    data: bytes, version: int | None, fragment: str
) -> None:
    dec = Decoder(version)
    with pytest.raises(ProtocolError, match=fragment):
        dec.feed(data)
    # A spent decoder refuses more input instead of resynchronising on garbage.
    with pytest.raises(ProtocolError):
        dec.feed(b"\xc0\x00")


def test_packet_over_maximum_size_is_refused_before_it_is_buffered() -> None:
    dec = Decoder(MQTT_5, max_packet_size=1000)
    header = b"\x30" + bytes([0x80 | (5000 & 0x7F), 5000 >> 7])
    with pytest.raises(ProtocolError, match="exceeds the maximum") as err:
        dec.feed(header)  # the body has not arrived: refused on the header alone
    assert err.value.reason == 0x95


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64), VERSIONS)
def test_random_bytes_never_raise_anything_but_protocol_error(data: bytes, version: int) -> None:
    with contextlib.suppress(ProtocolError):
        Decoder(version).feed(data)


def test_puback_reason_and_properties_are_optional_in_v5() -> None:
    # 5.0 3.4.2.1: reason 0 with no properties may be sent as 2 bytes; 3 bytes means no props.
    assert decode_one(b"\x40\x02\x00\x05") == Puback(5)
    assert decode_one(b"\x40\x03\x00\x05\x10") == Puback(5, 0x10)
    assert encode(Puback(5)) == b"\x40\x02\x00\x05"


def test_property_encoding_matches_paho() -> None:
    """paho-mqtt's own Properties.pack() is an independent oracle for property bytes."""
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.properties import Properties

    p = Properties(PacketTypes.CONNECT)
    p.SessionExpiryInterval = 3600
    p.ReceiveMaximum = 20
    p.MaximumPacketSize = 65536
    p.UserProperty = [("site", "cabinet 7"), ("fw", "1.2")]
    ours = encode_properties(
        {
            "session_expiry_interval": 3600,
            "receive_maximum": 20,
            "user_property": [("site", "cabinet 7"), ("fw", "1.2")],
            "maximum_packet_size": 65536,
        }
    )
    # paho packs in its own property order; compare as decoded sets and as lengths.
    theirs = p.pack()
    assert len(ours) == len(theirs)
    back = Properties(PacketTypes.CONNECT)
    back.unpack(ours)
    assert back.SessionExpiryInterval == 3600
    assert back.ReceiveMaximum == 20
    assert back.MaximumPacketSize == 65536
    assert back.UserProperty == [("site", "cabinet 7"), ("fw", "1.2")]


def test_qos0_publish_has_no_packet_id_MQTT_2_3_1_5() -> None:
    data = encode(Publish("a", b"x", 0, packet_id=9), MQTT_311)
    assert data == b"\x30\x04\x00\x01ax"
    assert decode_one(data, MQTT_311).packet_id is None  # type: ignore[union-attr]


# ------------------------------------------------------- reason-code tables

# One packet per type carrying the reason code ``c``, as a broker would send it.
_WITH_CODE_5: dict[PacketType, tuple[str, Callable[[int], bytes]]] = {
    PacketType.CONNACK: ("MQTT-3.2.2-8", lambda c: bytes([0x20, 3, 0, c, 0])),
    PacketType.PUBACK: ("MQTT-3.4.2-1", lambda c: bytes([0x40, 4, 0, 1, c, 0])),
    PacketType.PUBREC: ("MQTT-3.5.2-1", lambda c: bytes([0x50, 4, 0, 1, c, 0])),
    PacketType.PUBREL: ("MQTT-3.6.2-1", lambda c: bytes([0x62, 4, 0, 1, c, 0])),
    PacketType.PUBCOMP: ("MQTT-3.7.2-1", lambda c: bytes([0x70, 4, 0, 1, c, 0])),
    PacketType.SUBACK: ("MQTT-3.9.3-2", lambda c: bytes([0x90, 5, 0, 1, 0, 0, c])),
    PacketType.UNSUBACK: ("MQTT-3.11.3-2", lambda c: bytes([0xB0, 5, 0, 1, 0, 0, c])),
    PacketType.DISCONNECT: ("MQTT-3.14.2-1", lambda c: bytes([0xE0, 2, c, 0])),
    PacketType.AUTH: ("MQTT-3.15.2-1", lambda c: bytes([0xF0, 2, c, 0])),
}


@pytest.mark.parametrize("ptype", list(_WITH_CODE_5), ids=lambda t: t.name)
def test_every_reason_code_is_checked_against_its_packet_table_5_0(ptype: PacketType) -> None:
    """The sender MUST use one of its packet type's reason codes (the statement id is in
    the table above); any other byte is a malformed packet and the connection is closed
    with a protocol error (5.0 section 4.13). Every byte value, every packet type."""
    statement, packet = _WITH_CODE_5[ptype]
    for code in range(256):
        if code in SPEC_REASON_CODES[ptype]:
            assert decode_one(packet(code), MQTT_5).type == ptype, (statement, hex(code))
        else:
            with pytest.raises(ProtocolError, match="reason code") as exc:
                decode_one(packet(code), MQTT_5)
            assert exc.value.reason == Reason.PROTOCOL_ERROR, (statement, hex(code))


def test_puback_with_undefined_reason_0xff_is_a_protocol_error_not_a_refusal() -> None:
    """Mosquitto's msg_sequence case: ``40 04 00 01 ff 00`` (MQTT-3.4.2-1)."""
    with pytest.raises(ProtocolError, match="PUBACK reason code 0xff"):
        Decoder(MQTT_5).feed(bytes.fromhex("40 04 00 01 ff 00"))


@pytest.mark.parametrize(
    ("ptype", "packet", "defined"),
    [
        # 3.1.1 section 3.2.2.3: CONNACK return codes 0-5; 6-255 are reserved.
        (PacketType.CONNACK, lambda c: bytes([0x20, 2, 0, c]), set(range(6))),
        # MQTT-3.9.3-2 (3.1.1): SUBACK return codes other than 0x00, 0x01, 0x02 and 0x80
        # are reserved and MUST NOT be used.
        (PacketType.SUBACK, lambda c: bytes([0x90, 3, 0, 1, c]), {0, 1, 2, 0x80}),
    ],
    ids=["CONNACK", "SUBACK"],
)
def test_every_return_code_is_checked_in_3_1_1(
    ptype: PacketType, packet: Callable[[int], bytes], defined: set[int]
) -> None:
    for code in range(256):
        if code in defined:
            assert decode_one(packet(code), MQTT_311).type == ptype
        else:
            with pytest.raises(ProtocolError, match="reason code"):
                decode_one(packet(code), MQTT_311)
