"""The session rules without I/O; each test names the normative statement it enforces."""

from __future__ import annotations

import pytest

from pubcomp.sync.packets import MQTT_5, MQTT_311, Puback, Pubcomp, Publish, Pubrec, Pubrel
from pubcomp.sync.session import (
    Completed,
    Deliver,
    Forget,
    Ignored,
    Outgoing,
    OutState,
    Reack,
    ReceiverSession,
    Refused,
    Released,
    Reply,
    ResendPublish,
    SenderSession,
    SessionError,
    message_digest,
)


def connected(version: int = MQTT_5, **kw: object) -> SenderSession:
    s = SenderSession(version, **kw)  # type: ignore[arg-type]
    s.on_connack(False, clean_start=True)
    return s


def test_new_ids_are_nonzero_unused_and_advance_MQTT_2_3_1_1_and_2() -> None:
    s = connected(last_packet_id=65534)
    ids = [s.allocate(2).packet_id for _ in range(3)]
    assert ids == [65535, 1, 2]  # wraps past 65535 to 1, never 0
    s2 = SenderSession(MQTT_5, [Outgoing(1, 2), Outgoing(3, 2)], last_packet_id=0)
    s2.on_connack(True, clean_start=False)
    assert [s2.allocate(2).packet_id for _ in range(2)] == [2, 4]  # skips ids in use


def test_qos2_flow_PUBREC_then_PUBCOMP_MQTT_4_3_3_1() -> None:
    s = connected()
    pid = s.allocate(2).packet_id
    out = s.receive(Pubrec(pid))
    assert out == Released(pid, Pubrel(pid))  # PUBREL echoes the id: MQTT-2.3.1-6
    assert s.inflight[pid].state is OutState.PUBREL_SENT
    assert s.receive(Pubcomp(pid)) == Completed(pid)
    assert pid not in s.inflight  # MQTT-2.3.1-3: PUBCOMP frees the id


def test_repeated_PUBREC_gets_PUBREL_again_never_the_PUBLISH_MQTT_4_3_3_1() -> None:
    s = connected()
    pid = s.allocate(2).packet_id
    s.receive(Pubrec(pid))
    assert s.receive(Pubrec(pid)) == Reply(Pubrel(pid))
    assert s.inflight[pid].state is OutState.PUBREL_SENT


def test_PUBREC_with_error_ends_the_flow_without_PUBREL_5_0_4_3_3_4_and_4_4_0_2() -> None:
    s = connected()
    pid = s.allocate(2).packet_id
    assert s.receive(Pubrec(pid, 0x97)) == Refused(pid, 0x97)
    assert pid not in s.inflight  # 4.4.0-2: acknowledged, never retransmitted
    r = s.on_connack(True, clean_start=False)
    assert r.resend == []


def test_PUBREC_with_error_for_an_id_not_awaiting_one_draws_no_PUBREL_MQTT_4_3_3_4() -> None:
    """MQTT-4.3.3-4 (5.0): the sender MUST send a PUBREL "in response to a PUBREC
    containing a Reason Code of less than 0x80" only. An unknown id (or one already
    released) with a failure code gets nothing, and the state is left alone."""
    s = connected()
    pid = s.allocate(2).packet_id
    s.receive(Pubrec(pid))  # PUBREL_SENT
    for code in (0x80, 0x83, 0x87, 0x90, 0x91, 0x97, 0x99):
        unknown = s.receive(Pubrec(4242, code))
        assert isinstance(unknown, Ignored), (hex(code), unknown)
        released = s.receive(Pubrec(pid, code))
        assert isinstance(released, Ignored), (hex(code), released)
        assert isinstance(connected(MQTT_311).receive(Pubrec(4242, code)), Ignored)
    assert s.inflight[pid].state is OutState.PUBREL_SENT and list(s.inflight) == [pid]
    # Below 0x80 the unknown id is still answered (5.0: PUBREL 0x92, MQTT-3.6.2-1).
    assert s.receive(Pubrec(4242, 0x10)) == Reply(Pubrel(4242, 0x92))


def test_qos1_flow_and_PUBACK_error_MQTT_4_3_2_1() -> None:
    s = connected()
    a, b = s.allocate(1).packet_id, s.allocate(1).packet_id
    assert s.receive(Puback(a)) == Completed(a)
    assert s.receive(Puback(b, 0x87)) == Refused(b, 0x87)
    assert not s.inflight


def test_resume_resends_PUBLISH_dup_and_PUBREL_in_original_order_MQTT_4_4_0_1_and_4_6_0_1() -> None:
    inflight = [Outgoing(9, 2), Outgoing(3, 2, OutState.PUBREL_SENT), Outgoing(5, 1)]
    s = SenderSession(MQTT_311, inflight, last_packet_id=9)
    r = s.on_connack(True, clean_start=False)
    assert [(type(p).__name__, p.packet_id) for p in r.resend] == [
        ("ResendPublish", 9),
        ("Pubrel", 3),
        ("ResendPublish", 5),
    ]
    pubs = [p.publish("t", b"x") for p in r.resend if isinstance(p, ResendPublish)]
    assert all(p.dup for p in pubs)  # MQTT-3.3.1-1: DUP=1 on redelivery
    assert [(p.qos, p.packet_id) for p in pubs] == [(2, 9), (1, 5)]  # the same ids


def test_new_publish_has_dup_0_MQTT_3_3_1_3_and_4_3_3_1() -> None:
    # The uplink builds new PUBLISHes with the default DUP=False; resend is the only DUP=1 path.
    assert Publish("t", b"", 2, packet_id=1).dup is False


def test_session_absent_discards_state_and_reports_it_lost_5_0_3_2_2_5_MQTT_3_1_2_6() -> None:
    s = SenderSession(MQTT_5, [Outgoing(4, 2), Outgoing(6, 2, OutState.PUBREL_SENT)], 6)
    r = s.on_connack(False, clean_start=False)
    assert r.resend == [] and r.lost == [4, 6]  # nothing resent under an old id
    assert not s.inflight


def test_session_present_after_clean_start_closes_5_0_3_2_2_4() -> None:
    s = SenderSession(MQTT_5)
    with pytest.raises(SessionError, match="session present"):
        s.on_connack(True, clean_start=True)


def test_receive_maximum_bounds_inflight_5_0_3_3_4_7_and_4_9_0_1_2() -> None:
    s = SenderSession(MQTT_5)
    s.on_connack(False, clean_start=True, receive_maximum=2)
    s.allocate(2)
    s.allocate(2)
    assert s.send_quota() == 0
    with pytest.raises(SessionError, match="quota"):
        s.allocate(2)
    # 4.9.0-3 (keep handling other packets at zero quota): acks still flow and free the quota.
    s.receive(Pubrec(1))
    s.receive(Pubcomp(1))
    assert s.send_quota() == 1
    # 4.9.0-1: a quota of zero from the broker is never used as zero.
    z = SenderSession(MQTT_5)
    z.on_connack(False, clean_start=True, receive_maximum=0)
    assert z.send_quota() == 1


def test_maximum_qos_is_honoured_5_0_3_2_2_11() -> None:
    s = SenderSession(MQTT_5)
    s.on_connack(False, clean_start=True, maximum_qos=1)
    assert s.effective_qos(2) == 1


def test_unexpected_acks_do_not_corrupt_state() -> None:
    s = connected()
    pid = s.allocate(2).packet_id
    assert isinstance(s.receive(Pubcomp(pid)), Ignored)  # PUBCOMP before PUBREC
    assert s.inflight[pid].state is OutState.PUBLISH_SENT
    assert isinstance(s.receive(Pubcomp(999)), Ignored)  # PUBCOMP for a free id
    assert isinstance(s.receive(Puback(pid)), Ignored)  # PUBACK for a QoS 2 message
    assert s.receive(Pubrec(777)) == Reply(Pubrel(777, 0x92))  # 5.0: id not found
    assert isinstance(connected(MQTT_311).receive(Pubrec(777)), Ignored)
    assert list(s.inflight) == [pid]


def test_receiver_qos2_never_delivers_twice_MQTT_4_3_3_2_and_5_0_4_3_3_10() -> None:
    r = ReceiverSession(MQTT_5)
    p = Publish("t", b"x", 2, packet_id=5)
    first = r.receive(p)
    assert isinstance(first, Deliver) and first.ack == Pubrec(5)
    again = r.receive(Publish("t", b"x", 2, dup=True, packet_id=5))
    assert again == Reack(Pubrec(5))
    assert r.receive(Pubrel(5)) == Forget(5, Pubcomp(5))  # 5.0 4.3.3-11
    # 5.0 4.3.3-12 / MQTT-4.3.3-2: after PUBCOMP the id means a new message.
    assert isinstance(r.receive(Publish("t", b"y", 2, packet_id=5)), Deliver)


def test_another_message_under_a_held_id_is_delivered_MQTT_4_3_3_2() -> None:
    """MQTT-4.3.3-2 forbids delivering a resent message twice; a different message under
    an id still held (a broker that reused it before its PUBREL: NATS 2.15 after a
    resumed session, docs/brokers.md) is not a resend. Acknowledging it unread lost it:
    225 of 3,000 readings in the NATS cluster's ingest-node kill."""
    r = ReceiverSession(MQTT_311)
    assert isinstance(r.receive(Publish("t", b"one", 2, packet_id=1)), Deliver)
    other = r.receive(Publish("t", b"two", 2, packet_id=1))
    assert isinstance(other, Deliver) and other.ack == Pubrec(1)
    # And a resend of that second one is recognised as such.
    assert r.receive(Publish("t", b"two", 2, dup=True, packet_id=1)) == Reack(Pubrec(1))
    # An id a previous version held, whose message is unknown: a PUBLISH is a resend.
    legacy = ReceiverSession(MQTT_311, pending={9})
    assert legacy.receive(Publish("t", b"?", 2, dup=True, packet_id=9)) == Reack(Pubrec(9))


def test_receiver_answers_every_publish_MQTT_4_5_0_2_and_3_3_4_1() -> None:
    r = ReceiverSession(MQTT_311)
    assert r.receive(Publish("t", b"", 0)) == Deliver(Publish("t", b"", 0), None)
    d = r.receive(Publish("t", b"", 1, packet_id=3))
    assert isinstance(d, Deliver) and d.ack == Puback(3)
    # MQTT-4.3.2-2: after PUBACK the same id is a new message: delivered again.
    assert isinstance(r.receive(Publish("t", b"", 1, packet_id=3)), Deliver)


def test_receiver_unknown_pubrel_still_gets_pubcomp() -> None:
    assert ReceiverSession(MQTT_5).receive(Pubrel(8)) == Reply(Pubcomp(8, 0x92))
    assert ReceiverSession(MQTT_311).receive(Pubrel(8)) == Reply(Pubcomp(8))


def test_receiver_refusal_frees_the_id_5_0_4_3_3_9() -> None:
    r = ReceiverSession(MQTT_5)
    p = Publish("t", b"bad", 2, packet_id=11)
    r.receive(p)
    assert r.refuse(p, 0x99) == Pubrec(11, 0x99)
    assert isinstance(r.receive(p), Deliver)


def test_receiver_session_lost_forgets_pending_ids() -> None:
    r = ReceiverSession(MQTT_311, pending={1, 2})
    r.on_connack(False)
    assert not r.pending


def test_receiver_recognises_a_resend_of_a_message_landed_before_a_restart_MQTT_4_3_3_2() -> None:
    """MQTT-4.3.3-2 (5.0 4.3.3-10): until PUBREL, a repeat is acknowledged and never
    delivered twice, also across a restart that kept only the landed message and its
    digest (no PUBREL record). A new message under a released id is delivered (5.0
    4.3.3-12): its digest differs."""
    old = Publish("t/gw1/readings", b'{"readings":1}', 2, packet_id=7)
    r = ReceiverSession(
        MQTT_5, landed={7: {"other", message_digest(old)}, 8: {message_digest(old)}}
    )
    again = Publish(old.topic, old.payload, 2, dup=True, packet_id=7)
    assert r.receive(again) == Reack(Pubrec(7))
    assert r.receive(again) == Reack(Pubrec(7))  # still pending until PUBREL
    assert r.receive(Pubrel(7)) == Forget(7, Pubcomp(7))
    new = Publish(old.topic, b'{"readings":2}', 2, packet_id=8)  # id 8 was released
    assert isinstance(r.receive(new), Deliver)
    assert r.receive(new) == Reack(Pubrec(8))
    other_topic = Publish("t/gw2/readings", old.payload, 2, packet_id=9)
    r.landed[9] = {message_digest(old)}
    assert isinstance(r.receive(other_topic), Deliver)
    assert ReceiverSession(MQTT_5, landed={3: {"x"}}).receive(Pubrel(3)) == Forget(3, Pubcomp(3))
    lost = ReceiverSession(MQTT_5, landed={7: {message_digest(old)}})
    lost.on_connack(False)  # MQTT-3.1.2-6: a new session, the old ids mean nothing
    assert isinstance(lost.receive(again), Deliver)


@pytest.mark.parametrize("version", [MQTT_311, MQTT_5])
def test_one_entry_point_for_what_the_broker_sends_a_publishing_session_MQTT_4_5_0_2(
    version: int,
) -> None:
    """``receive`` is the only way in: besides the acknowledgements, a PUBLISH nobody
    subscribed to is still answered as its QoS requires (MQTT-4.5.0-2) and counted; a
    PUBREL for an inbound flow this session never holds is completed (0x92 in 5.0);
    anything else is counted by name, never an exception."""
    s = connected(version)
    q1 = s.receive(Publish("x", b"", 1, packet_id=7))
    q2 = s.receive(Publish("x", b"", 2, packet_id=8))
    assert isinstance(q1, Ignored) and q1.packet == "unexpected PUBLISH"
    assert q1.answer == Puback(7) and isinstance(q2, Ignored) and q2.answer == Pubrec(8)
    code = 0x92 if version == MQTT_5 else 0
    assert s.receive(Pubrel(8)) == Reply(Pubcomp(8, code))
    other = s.receive(Publish("x", b"", 0))
    assert isinstance(other, Ignored) and other.answer is None
    assert s.inflight == {}  # none of it touched the session's state


def test_a_receiving_session_ignores_acknowledgements_by_name() -> None:
    """A receiver publishes nothing: an acknowledgement sent to it is counted, not taken
    for one of its flows, and changes nothing it holds."""
    r = ReceiverSession(MQTT_5, pending=[3])
    for pkt in (Puback(3), Pubrec(3), Pubcomp(3)):
        out = r.receive(pkt)
        assert isinstance(out, Ignored) and out.packet == f"unexpected {type(pkt).__name__}"
    assert r.pending.keys() == {3}


def test_a_subscribe_id_is_in_use_until_its_suback_MQTT_2_3_1_2() -> None:
    """The uplink's SUBSCRIBE (the landed acknowledgements) takes an id from the same space
    as its PUBLISHes: no PUBLISH may get it while the SUBSCRIBE awaits its SUBACK, and it
    does not count against the Receive Maximum (5.0 4.9.0-2 counts PUBLISHes)."""
    s = SenderSession(MQTT_5, [Outgoing(1, 2)], last_packet_id=1)
    s.on_connack(True, clean_start=False, receive_maximum=2)
    sub = s.allocate_control()
    assert sub == 2 and s.send_quota() == 1
    assert s.allocate(2).packet_id == 3  # not 2: the SUBSCRIBE holds it
    assert s.control_done(sub) and not s.control_done(sub)
    assert sub not in s.inflight
