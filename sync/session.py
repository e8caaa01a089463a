"""The QoS 1/2 session rules for both roles, without I/O.

Theory of operation
-------------------
A QoS 2 flow has four packets, and a power cut can fall between any two of
them. The *sender* (the uplink) keeps, for every message it has handed to the
network, one in-flight record: ``packet_id -> PUBLISH_SENT | PUBREL_SENT``.
The *receiver* (ingest, node ingress) keeps the set of QoS 2 packet ids it has
taken ownership of and not yet seen released.

These classes hold that state in memory and say what each incoming packet
means; they never touch a socket, a clock or a disk. Each has one entry point
for what the peer sends, ``receive(packet)`` (as h11's ``next_event``), and it,
like every other method, returns an *outcome* object. The caller (``uplink.py``,
the receivers) must make the outcome durable **before** it writes any packet the
outcome carries: that is the whole contract, and it is why the outcomes are data
rather than callbacks.

Sender transitions (MQTT-4.3.3-1, 5.0 4.3.3-1..6)::

    (free) --new PUBLISH, id persisted--------------> PUBLISH_SENT
    PUBLISH_SENT --PUBREC <0x80 / commit, PUBREL-----> PUBREL_SENT
    PUBLISH_SENT --PUBREC >=0x80 / commit----------> (free)   no PUBREL (5.0 4.3.3-4)
    PUBLISH_SENT --PUBACK (QoS 1) / commit---------> (free)
    PUBREL_SENT  --PUBREC <0x80 again / PUBREL again-> PUBREL_SENT
    (free) or PUBREL_SENT --PUBREC >=0x80--------> unchanged, nothing sent (5.0 4.3.3-4)
    (free)       --PUBREC <0x80 / PUBREL 0x92 (5.0)-> (free)
    PUBREL_SENT  --PUBCOMP / commit delete---------> (free)
    reconnect, session present: PUBLISH_SENT -> PUBLISH DUP=1 same id,
                                PUBREL_SENT  -> PUBREL same id, original order
    reconnect, session absent:  every record gets a new id (resent_after_session_loss)

A PUBLISH is never resent once its PUBREL may have gone out (MQTT-4.3.3-1,
5.0 4.3.3-6): the state is PUBREL_SENT from the moment the PUBREC is committed.

Receiver transitions (MQTT-4.3.3-2, 5.0 4.3.3-8..12)::

    (unknown) --PUBLISH QoS 2 / deliver + remember id, commit, PUBREC--> PENDING
    PENDING   --PUBLISH QoS 2 same id / PUBREC only (never deliver twice)
    PENDING   --PUBREL / forget id, commit, PUBCOMP--> (unknown)
    (unknown) --PUBREL / PUBCOMP (0x92 in 5.0)

A receiver may instead keep, durably, only what it delivered (``landed``: id ->
digest of the message) and never the PUBREL. After a restart such an id is
LANDED: whether it was released is unknown, so the message decides::

    LANDED    --PUBLISH QoS 2 same id, a digest seen / PUBREC only--> PENDING
    LANDED    --PUBLISH QoS 2 same id, new digest   / deliver, PUBREC--> PENDING
    LANDED    --PUBREL / PUBCOMP--> (unknown)

A resend carries the same topic and payload (MQTT-4.3.3-2 / 5.0 4.3.3-10: never
delivered twice); a new message under a released id differs, or is the same
bytes again, which the application's own key (the reading id) would drop anyway.
"""

from __future__ import annotations

import enum
import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from .errors import SessionError as SessionError
from .packets import (
    MQTT_5,
    Packet,
    Puback,
    Pubcomp,
    Publish,
    Pubrec,
    Pubrel,
    Reason,
)

MAX_PACKET_ID = 0xFFFF


class OutState(enum.StrEnum):
    """An outgoing message's state, as the store's ``out_inflight.state`` spells it."""

    # In the store only: its readings wait for a packet id (its old one died with a
    # session, or the broker refused it). Never in a session's in-flight table.
    QUEUED = "QUEUED"
    PUBLISH_SENT = "PUBLISH_SENT"
    PUBREL_SENT = "PUBREL_SENT"


@dataclass(slots=True)
class Outgoing:
    packet_id: int
    qos: int
    state: OutState = OutState.PUBLISH_SENT


# ----------------------------------------------------------------- outcomes


@dataclass(frozen=True, slots=True)
class Released:
    """PUBREC accepted: commit PUBREL_SENT, then send ``reply`` (the PUBREL)."""

    packet_id: int
    reply: Pubrel


@dataclass(frozen=True, slots=True)
class Completed:
    """PUBACK or PUBCOMP: commit the deletion of the message; the id is free."""

    packet_id: int


@dataclass(frozen=True, slots=True)
class Refused:
    """PUBACK/PUBREC with reason >= 0x80: the flow is over, never retransmit (5.0 4.4.0-2)."""

    packet_id: int
    reason: int


@dataclass(frozen=True, slots=True)
class Reply:
    """Send ``packet`` with nothing to commit (a repeated PUBREC, an unknown PUBREL)."""

    packet: Pubrel | Pubcomp


@dataclass(frozen=True, slots=True)
class Ignored:
    """Nothing to commit: ``packet`` names what was ignored (the caller counts by it),
    ``why`` says what exactly (logged); ``answer``, if any, is what the protocol still
    asks to be sent (a PUBLISH nobody subscribed to is acknowledged: MQTT-4.5.0-2)."""

    packet: str
    why: str
    answer: Puback | Pubrec | None = None


@dataclass(frozen=True, slots=True)
class ResendPublish:
    """A PUBLISH to send again: same packet id, DUP=1 (MQTT-3.3.1-1, MQTT-4.4.0-1). Its
    topic and payload are not the session's to know: the caller has them (the store)."""

    packet_id: int
    qos: int

    def publish(self, topic: str, payload: bytes) -> Publish:
        return Publish(topic, payload, self.qos, dup=True, packet_id=self.packet_id)


@dataclass(frozen=True, slots=True)
class Resume:
    """What a new connection must do before any new PUBLISH (design rule 4)."""

    resend: list[ResendPublish | Pubrel]
    # Records whose session the broker lost: the caller re-queues them with new ids.
    lost: list[int]


@dataclass(frozen=True, slots=True)
class Deliver:
    """Receiver: take ownership of ``publish`` (commit it, and its id for QoS 2), then ack."""

    publish: Publish
    ack: Puback | Pubrec | None


@dataclass(frozen=True, slots=True)
class Reack:
    """Receiver: a repeat of a QoS 2 PUBLISH we own; acknowledge, never deliver twice."""

    ack: Pubrec


@dataclass(frozen=True, slots=True)
class Forget:
    """Receiver: PUBREL for an id we hold; commit forgetting it, then send the PUBCOMP."""

    packet_id: int
    ack: Pubcomp


PERMANENT_REFUSALS = frozenset(
    {
        Reason.NOT_AUTHORIZED,
        Reason.TOPIC_NAME_INVALID,
        Reason.PAYLOAD_FORMAT_INVALID,
    }
)


# ------------------------------------------------------------------- sender


class SenderSession:
    """The publishing side of one MQTT session (client towards a broker).

    ``inflight`` is the durable in-flight table in its original order;
    ``last_packet_id`` the last id handed out (ids go on from there, so a
    recently freed id is the last to be reused).
    """

    def __init__(
        self, version: int, inflight: Iterable[Outgoing] = (), last_packet_id: int = 0
    ) -> None:
        self.version = version
        self.inflight: OrderedDict[int, Outgoing] = OrderedDict((o.packet_id, o) for o in inflight)
        self.last_packet_id = last_packet_id
        self.receive_maximum = 65535
        self.maximum_qos = 2
        # Ids of our SUBSCRIBEs awaiting their SUBACK: the same id space as PUBLISHes
        # (MQTT-2.3.1-2), but nothing the broker keeps past the connection.
        self.control: set[int] = set()

    # -- connection lifecycle

    def on_connack(
        self,
        session_present: bool,
        *,
        clean_start: bool,
        receive_maximum: int = 65535,
        maximum_qos: int = 2,
    ) -> Resume:
        if session_present and clean_start:
            # 5.0 3.2.2-4: we asked for a new session and hold none for it.
            raise SessionError("broker reported a session present after a clean start")
        self.receive_maximum = max(1, receive_maximum)  # 5.0 4.9.0-1: quota is never zero
        self.maximum_qos = maximum_qos
        if not session_present:
            # 5.0 3.2.2-5 / 3.1.1 3.1.2-6: the broker has none of our state. Nothing
            # may be resent under its old id; every record goes out again as new.
            lost = list(self.inflight)
            self.inflight.clear()
            return Resume([], lost)
        resend: list[ResendPublish | Pubrel] = []
        for o in self.inflight.values():  # original order: MQTT-4.6.0-1
            if o.state is OutState.PUBREL_SENT:
                resend.append(Pubrel(o.packet_id))
            else:
                resend.append(ResendPublish(o.packet_id, o.qos))
        return Resume(resend, [])

    # -- new messages

    def send_quota(self) -> int:
        """How many more QoS>0 PUBLISHes may go out now (5.0 3.3.4-7, 4.9.0-2)."""
        return max(0, self.receive_maximum - len(self.inflight))

    def effective_qos(self, qos: int) -> int:
        return min(qos, self.maximum_qos)  # 5.0 3.2.2-11

    def allocate(self, qos: int) -> Outgoing:
        """Reserve a packet id for a new message; the caller persists it before sending.

        MQTT-2.3.1-2: an id not in use. Ids advance cyclically from the last one,
        so an id is reused as late as possible.
        """
        if qos not in (1, 2):
            raise ValueError("only QoS 1 and 2 messages carry packet ids")
        if self.send_quota() <= 0:
            raise SessionError("send quota exhausted (Receive Maximum)")
        pid = self._free_id()
        out = Outgoing(pid, qos)
        self.inflight[pid] = out
        self.last_packet_id = pid
        return out

    def _free_id(self) -> int:
        pid = self.last_packet_id
        for _ in range(MAX_PACKET_ID):
            pid = pid % MAX_PACKET_ID + 1
            if pid not in self.inflight and pid not in self.control:
                return pid
        raise SessionError("no free packet id")  # pragma: no cover - beyond Receive Maximum

    def allocate_control(self) -> int:
        """An id for a SUBSCRIBE: in use by no PUBLISH (MQTT-2.3.1-2) until its SUBACK
        (``control_done``). It does not count against the send quota, which is about
        PUBLISHes (5.0 4.9.0-2); it is not persisted, as the broker keeps no SUBSCRIBE
        across a connection."""
        pid = self._free_id()
        self.control.add(pid)
        self.last_packet_id = pid
        return pid

    def control_done(self, packet_id: int) -> bool:
        """The SUBACK for ``packet_id`` arrived: the id is free. False if we sent no
        SUBSCRIBE with it."""
        if packet_id not in self.control:
            return False
        self.control.discard(packet_id)
        return True

    def forget_allocation(self, packet_id: int) -> None:
        """Undo ``allocate`` when persisting failed (nothing was sent)."""
        self.inflight.pop(packet_id, None)

    # -- what the broker sends

    def receive(self, pkt: Packet) -> Completed | Released | Refused | Reply | Ignored:
        """What a packet from the broker means for this session: the one entry point (as
        h11's ``next_event``). The caller commits the outcome, then writes any packet
        it carries; connection packets (CONNACK, PINGRESP) are not the session's."""
        match pkt:
            case Puback():
                return self._on_puback(pkt)
            case Pubrec():
                return self._on_pubrec(pkt)
            case Pubcomp():
                return self._on_pubcomp(pkt)
            case Publish(packet_id=int(pid), qos=1 | 2):
                # We subscribe to nothing; still answer as its QoS requires (MQTT-4.5.0-2).
                ack = Puback(pid) if pkt.qos == 1 else Pubrec(pid)
                return Ignored("unexpected PUBLISH", f"PUBLISH {pid} on {pkt.topic}", ack)
            case Pubrel():
                # We hold no inbound QoS 2 state: complete it, saying so in 5.0 (0x92).
                code = Reason.PACKET_IDENTIFIER_NOT_FOUND if self.version == MQTT_5 else 0
                return Reply(Pubcomp(pkt.packet_id, code))
        name = type(pkt).__name__
        return Ignored(f"unexpected {name}", f"{name} is not part of a publishing session")

    def _on_puback(self, pkt: Puback) -> Completed | Refused | Ignored:
        o = self.inflight.get(pkt.packet_id)
        if o is None or o.qos != 1:
            return Ignored("PUBACK", f"PUBACK for packet id {pkt.packet_id} not awaiting one")
        del self.inflight[pkt.packet_id]
        if pkt.reason_code >= 0x80:
            return Refused(pkt.packet_id, pkt.reason_code)
        return Completed(pkt.packet_id)

    def _on_pubrec(self, pkt: Pubrec) -> Released | Refused | Reply | Ignored:
        pid = pkt.packet_id
        o = self.inflight.get(pid)
        if pkt.reason_code >= 0x80 and (o is None or o.state is OutState.PUBREL_SENT):
            # MQTT-4.3.3-4 (5.0): a PUBREL answers only a PUBREC below 0x80. The broker
            # ended a flow we hold nothing for (or already released): nothing to send.
            code = f"PUBREC 0x{pkt.reason_code:02x}"
            return Ignored(code, f"{code} for packet id {pid} not awaiting one")
        if o is None or o.qos != 2:
            if self.version == MQTT_5:
                # Let the broker finish its side; we hold nothing for this id.
                return Reply(Pubrel(pid, Reason.PACKET_IDENTIFIER_NOT_FOUND))
            return Ignored("PUBREC", f"PUBREC for unknown packet id {pid}")
        if o.state is OutState.PUBREL_SENT:
            # Our PUBREL may have been lost: answer again, state unchanged.
            return Reply(Pubrel(pid))
        if pkt.reason_code >= 0x80:
            del self.inflight[pid]  # 5.0 4.3.3-4: no PUBREL; 4.4.0-2: never retransmit
            return Refused(pid, pkt.reason_code)
        o.state = OutState.PUBREL_SENT
        return Released(pid, Pubrel(pid))

    def _on_pubcomp(self, pkt: Pubcomp) -> Completed | Ignored:
        o = self.inflight.get(pkt.packet_id)
        if o is None:
            return Ignored("PUBCOMP", f"PUBCOMP for free packet id {pkt.packet_id}")
        if o.state is not OutState.PUBREL_SENT:
            # A PUBCOMP before our PUBREL is a broker bug; keep the message and let
            # the normal PUBREC path (or the next resume) finish it.
            return Ignored("PUBCOMP", f"PUBCOMP for packet id {pkt.packet_id} before PUBREL")
        del self.inflight[pkt.packet_id]
        return Completed(pkt.packet_id)


# ----------------------------------------------------------------- receiver


def message_digest(pkt: Publish) -> str:
    """What tells a resent PUBLISH from a new one under the same id: topic and payload."""
    h = hashlib.blake2b(pkt.topic.encode(), digest_size=16)
    h.update(b"\0")
    h.update(pkt.payload)
    return h.hexdigest()


class ReceiverSession:
    """The receiving side of one MQTT session (ingest, node ingress).

    ``pending`` is the set of QoS 2 ids owned and not yet released (durable, for a
    receiver that commits PUBRELs). ``landed`` maps ids delivered before a restart,
    whose release is unknown, to the ``message_digest`` of what was delivered under
    them (several, if an id was reused after a release).
    """

    def __init__(
        self,
        version: int,
        pending: Iterable[int] = (),
        landed: Mapping[int, Iterable[str]] | None = None,
    ) -> None:
        self.version = version
        # Owned ids and the digest of what each carried (None: a previous version's id,
        # whose message is unknown).
        self.pending: dict[int, str | None] = dict.fromkeys(pending)
        self.landed: dict[int, set[str]] = {pid: set(d) for pid, d in (landed or {}).items()}

    def on_connack(self, session_present: bool) -> None:
        if not session_present:
            self.pending.clear()  # a new session: old ids mean nothing (MQTT-3.1.2-6)
            self.landed.clear()

    def receive(self, pkt: Packet) -> Deliver | Reack | Forget | Reply | Ignored:
        """What a packet from the peer means for this session: the one entry point (as
        h11's ``next_event``). The caller commits the outcome, then writes its ack;
        connection packets (PINGREQ, SUBSCRIBE, SUBACK, DISCONNECT) are not the session's."""
        match pkt:
            case Publish():
                return self._on_publish(pkt)
            case Pubrel():
                return self._on_pubrel(pkt)
        name = type(pkt).__name__
        return Ignored(f"unexpected {name}", f"{name} is not part of a receiving session")

    def _on_publish(self, pkt: Publish) -> Deliver | Reack:
        """MQTT-3.3.4-1 / 4.5.0-2: every PUBLISH is answered as its QoS requires."""
        if pkt.qos == 0:
            return Deliver(pkt, None)
        assert pkt.packet_id is not None
        if pkt.qos == 1:
            # MQTT-4.3.2-2: after PUBACK the same id is a new message; the
            # application's own key (reading id) absorbs a resent QoS 1 message.
            return Deliver(pkt, Puback(pkt.packet_id))
        digest = message_digest(pkt)
        if pkt.packet_id in self.pending:
            held = self.pending[pkt.packet_id]
            if held is None or held == digest:
                return Reack(Pubrec(pkt.packet_id))  # MQTT-4.3.3-2: never deliver twice
            # Another message under an id we hold, before its PUBREL: a broker that reused
            # the id (NATS 2.15 does, after a resumed session: docs/brokers.md). Delivering
            # it duplicates nothing, and acknowledging it unread would lose it.
            self.pending[pkt.packet_id] = digest
            return Deliver(pkt, Pubrec(pkt.packet_id))
        self.pending[pkt.packet_id] = digest
        digests = self.landed.pop(pkt.packet_id, None)
        if digests is not None and digest in digests:
            return Reack(Pubrec(pkt.packet_id))  # the resend of a message landed before
        return Deliver(pkt, Pubrec(pkt.packet_id))

    def refuse(self, pkt: Publish, reason: int) -> Puback | Pubrec:
        """Acknowledge a PUBLISH the application will not keep (5.0 4.3.3-9: id is then free)."""
        assert pkt.packet_id is not None
        self.pending.pop(pkt.packet_id, None)
        code = reason if self.version == MQTT_5 else 0
        return Puback(pkt.packet_id, code) if pkt.qos == 1 else Pubrec(pkt.packet_id, code)

    def _on_pubrel(self, pkt: Pubrel) -> Forget | Reply:
        if pkt.packet_id in self.pending or pkt.packet_id in self.landed:
            self.pending.pop(pkt.packet_id, None)
            self.landed.pop(pkt.packet_id, None)
            return Forget(pkt.packet_id, Pubcomp(pkt.packet_id))
        code = Reason.PACKET_IDENTIFIER_NOT_FOUND if self.version == MQTT_5 else 0
        return Reply(Pubcomp(pkt.packet_id, code))
