"""MQTT control packets as plain data (3.1.1 and 5.0).

Packets are values: the codec turns them into bytes and back, the session
rules decide which to send. Nothing here does I/O. Field names follow the
specifications; ``properties`` is a dict keyed by the snake_case property name
(see ``codec.PROPERTIES``) and is always empty for MQTT 3.1.1.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

MQTT_311 = 4
MQTT_5 = 5

Properties = dict[str, Any]


class PacketType(enum.IntEnum):
    CONNECT = 1
    CONNACK = 2
    PUBLISH = 3
    PUBACK = 4
    PUBREC = 5
    PUBREL = 6
    PUBCOMP = 7
    SUBSCRIBE = 8
    SUBACK = 9
    UNSUBSCRIBE = 10
    UNSUBACK = 11
    PINGREQ = 12
    PINGRESP = 13
    DISCONNECT = 14
    AUTH = 15


class Reason(enum.IntEnum):
    """MQTT 5.0 reason codes (section 2.4) used by pubcomp."""

    SUCCESS = 0x00
    GRANTED_QOS_1 = 0x01
    GRANTED_QOS_2 = 0x02
    DISCONNECT_WITH_WILL = 0x04
    NO_MATCHING_SUBSCRIBERS = 0x10
    NO_SUBSCRIPTION_EXISTED = 0x11
    CONTINUE_AUTHENTICATION = 0x18
    RE_AUTHENTICATE = 0x19
    UNSPECIFIED_ERROR = 0x80
    MALFORMED_PACKET = 0x81
    PROTOCOL_ERROR = 0x82
    IMPLEMENTATION_SPECIFIC_ERROR = 0x83
    UNSUPPORTED_PROTOCOL_VERSION = 0x84
    CLIENT_IDENTIFIER_NOT_VALID = 0x85
    BAD_USER_NAME_OR_PASSWORD = 0x86
    NOT_AUTHORIZED = 0x87
    SERVER_UNAVAILABLE = 0x88
    SERVER_BUSY = 0x89
    BANNED = 0x8A
    SERVER_SHUTTING_DOWN = 0x8B
    BAD_AUTHENTICATION_METHOD = 0x8C
    KEEP_ALIVE_TIMEOUT = 0x8D
    SESSION_TAKEN_OVER = 0x8E
    TOPIC_FILTER_INVALID = 0x8F
    TOPIC_NAME_INVALID = 0x90
    PACKET_IDENTIFIER_IN_USE = 0x91
    PACKET_IDENTIFIER_NOT_FOUND = 0x92
    RECEIVE_MAXIMUM_EXCEEDED = 0x93
    TOPIC_ALIAS_INVALID = 0x94
    PACKET_TOO_LARGE = 0x95
    MESSAGE_RATE_TOO_HIGH = 0x96
    QUOTA_EXCEEDED = 0x97
    ADMINISTRATIVE_ACTION = 0x98
    PAYLOAD_FORMAT_INVALID = 0x99
    RETAIN_NOT_SUPPORTED = 0x9A
    QOS_NOT_SUPPORTED = 0x9B
    USE_ANOTHER_SERVER = 0x9C
    SERVER_MOVED = 0x9D
    SHARED_SUBSCRIPTIONS_NOT_SUPPORTED = 0x9E
    CONNECTION_RATE_EXCEEDED = 0x9F
    MAXIMUM_CONNECT_TIME = 0xA0
    SUBSCRIPTION_IDENTIFIERS_NOT_SUPPORTED = 0xA1
    WILDCARD_SUBSCRIPTIONS_NOT_SUPPORTED = 0xA2


@dataclass(frozen=True, slots=True)
class Will:
    topic: str
    payload: bytes = b""
    qos: int = 0
    retain: bool = False
    properties: Properties = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Connect:
    client_id: str
    protocol_level: int = MQTT_5
    clean_start: bool = True
    keepalive: int = 60
    username: str | None = None
    password: bytes | None = None
    will: Will | None = None
    properties: Properties = field(default_factory=dict)
    type = PacketType.CONNECT


@dataclass(frozen=True, slots=True)
class Connack:
    session_present: bool = False
    # MQTT 3.1.1 return codes 0..5 share the byte with 5.0 reason codes.
    reason_code: int = 0
    properties: Properties = field(default_factory=dict)
    type = PacketType.CONNACK


@dataclass(frozen=True, slots=True)
class Publish:
    topic: str
    payload: bytes = b""
    qos: int = 0
    retain: bool = False
    dup: bool = False
    packet_id: int | None = None
    properties: Properties = field(default_factory=dict)
    type = PacketType.PUBLISH


@dataclass(frozen=True, slots=True)
class _Ack:
    packet_id: int
    reason_code: int = 0
    properties: Properties = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Puback(_Ack):
    type = PacketType.PUBACK


@dataclass(frozen=True, slots=True)
class Pubrec(_Ack):
    type = PacketType.PUBREC


@dataclass(frozen=True, slots=True)
class Pubrel(_Ack):
    type = PacketType.PUBREL


@dataclass(frozen=True, slots=True)
class Pubcomp(_Ack):
    type = PacketType.PUBCOMP


@dataclass(frozen=True, slots=True)
class Subscription:
    topic_filter: str
    qos: int = 0
    # MQTT 5.0 subscription options; ignored for 3.1.1.
    no_local: bool = False
    retain_as_published: bool = False
    retain_handling: int = 0


@dataclass(frozen=True, slots=True)
class Subscribe:
    packet_id: int
    subscriptions: list[Subscription]
    properties: Properties = field(default_factory=dict)
    type = PacketType.SUBSCRIBE


@dataclass(frozen=True, slots=True)
class Suback:
    packet_id: int
    reason_codes: list[int]
    properties: Properties = field(default_factory=dict)
    type = PacketType.SUBACK


@dataclass(frozen=True, slots=True)
class Unsubscribe:
    packet_id: int
    topic_filters: list[str]
    properties: Properties = field(default_factory=dict)
    type = PacketType.UNSUBSCRIBE


@dataclass(frozen=True, slots=True)
class Unsuback:
    packet_id: int
    # Empty for MQTT 3.1.1, which has no reason codes in UNSUBACK.
    reason_codes: list[int] = field(default_factory=list)
    properties: Properties = field(default_factory=dict)
    type = PacketType.UNSUBACK


@dataclass(frozen=True, slots=True)
class Pingreq:
    type = PacketType.PINGREQ


@dataclass(frozen=True, slots=True)
class Pingresp:
    type = PacketType.PINGRESP


@dataclass(frozen=True, slots=True)
class Disconnect:
    reason_code: int = 0
    properties: Properties = field(default_factory=dict)
    type = PacketType.DISCONNECT


@dataclass(frozen=True, slots=True)
class Auth:
    reason_code: int = 0
    properties: Properties = field(default_factory=dict)
    type = PacketType.AUTH


Packet = (
    Connect
    | Connack
    | Publish
    | Puback
    | Pubrec
    | Pubrel
    | Pubcomp
    | Subscribe
    | Suback
    | Unsubscribe
    | Unsuback
    | Pingreq
    | Pingresp
    | Disconnect
    | Auth
)
