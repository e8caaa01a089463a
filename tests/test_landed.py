"""The end-to-end acknowledgement's parts (issue 24, design rule 9), without a network:
the range set, the acknowledgement's format and who is believed, and the store's
``awaiting_landing`` state. The real processes are in tests/test_end_to_end.py."""

from __future__ import annotations

import itertools
import json
import time
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from devkit.store_helpers import append, apply, begin
from pubcomp.sync import wire
from pubcomp.sync.endtoend import EndToEnd
from pubcomp.sync.ranges import RangeSet
from pubcomp.sync.session import OutState
from pubcomp.sync.store import Message, Reading, Store

# ------------------------------------------------------------------ ranges


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 300), st.integers(0, 20)), max_size=40))
def test_a_range_set_holds_exactly_the_integers_added(adds: list[tuple[int, int]]) -> None:
    rs = RangeSet()
    members: set[int] = set()
    for lo, width in adds:
        rs.add(lo, lo + width)
        members |= set(range(lo, lo + width + 1))
    assert {i for lo, hi in rs for i in range(lo, hi + 1)} == members
    ranges = list(rs)
    # Sorted, disjoint and not touching: neighbours are merged.
    assert all(a[1] + 1 < b[0] for a, b in itertools.pairwise(ranges))
    for lo in range(1, 330, 7):
        for hi in (lo, lo + 5):
            assert rs.covers(lo, hi) == (set(range(lo, hi + 1)) <= members)
    assert rs.count() == len(members)


def test_a_range_set_forgets_below_and_caps_the_oldest() -> None:
    rs = RangeSet([(1, 10), (20, 30), (40, 50)])
    rs.discard_below(25)
    assert rs.as_lists() == [[25, 30], [40, 50]]
    rs.add(60, 61)
    rs.cap(2)
    assert rs.as_lists() == [[40, 50], [60, 61]]
    with pytest.raises(ValueError):
        rs.add(5, 4)


# ------------------------------------------------------------------ the format


def _schema() -> jsonschema.Draft202012Validator:
    text = resources.files("pubcomp.sync").joinpath("schemas/landed.v1.json").read_text()
    doc = json.loads(text)
    jsonschema.Draft202012Validator.check_schema(doc)
    return jsonschema.Draft202012Validator(doc)


_ACK: dict[str, Any] = {
    "v": 1,
    "gateway": "gw-1",
    "epoch": "0a1b2c3d4e5f",
    "ingest": "ingest-1",
    "at": "2026-11-25T10:00:00.000Z",
    "landed": [[1, 200], [301, 400]],
}
_ACK_CASES: list[dict[str, Any]] = [
    _ACK,
    {**_ACK, "hmac": "0" * 64},
    {**_ACK, "hmac": "0" * 63},
    {**_ACK, "v": 2},
    {**_ACK, "landed": []},
    {**_ACK, "landed": [[0, 5]]},
    {**_ACK, "landed": [[1, 2, 3]]},
    {**_ACK, "landed": [[1]]},
    {**_ACK, "landed": [[1, 2**63]]},
    {**_ACK, "landed": [["1", 2]]},
    {**_ACK, "landed": [[1, 2]] * 513},
    {**_ACK, "ingest": "a/b"},
    {**_ACK, "ingest": ""},
    {**_ACK, "epoch": ""},
    {**_ACK, "at": "yesterday"},
    {**_ACK, "extra": 1},
    {k: v for k, v in _ACK.items() if k != "epoch"},
]


@pytest.mark.parametrize("doc", _ACK_CASES, ids=lambda d: json.dumps(d)[-50:])
def test_the_gateway_takes_what_the_landed_schema_takes(doc: dict[str, Any]) -> None:
    by_schema = _schema().is_valid(doc)
    by_model = not isinstance(wire.parse_landed(json.dumps(doc).encode()), str)
    assert by_model == by_schema


def test_an_acknowledgement_signed_with_the_gateway_key_verifies_only_with_it() -> None:
    master = bytes(range(32))
    key = wire.gateway_key(master, "gw-1")
    assert key != wire.gateway_key(master, "gw-2")
    payload = wire.encode_landed("gw-1", "e", "ingest-1", [(1, 9)], key=key)
    _schema().validate(json.loads(payload))
    ack = wire.parse_landed(payload)
    assert isinstance(ack, wire.LandedAck)
    assert wire.landed_mac_ok(ack, key)
    assert not wire.landed_mac_ok(ack, wire.gateway_key(master, "gw-2"))
    tampered = wire.parse_landed(payload.replace(b"[[1,9]]", b"[[1,99]]"))
    assert isinstance(tampered, wire.LandedAck) and not wire.landed_mac_ok(tampered, key)


def test_a_payload_names_its_span_only_end_to_end() -> None:
    plain = json.loads(wire.encode_payload("gw", [b'{"x":1}']))
    assert "outbox" not in plain
    e2e = json.loads(wire.encode_payload("gw", [b'{"x":1}'], ("ep", 5, 9)))
    assert e2e["outbox"] == {"epoch": "ep", "first": 5, "last": 9}


# ------------------------------------------------------------------ who is believed


def _e2e(key: bytes | None = None) -> EndToEnd:
    e = EndToEnd("gw-1", "ep", timeout=10, timeout_max=80, key=key)
    e.sent(500)
    return e


def _ack(**kw: Any) -> bytes:
    args: dict[str, Any] = {"gateway": "gw-1", "epoch": "ep", "ingest": "i", "ranges": [(1, 100)]}
    args.update(kw)
    key = args.pop("key", None)
    return wire.encode_landed(
        args["gateway"], args["epoch"], args["ingest"], args["ranges"], key=key
    )


def test_an_acknowledgement_is_believed_only_when_it_can_be_true() -> None:
    e = _e2e()
    assert e.judge(_ack()) is not None and e.covers(1, 100) and not e.covers(1, 101)
    # Each below changes nothing and is counted by kind.
    assert e.judge(_ack(ranges=[(101, 501)])) is None  # names seqs never sent
    assert e.judge(_ack(gateway="gw-2", ranges=[(101, 200)])) is None
    assert e.judge(_ack(epoch="old", ranges=[(101, 200)])) is None  # a replaced store's
    assert e.judge(b'{"v":1,"landed":"all"}') is None
    assert not e.covers(101, 101)
    assert dict(e.acks) == {
        "accepted": 1,
        "out_of_range": 1,
        "other_gateway": 1,
        "other_epoch": 1,
        "malformed": 1,
    }


def test_with_a_key_only_a_signed_acknowledgement_is_believed() -> None:
    key = wire.gateway_key(b"m" * 32, "gw-1")
    e = _e2e(key)
    assert e.judge(_ack()) is None  # unsigned
    assert e.judge(_ack(key=wire.gateway_key(b"x" * 32, "gw-1"))) is None  # wrong key
    assert not e.covers(1, 1)
    assert e.judge(_ack(key=key)) is not None and e.covers(1, 100)
    assert e.acks["bad_hmac"] == 2


def test_the_landing_timeout_doubles_while_nothing_lands() -> None:
    e = _e2e()
    assert e.timeout() == 10
    e.resent()
    e.resent()
    assert e.timeout() == 40
    e.resent()
    e.resent()
    assert e.timeout() == 80  # the cap
    e.landed()
    assert e.timeout() == 10


# ------------------------------------------------------------------ the store


def _readings(n: int) -> list[Reading]:
    return [Reading("t", float(i), "2026-11-25T00:00:00.000Z", "C") for i in range(n)]


def _deliver(s: Store, key: str, first: int, last: int, pid: int, *, awaiting: bool) -> None:
    m = Message(0, pid, 2, OutState.QUEUED, "t/gw/readings", first, last)
    begin(s, key, [m])
    if awaiting:
        apply(s, key, awaiting=[pid])
    else:
        apply(s, key, completed=[pid])


def test_a_completed_message_awaits_landing_and_goes_when_landed(tmp_path: Path) -> None:
    with Store(tmp_path / "s.db", gateway_id="gw") as s:
        for _ in range(4):
            append(s, _readings(5))  # rows of 5: seqs 1-5, 6-10, 11-15, 16-20
        _deliver(s, "k", 1, 10, 1, awaiting=True)
        st_ = s.stats()
        assert st_["awaiting_landing"] == 10 and st_["awaiting_messages"] == 1
        assert st_["backlog"] == 10 and s.taken_seq() == 10  # 11-20 still waiting
        assert s.oldest_undelivered_seq() == 11  # the oldest not yet delivered
        assert s.sent_seq() == 10
        # As the uplink commits them: lazily, in the group commit, freeing (rule 9).
        assert s.commit(lambda db: s.landed_in(db, [(1, 5)]), frees=True) == 0  # a part: nothing
        assert s.commit(lambda db: s.landed_in(db, [(1, 10)]), frees=True) == 10
        st_ = s.stats()
        assert st_["awaiting_landing"] == 0 and st_["backlog"] == 10
        assert st_["counters"]["landed"] == 10
        assert s.readings_between(1, 10) == []


def test_a_message_not_landed_in_time_is_queued_again_with_its_seqs(tmp_path: Path) -> None:
    with Store(tmp_path / "s.db", gateway_id="gw") as s:
        for _ in range(3):
            append(s, _readings(5))
        _deliver(s, "k", 1, 5, 1, awaiting=True)
        _deliver(s, "k", 6, 10, 2, awaiting=True)
        ids = [r["id"] for r in s.readings_between(1, 10)]
        again = s.commit(
            lambda db: s.resend_awaiting_in(
                db, "k", "t/gw/readings", delivered_before=time.time() + 1,
                landed=lambda lo, hi: (lo, hi) == (6, 10),
            ),
            frees=True,
        )  # fmt: skip
        assert [(m.first_seq, m.last_seq, m.state, m.packet_id) for m in again] == [
            (1, 5, OutState.QUEUED, None)
        ]
        _, _, msgs = s.load_session("k")
        assert [(m.first_seq, m.last_seq) for m in msgs] == [(1, 5)]
        assert [r["id"] for r in s.readings_between(1, 5)] == ids[:5]  # the same reading ids
        assert s.readings_between(6, 10) == []  # landed meanwhile: let go, not sent again
        c = s.counters()
        assert c["resent_not_landed"] == 5 and c["landed"] == 5


def test_drop_oldest_evicts_awaiting_messages_first(tmp_path: Path) -> None:
    with Store(tmp_path / "s.db", gateway_id="gw", policy="drop_oldest") as s:
        for _ in range(40):
            append(s, _readings(5))
        _deliver(s, "k", 1, 100, 1, awaiting=True)
        s.quota_bytes = s.stats()["store_bytes"]  # full from now on
        append(s, _readings(5))
        c = s.counters()
        assert c["dropped_awaiting"] >= 64 and c["dropped_quota"] >= 64
        assert s.stats()["awaiting_messages"] == 0
        assert s.readings_between(101, 105), "waiting readings are dropped only after those"


def test_a_completed_message_that_is_landed_already_goes_at_once(tmp_path: Path) -> None:
    with Store(tmp_path / "s.db", gateway_id="gw") as s:
        append(s, _readings(5))
        _deliver(s, "k", 1, 5, 1, awaiting=False)
        assert s.stats()["awaiting_messages"] == 0 and s.readings_between(1, 5) == []
