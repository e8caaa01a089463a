"""MQTT 3.1.1 / 5.0 wire codec: ``encode(packet, version)`` and an incremental ``Decoder``.

The decoder is fed whatever bytes arrive and returns whole packets. Anything the
specifications call malformed or a protocol error raises ``ProtocolError``; the
caller closes that connection (MQTT-4.8.0-1) and the process goes on.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

from .errors import ProtocolError as ProtocolError
from .packets import (
    MQTT_5,
    MQTT_311,
    Auth,
    Connack,
    Connect,
    Disconnect,
    Packet,
    PacketType,
    Pingreq,
    Pingresp,
    Properties,
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

MAX_REMAINING_LENGTH = 268_435_455


# ---------------------------------------------------------------- properties

_BYTE, _U16, _U32, _VARINT, _BINARY, _UTF8, _PAIR = range(7)
_P = PacketType
_WILL = "will"  # properties inside the CONNECT payload's will

# id: (name, type, packets where it may appear)
PROPERTIES: dict[int, tuple[str, int, frozenset[Any]]] = {
    0x01: ("payload_format_indicator", _BYTE, frozenset({_P.PUBLISH, _WILL})),
    0x02: ("message_expiry_interval", _U32, frozenset({_P.PUBLISH, _WILL})),
    0x03: ("content_type", _UTF8, frozenset({_P.PUBLISH, _WILL})),
    0x08: ("response_topic", _UTF8, frozenset({_P.PUBLISH, _WILL})),
    0x09: ("correlation_data", _BINARY, frozenset({_P.PUBLISH, _WILL})),
    0x0B: ("subscription_identifier", _VARINT, frozenset({_P.PUBLISH, _P.SUBSCRIBE})),
    0x11: ("session_expiry_interval", _U32, frozenset({_P.CONNECT, _P.CONNACK, _P.DISCONNECT})),
    0x12: ("assigned_client_identifier", _UTF8, frozenset({_P.CONNACK})),
    0x13: ("server_keep_alive", _U16, frozenset({_P.CONNACK})),
    0x15: ("authentication_method", _UTF8, frozenset({_P.CONNECT, _P.CONNACK, _P.AUTH})),
    0x16: ("authentication_data", _BINARY, frozenset({_P.CONNECT, _P.CONNACK, _P.AUTH})),
    0x17: ("request_problem_information", _BYTE, frozenset({_P.CONNECT})),
    0x18: ("will_delay_interval", _U32, frozenset({_WILL})),
    0x19: ("request_response_information", _BYTE, frozenset({_P.CONNECT})),
    0x1A: ("response_information", _UTF8, frozenset({_P.CONNACK})),
    0x1C: ("server_reference", _UTF8, frozenset({_P.CONNACK, _P.DISCONNECT})),
    0x1F: (
        "reason_string",
        _UTF8,
        frozenset(
            {
                _P.CONNACK,
                _P.PUBACK,
                _P.PUBREC,
                _P.PUBREL,
                _P.PUBCOMP,
                _P.SUBACK,
                _P.UNSUBACK,
                _P.DISCONNECT,
                _P.AUTH,
            }
        ),
    ),
    0x21: ("receive_maximum", _U16, frozenset({_P.CONNECT, _P.CONNACK})),
    0x22: ("topic_alias_maximum", _U16, frozenset({_P.CONNECT, _P.CONNACK})),
    0x23: ("topic_alias", _U16, frozenset({_P.PUBLISH})),
    0x24: ("maximum_qos", _BYTE, frozenset({_P.CONNACK})),
    0x25: ("retain_available", _BYTE, frozenset({_P.CONNACK})),
    0x26: ("user_property", _PAIR, frozenset(set(_P) | {_WILL})),
    0x27: ("maximum_packet_size", _U32, frozenset({_P.CONNECT, _P.CONNACK})),
    0x28: ("wildcard_subscription_available", _BYTE, frozenset({_P.CONNACK})),
    0x29: ("subscription_identifier_available", _BYTE, frozenset({_P.CONNACK})),
    0x2A: ("shared_subscription_available", _BYTE, frozenset({_P.CONNACK})),
}
PROPERTY_IDS = {name: (pid, kind) for pid, (name, kind, _) in PROPERTIES.items()}
# Properties that may appear more than once; their value is a list.
MULTI = frozenset({"user_property", "subscription_identifier"})


# -------------------------------------------------------------- primitives


def encode_varint(n: int) -> bytes:
    if not 0 <= n <= MAX_REMAINING_LENGTH:
        raise ValueError(f"variable byte integer out of range: {n}")
    out = bytearray()
    while True:
        n, digit = divmod(n, 128)
        out.append(digit | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _utf8(s: str) -> bytes:
    b = s.encode("utf-8")
    if len(b) > 0xFFFF:
        raise ValueError("UTF-8 string longer than 65535 bytes")
    return struct.pack("!H", len(b)) + b


def _binary(b: bytes) -> bytes:
    if len(b) > 0xFFFF:
        raise ValueError("binary data longer than 65535 bytes")
    return struct.pack("!H", len(b)) + b


def encode_properties(props: Properties) -> bytes:
    body = bytearray()
    for name, value in props.items():
        try:
            pid, kind = PROPERTY_IDS[name]
        except KeyError:
            raise ValueError(f"unknown MQTT 5 property {name!r}") from None
        for v in value if name in MULTI else (value,):
            body += encode_varint(pid)
            if kind == _BYTE:
                body.append(v)
            elif kind == _U16:
                body += struct.pack("!H", v)
            elif kind == _U32:
                body += struct.pack("!I", v)
            elif kind == _VARINT:
                body += encode_varint(v)
            elif kind == _BINARY:
                body += _binary(v)
            elif kind == _UTF8:
                body += _utf8(v)
            else:
                body += _utf8(v[0]) + _utf8(v[1])
    return encode_varint(len(body)) + bytes(body)


# ------------------------------------------------------------------ encoder


def _fixed(ptype: int, flags: int, body: bytes) -> bytes:
    return bytes([(ptype << 4) | flags]) + encode_varint(len(body)) + body


def _ack_body(pkt: Puback | Pubrec | Pubrel | Pubcomp, v5: bool) -> bytes:
    body = struct.pack("!H", pkt.packet_id)
    if v5 and (pkt.reason_code or pkt.properties):
        body += bytes([pkt.reason_code])
        if pkt.properties:
            body += encode_properties(pkt.properties)
    return body


def _props(props: Properties, v5: bool) -> bytes:
    return encode_properties(props) if v5 else b""


# Each packet type's encoder: (flags of the fixed header, body), as the decoder's
# table (_DECODERS) reads them back. ``v5``: MQTT 5.0 (else 3.1.1).
def _enc_publish(pkt: Publish, v5: bool) -> tuple[int, bytes]:
    if pkt.qos not in (0, 1, 2):
        raise ValueError("QoS must be 0, 1 or 2")  # MQTT-3.3.1-4
    body = _utf8(pkt.topic)
    if pkt.qos:
        if not pkt.packet_id:
            raise ValueError("QoS>0 PUBLISH needs a non-zero packet id")  # MQTT-2.3.1-1
        body += struct.pack("!H", pkt.packet_id)
    flags = (pkt.dup << 3) | (pkt.qos << 1) | pkt.retain
    return flags, body + _props(pkt.properties, v5) + pkt.payload


def _enc_ack(pkt: Puback | Pubrec | Pubcomp, v5: bool) -> tuple[int, bytes]:
    return 0, _ack_body(pkt, v5)


def _enc_pubrel(pkt: Pubrel, v5: bool) -> tuple[int, bytes]:
    return 0b0010, _ack_body(pkt, v5)  # MQTT-3.6.1-1


def _enc_connect(pkt: Connect, v5: bool) -> tuple[int, bytes]:
    return 0, _connect_body(pkt)  # (its own protocol level decides)


def _enc_connack(pkt: Connack, v5: bool) -> tuple[int, bytes]:
    return 0, bytes([int(pkt.session_present), pkt.reason_code]) + _props(pkt.properties, v5)


def _enc_subscribe(pkt: Subscribe, v5: bool) -> tuple[int, bytes]:
    body = struct.pack("!H", pkt.packet_id) + _props(pkt.properties, v5)
    for s in pkt.subscriptions:
        opts = s.qos
        if v5:
            opts |= (s.no_local << 2) | (s.retain_as_published << 3) | (s.retain_handling << 4)
        body += _utf8(s.topic_filter) + bytes([opts])
    return 0b0010, body


def _enc_suback(pkt: Suback, v5: bool) -> tuple[int, bytes]:
    body = struct.pack("!H", pkt.packet_id) + _props(pkt.properties, v5)
    return 0, body + bytes(pkt.reason_codes)


def _enc_unsubscribe(pkt: Unsubscribe, v5: bool) -> tuple[int, bytes]:
    body = struct.pack("!H", pkt.packet_id) + _props(pkt.properties, v5)
    return 0b0010, body + b"".join(_utf8(f) for f in pkt.topic_filters)


def _enc_unsuback(pkt: Unsuback, v5: bool) -> tuple[int, bytes]:
    body = struct.pack("!H", pkt.packet_id)
    if v5:  # 3.1.1's UNSUBACK has no reason codes
        body += encode_properties(pkt.properties) + bytes(pkt.reason_codes)
    return 0, body


def _enc_empty(pkt: Pingreq | Pingresp, v5: bool) -> tuple[int, bytes]:
    return 0, b""


def _enc_reason(pkt: Disconnect | Auth, v5: bool) -> tuple[int, bytes]:
    if pkt.type == PacketType.AUTH and not v5:
        raise ValueError("AUTH exists only in MQTT 5.0")
    body = b""
    if v5 and (pkt.reason_code or pkt.properties):
        body = bytes([pkt.reason_code]) + (
            encode_properties(pkt.properties) if pkt.properties else b""
        )
    return 0, body


_ENCODERS: dict[int, Callable[[Any, bool], tuple[int, bytes]]] = {
    PacketType.CONNECT: _enc_connect,
    PacketType.CONNACK: _enc_connack,
    PacketType.PUBLISH: _enc_publish,
    PacketType.PUBACK: _enc_ack,
    PacketType.PUBREC: _enc_ack,
    PacketType.PUBREL: _enc_pubrel,
    PacketType.PUBCOMP: _enc_ack,
    PacketType.SUBSCRIBE: _enc_subscribe,
    PacketType.SUBACK: _enc_suback,
    PacketType.UNSUBSCRIBE: _enc_unsubscribe,
    PacketType.UNSUBACK: _enc_unsuback,
    PacketType.PINGREQ: _enc_empty,
    PacketType.PINGRESP: _enc_empty,
    PacketType.DISCONNECT: _enc_reason,
    PacketType.AUTH: _enc_reason,
}


def encode(pkt: Packet, version: int = MQTT_5) -> bytes:
    """Serialise one packet for the given protocol level (4 = 3.1.1, 5 = 5.0)."""
    encoder = _ENCODERS.get(getattr(pkt, "type", -1))
    if encoder is None:
        raise ValueError(f"cannot encode {pkt!r}")
    flags, body = encoder(pkt, version == MQTT_5)
    return _fixed(pkt.type, flags, body)


def _connect_body(pkt: Connect) -> bytes:
    v5 = pkt.protocol_level == MQTT_5
    will = pkt.will
    flags = (
        (pkt.username is not None) << 7
        | (pkt.password is not None) << 6
        | ((will.retain if will else 0) << 5)
        | ((will.qos if will else 0) << 3)
        | ((will is not None) << 2)
        | (pkt.clean_start << 1)
    )
    body = _utf8("MQTT") + bytes([pkt.protocol_level, flags]) + struct.pack("!H", pkt.keepalive)
    if v5:
        body += encode_properties(pkt.properties)
    body += _utf8(pkt.client_id)
    if will:
        if v5:
            body += encode_properties(will.properties)
        body += _utf8(will.topic) + _binary(will.payload)
    if pkt.username is not None:
        body += _utf8(pkt.username)
    if pkt.password is not None:
        body += _binary(pkt.password)
    return body


# ------------------------------------------------------------------ decoder


class _Reader:
    """Cursor over one packet's body; every read checks the bounds."""

    __slots__ = ("buf", "end", "pos")

    def __init__(self, buf: bytes) -> None:
        self.buf = buf
        self.pos = 0
        self.end = len(buf)

    def remaining(self) -> int:
        return self.end - self.pos

    def take(self, n: int) -> bytes:
        if self.pos + n > self.end:
            raise ProtocolError("packet truncated")
        b = self.buf[self.pos : self.pos + n]
        self.pos += n
        return b

    def byte(self) -> int:
        return self.take(1)[0]

    def u16(self) -> int:
        return int.from_bytes(self.take(2), "big")

    def u32(self) -> int:
        return int.from_bytes(self.take(4), "big")

    def varint(self) -> int:
        value, shift = 0, 0
        for _ in range(4):
            b = self.byte()
            value |= (b & 0x7F) << shift
            if not b & 0x80:
                return value
            shift += 7
        raise ProtocolError("variable byte integer longer than 4 bytes")

    def binary(self) -> bytes:
        return self.take(self.u16())

    def utf8(self) -> str:
        raw = self.binary()
        try:
            s = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise ProtocolError("string is not well-formed UTF-8") from None
        if "\x00" in s:
            raise ProtocolError("string contains U+0000")  # MQTT-1.5.4-2
        return s

    def rest(self) -> bytes:
        return self.take(self.remaining())

    def done(self, what: str) -> None:
        if self.pos != self.end:
            raise ProtocolError(f"{what}: {self.end - self.pos} unexpected trailing bytes")


def decode_properties(r: _Reader, where: Any) -> Properties:
    length = r.varint()
    if length > r.remaining():
        raise ProtocolError("property length runs past the packet")
    end = r.pos + length
    props: Properties = {}
    sub = _Reader(r.buf)
    sub.pos, sub.end = r.pos, end
    while sub.pos < end:
        pid = sub.varint()
        spec = PROPERTIES.get(pid)
        if spec is None:
            raise ProtocolError(f"unknown property id 0x{pid:02x}")
        name, kind, allowed = spec
        if where not in allowed:
            raise ProtocolError(f"property {name} is not allowed in {where}", Reason.PROTOCOL_ERROR)
        if kind == _BYTE:
            v: Any = sub.byte()
        elif kind == _U16:
            v = sub.u16()
        elif kind == _U32:
            v = sub.u32()
        elif kind == _VARINT:
            v = sub.varint()
        elif kind == _BINARY:
            v = sub.binary()
        elif kind == _UTF8:
            v = sub.utf8()
        else:
            v = (sub.utf8(), sub.utf8())
        if (name in _NONZERO and v == 0) or (name in _BOOLEAN and v > 1):
            raise ProtocolError(f"property {name} has the invalid value {v}", Reason.PROTOCOL_ERROR)
        if name in MULTI:
            props.setdefault(name, []).append(v)
        elif name in props:
            raise ProtocolError(f"property {name} appears twice", Reason.PROTOCOL_ERROR)
        else:
            props[name] = v
    r.pos = end
    return props


# Values the specification calls a protocol error (MQTT 5.0 section 3.x.2.x).
_NONZERO = frozenset(
    {"receive_maximum", "maximum_packet_size", "topic_alias", "subscription_identifier"}
)
_BOOLEAN = frozenset(
    {
        "payload_format_indicator",
        "request_problem_information",
        "request_response_information",
        "maximum_qos",
        "retain_available",
        "wildcard_subscription_available",
        "subscription_identifier_available",
        "shared_subscription_available",
    }
)

_FLAGS_0010 = frozenset({PacketType.PUBREL, PacketType.SUBSCRIBE, PacketType.UNSUBSCRIBE})

# The reason codes each packet type may carry: the MQTT 5.0 tables of section 3
# (Table 3-1 CONNACK, 3-4 PUBACK, 3-5 PUBREC, 3-6 PUBREL, 3-7 PUBCOMP, 3-8 SUBACK,
# 3-9 UNSUBACK, 3-10 DISCONNECT, 3-11 AUTH). A sender MUST use one of them
# (MQTT-3.2.2-8, 3.4.2-1, 3.5.2-1, 3.6.2-1, 3.7.2-1, 3.9.3-2, 3.11.3-2, 3.14.2-1,
# 3.15.2-1); any other value is a malformed packet, and the receiver closes the
# connection (5.0 section 4.13). Section 2.4 also lists 0x8C for DISCONNECT, which
# Table 3-10 does not: the packet's own table is followed.


def _codes(table: str) -> frozenset[int]:
    return frozenset(int(c, 16) for c in table.split())


_PUB_ACK_CODES = _codes("00 10 80 83 87 90 91 97 99")
REASON_CODES_5: dict[int, frozenset[int]] = {
    PacketType.CONNACK: _codes("00 80 81 82 83 84 85 86 87 88 89 8A 8C 90 95 97 99 9A 9B 9C 9D 9F"),
    PacketType.PUBACK: _PUB_ACK_CODES,
    PacketType.PUBREC: _PUB_ACK_CODES,
    PacketType.PUBREL: _codes("00 92"),
    PacketType.PUBCOMP: _codes("00 92"),
    PacketType.SUBACK: _codes("00 01 02 80 83 87 8F 91 97 9E A1 A2"),
    PacketType.UNSUBACK: _codes("00 11 80 83 87 8F 91"),
    PacketType.DISCONNECT: _codes(
        "00 04 80 81 82 83 87 89 8B 8D 8E 8F 90 93 94 95 96 97 98 99 9A 9B 9C 9D 9E 9F A0 A1 A2"
    ),
    PacketType.AUTH: _codes("00 18 19"),
}
# MQTT 3.1.1 has return codes in two packets only: CONNACK 0-5 (6-255 reserved,
# section 3.2.2.3) and SUBACK 0x00, 0x01, 0x02, 0x80 (MQTT-3.9.3-2: others are
# reserved and MUST NOT be used).
RETURN_CODES_311: dict[int, frozenset[int]] = {
    PacketType.CONNACK: frozenset(range(6)),
    PacketType.SUBACK: frozenset({0x00, 0x01, 0x02, 0x80}),
}


def _check_reason(ptype: PacketType, code: int, version: int) -> None:
    table = REASON_CODES_5 if version == MQTT_5 else RETURN_CODES_311
    if code not in table[ptype]:
        raise ProtocolError(
            f"{ptype.name} reason code 0x{code:02x} is not defined for it", Reason.PROTOCOL_ERROR
        )


def _check_topic_name(topic: str) -> None:
    if "+" in topic or "#" in topic:
        raise ProtocolError("topic name contains a wildcard", Reason.TOPIC_NAME_INVALID)


def _packet_id(r: _Reader) -> int:
    pid = r.u16()
    if pid == 0:
        raise ProtocolError("packet identifier 0", Reason.PROTOCOL_ERROR)  # MQTT-2.3.1-1
    return pid


def _d_connect(r: _Reader, flags: int, version: int | None) -> Connect:
    name = r.utf8()
    level = r.byte()
    if name != "MQTT" or level not in (MQTT_311, MQTT_5):
        raise ProtocolError(
            f"unsupported protocol {name!r} level {level}", Reason.UNSUPPORTED_PROTOCOL_VERSION
        )
    cflags = r.byte()
    if cflags & 1:
        raise ProtocolError("CONNECT reserved flag set")  # MQTT-3.1.2-3
    has_will = bool(cflags & 0x04)
    will_qos = (cflags >> 3) & 3
    will_retain = bool(cflags & 0x20)
    if will_qos == 3:
        raise ProtocolError("will QoS 3")  # MQTT-3.1.2-14
    if not has_will and (will_qos or will_retain):
        raise ProtocolError("will QoS/retain set without will flag")  # MQTT-3.1.2-13/-15
    has_user, has_pass = bool(cflags & 0x80), bool(cflags & 0x40)
    if level == MQTT_311 and has_pass and not has_user:
        raise ProtocolError("password without user name")  # MQTT-3.1.2-22
    keepalive = r.u16()
    props = decode_properties(r, PacketType.CONNECT) if level == MQTT_5 else {}
    client_id = r.utf8()
    will = None
    if has_will:
        wprops = decode_properties(r, _WILL) if level == MQTT_5 else {}
        will = Will(r.utf8(), r.binary(), will_qos, will_retain, wprops)
        _check_topic_name(will.topic)
    username = r.utf8() if has_user else None
    password = r.binary() if has_pass else None
    r.done("CONNECT")
    return Connect(client_id, level, bool(cflags & 2), keepalive, username, password, will, props)


def _d_publish(r: _Reader, flags: int, version: int) -> Publish:
    dup, qos, retain = bool(flags & 8), (flags >> 1) & 3, bool(flags & 1)
    if qos == 3:
        raise ProtocolError("PUBLISH with both QoS bits set")  # MQTT-3.3.1-4
    if qos == 0 and dup:
        raise ProtocolError("QoS 0 PUBLISH with DUP=1")  # MQTT-3.3.1-2
    topic = r.utf8()
    _check_topic_name(topic)
    pid = _packet_id(r) if qos else None
    props = decode_properties(r, PacketType.PUBLISH) if version == MQTT_5 else {}
    if not topic and "topic_alias" not in props:
        raise ProtocolError("empty topic name", Reason.TOPIC_NAME_INVALID)
    return Publish(topic, r.rest(), qos, retain, dup, pid, props)


def _d_ack(cls: Callable[..., Any]) -> Callable[[_Reader, int, int], Any]:
    ptype = cls.type  # type: ignore[attr-defined]

    def decode_ack(r: _Reader, flags: int, version: int) -> Any:
        pid = _packet_id(r)
        code, props = 0, {}
        if version == MQTT_5 and r.remaining():
            code = r.byte()
            _check_reason(ptype, code, version)
            if r.remaining():
                props = decode_properties(r, ptype)
        r.done(ptype.name)
        return cls(pid, code, props)

    return decode_ack


def _d_connack(r: _Reader, flags: int, version: int) -> Connack:
    ack_flags = r.byte()
    if ack_flags & 0xFE:
        raise ProtocolError("CONNACK reserved flags set")
    code = r.byte()
    _check_reason(PacketType.CONNACK, code, version)
    props = decode_properties(r, PacketType.CONNACK) if version == MQTT_5 else {}
    r.done("CONNACK")
    return Connack(bool(ack_flags & 1), code, props)


def _d_subscribe(r: _Reader, flags: int, version: int) -> Subscribe:
    pid = _packet_id(r)
    props = decode_properties(r, PacketType.SUBSCRIBE) if version == MQTT_5 else {}
    subs = []
    while r.remaining():
        topic = r.utf8()
        opts = r.byte()
        reserved = 0xC0 if version == MQTT_5 else 0xFC
        if opts & reserved or opts & 3 == 3 or (opts >> 4) & 3 == 3:
            raise ProtocolError("SUBSCRIBE options reserved bits set")  # MQTT-3.8.3-4/5
        subs.append(
            Subscription(topic, opts & 3, bool(opts & 4), bool(opts & 8), (opts >> 4) & 3)
            if version == MQTT_5
            else Subscription(topic, opts & 3)
        )
    if not subs:
        raise ProtocolError("SUBSCRIBE without a topic filter", Reason.PROTOCOL_ERROR)
    return Subscribe(pid, subs, props)


def _d_suback(r: _Reader, flags: int, version: int) -> Suback:
    pid = _packet_id(r)
    props = decode_properties(r, PacketType.SUBACK) if version == MQTT_5 else {}
    codes = list(r.rest())
    for code in codes:
        _check_reason(PacketType.SUBACK, code, version)
    return Suback(pid, codes, props)


def _d_unsubscribe(r: _Reader, flags: int, version: int) -> Unsubscribe:
    pid = _packet_id(r)
    props = decode_properties(r, PacketType.UNSUBSCRIBE) if version == MQTT_5 else {}
    filters = []
    while r.remaining():
        filters.append(r.utf8())
    if not filters:
        raise ProtocolError("UNSUBSCRIBE without a topic filter", Reason.PROTOCOL_ERROR)
    return Unsubscribe(pid, filters, props)


def _d_unsuback(r: _Reader, flags: int, version: int) -> Unsuback:
    pid = _packet_id(r)
    if version != MQTT_5:
        r.done("UNSUBACK")
        return Unsuback(pid)
    props = decode_properties(r, PacketType.UNSUBACK)
    codes = list(r.rest())
    for code in codes:
        _check_reason(PacketType.UNSUBACK, code, version)
    return Unsuback(pid, codes, props)


def _d_empty(cls: Callable[[], Any]) -> Callable[[_Reader, int, int], Any]:
    def decode_empty(r: _Reader, flags: int, version: int) -> Any:
        r.done(cls.__name__.upper())
        return cls()

    return decode_empty


def _d_reasoned(cls: Callable[..., Any]) -> Callable[[_Reader, int, int], Any]:
    ptype = cls.type  # type: ignore[attr-defined]

    def decode_reasoned(r: _Reader, flags: int, version: int) -> Any:
        if ptype == PacketType.AUTH and version != MQTT_5:
            raise ProtocolError("AUTH is not part of MQTT 3.1.1", Reason.PROTOCOL_ERROR)
        code, props = 0, {}
        if version == MQTT_5 and r.remaining():
            code = r.byte()
            _check_reason(ptype, code, version)
            if r.remaining():
                props = decode_properties(r, ptype)
        r.done(ptype.name)
        return cls(code, props)

    return decode_reasoned


_DECODERS: dict[int, Callable[[_Reader, int, int], Packet]] = {
    PacketType.CONNACK: _d_connack,
    PacketType.PUBLISH: _d_publish,
    PacketType.PUBACK: _d_ack(Puback),
    PacketType.PUBREC: _d_ack(Pubrec),
    PacketType.PUBREL: _d_ack(Pubrel),
    PacketType.PUBCOMP: _d_ack(Pubcomp),
    PacketType.SUBSCRIBE: _d_subscribe,
    PacketType.SUBACK: _d_suback,
    PacketType.UNSUBSCRIBE: _d_unsubscribe,
    PacketType.UNSUBACK: _d_unsuback,
    PacketType.PINGREQ: _d_empty(Pingreq),
    PacketType.PINGRESP: _d_empty(Pingresp),
    PacketType.DISCONNECT: _d_reasoned(Disconnect),
    PacketType.AUTH: _d_reasoned(Auth),
}


class Decoder:
    """Incremental decoder: ``feed(data)`` returns the packets completed so far.

    ``version`` is the protocol level; a server-side decoder starts with
    ``None`` and learns it from the CONNECT. ``max_packet_size`` bounds the
    whole packet (fixed header included), checked before its body is buffered.
    After a ``ProtocolError`` the decoder is spent: close the connection.
    """

    def __init__(self, version: int | None = MQTT_5, max_packet_size: int = MAX_REMAINING_LENGTH):
        self.version = version
        self.max_packet_size = max_packet_size
        self._buf = bytearray()
        self._failed = False

    def feed(self, data: bytes) -> list[Packet]:
        if self._failed:
            raise ProtocolError("decoder used after a protocol error")
        self._buf += data
        out: list[Packet] = []
        try:
            while True:
                pkt = self._next()
                if pkt is None:
                    return out
                out.append(pkt)
        except ProtocolError:
            self._failed = True
            raise

    def _next(self) -> Packet | None:
        buf = self._buf
        if len(buf) < 2:
            return None
        length, shift, i = 0, 0, 1
        while True:
            if i >= len(buf):
                return None
            if i > 4:
                raise ProtocolError("remaining length longer than 4 bytes")
            b = buf[i]
            length |= (b & 0x7F) << shift
            shift += 7
            i += 1
            if not b & 0x80:
                break
        total = i + length
        if total > self.max_packet_size:
            raise ProtocolError(
                f"packet of {total} bytes exceeds the maximum of {self.max_packet_size}",
                Reason.PACKET_TOO_LARGE,
            )
        if len(buf) < total:
            return None
        first = buf[0]
        body = bytes(buf[i:total])
        del buf[:total]
        return self._decode(first >> 4, first & 0x0F, body)

    def _decode(self, ptype: int, flags: int, body: bytes) -> Packet:
        if ptype == 0:
            raise ProtocolError("reserved packet type 0")
        if ptype != PacketType.PUBLISH:
            expected = 0b0010 if ptype in _FLAGS_0010 else 0
            if flags != expected:
                name = PacketType(ptype).name
                # MQTT-2.2.2-2, and MQTT-3.6.1-1 for PUBREL
                raise ProtocolError(f"{name} flags {flags:04b}, expected {expected:04b}")
        r = _Reader(body)
        if ptype == PacketType.CONNECT:
            pkt = _d_connect(r, flags, self.version)
            self.version = pkt.protocol_level
            return pkt
        if self.version is None:
            raise ProtocolError("first packet is not CONNECT", Reason.PROTOCOL_ERROR)
        return _DECODERS[ptype](r, flags, self.version)


def decode_one(data: bytes, version: int | None = MQTT_5) -> Packet:
    """Decode exactly one complete packet (for tests and tools)."""
    pkts = Decoder(version).feed(data)
    if len(pkts) != 1:
        raise ProtocolError(f"expected one packet, got {len(pkts)}")
    return pkts[0]
