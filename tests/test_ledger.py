"""The gateway's ledger (issue 27, part 2): the record builder (pure, sync/ledger.py) and
the store's events and record op on real SQLite files (sync/store/ledger.py)."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from devkit.store_helpers import append, append_batches, apply, begin
from pubcomp.sync import wire
from pubcomp.sync.ledger import LEDGER_SENSOR, Event, build_record, merged
from pubcomp.sync.session import OutState
from pubcomp.sync.store import SCHEMA_VERSION, Message, Reading, Store

T0, T1 = 1_764_000_000.0, 1_764_000_300.0


def node_batch(node: str, boot: int, seq: int, n: int = 2) -> tuple[str, list[Reading]]:
    rs = [
        Reading(
            "t",
            float(i),
            "2026-11-25T00:00:00.000Z",
            "C",
            origin=node,
            id=f"{node}/{boot}/{seq}.{i}",
        )
        for i in range(n)
    ]
    return f"{node}/{boot}/{seq}", rs


def own(n: int) -> list[Reading]:
    return [Reading("t", float(i), "2026-11-25T00:00:00.000Z", "C") for i in range(n)]


def records(store: Store) -> list[dict[str, Any]]:
    """The ``$ledger`` records waiting in the outbox, oldest first."""
    out = []
    for _seq, reading in store.waiting(0, 1_000_000):
        if reading["sensor"] == LEDGER_SENSOR:
            out.append(reading)
    return out


# ------------------------------------------------------------------ the builder (pure)


def test_merged_joins_neighbours_and_overlaps_in_one_pass() -> None:
    assert merged([(1, 3), (4, 4), (6, 9), (7, 8), (10, 10), (20, 21)]) == [
        [1, 4],
        [6, 10],
        [20, 21],
    ]
    assert merged([]) == []


def test_record_groups_events_by_stream_kind_time_and_reason() -> None:
    """Every kind in its documented shape (docs/wire-format.md): skipped as ranges,
    evicted and dead_letter per time, refused and node_dropped per reason; ranges merged."""
    gw = "gw-7/3f9c"
    events = [
        Event(T0 + 1, gw, "skipped", 11, 10_000),
        Event(T0 + 2, gw, "evicted", 10_001, 10_050),
        Event(T0 + 2, gw, "evicted", 10_051, 10_060),
        Event(T0 + 2, "node-7/42", "evicted", 100, 104),
        Event(T0 + 9, gw, "evicted", 10_100, 10_100),
        Event(T0 + 3, gw, "dead_letter", 10_200, 10_201),
        Event(T0 + 4, "node-7/42", "refused", 7, 7, "invalid_time"),
        Event(T0 + 5, "node-7/42", "refused", 8, 8, "invalid_time"),
        Event(T0 + 5, "node-7/42", "refused", 30, 30, "too_many_readings"),
        Event(T0 + 6, "node-7/42", "node_dropped", 50, 60, "ring_overflow"),
        Event(T0 + 6, "node-7/41", "node_dropped", 3, 3, "spill_full"),
    ]
    rec = build_record(
        window=(T0, T1),
        top=10_300,
        store_stream=gw,
        events=events,
        held={gw: [[10_250, 10_300]], "node-7/42": [[4700, 4711]]},
        stored={"node-7/42": [[0, 4711]], "node-9/1": []},
    )
    at = wire.wire_time
    assert rec == {
        "v": 1,
        "window": [at(T0), at(T1)],
        "top": 10_300,
        "streams": {
            gw: {
                "held": [[10_250, 10_300]],
                "skipped": [[11, 10_000]],
                "evicted": [
                    {"at": at(T0 + 2), "ranges": [[10_001, 10_060]]},
                    {"at": at(T0 + 9), "ranges": [[10_100, 10_100]]},
                ],
                "dead_letter": [{"at": at(T0 + 3), "ranges": [[10_200, 10_201]]}],
            },
            "node-7/41": {"node_dropped": {"spill_full": [[3, 3]]}},
            "node-7/42": {
                "stored": [[0, 4711]],
                "held": [[4700, 4711]],
                "evicted": [{"at": at(T0 + 2), "ranges": [[100, 104]]}],
                "refused": {"invalid_time": [[7, 8]], "too_many_readings": [[30, 30]]},
                "node_dropped": {"ring_overflow": [[50, 60]]},
            },
        },
    }
    json.dumps(rec, allow_nan=False)  # plain JSON


def test_record_of_a_quiet_store_still_tells_its_top_and_nothing_held() -> None:
    rec = build_record(window=(T0, T1), top=5, store_stream="g/e", events=[], held={}, stored={})
    assert rec["streams"] == {"g/e": {"held": []}} and rec["top"] == 5


def test_an_unknown_event_kind_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown ledger event kind"):
        build_record(
            window=(T0, T1), top=0, store_stream="g/e", events=[Event(T0, "g/e", "lost", 1, 1)],
            held={}, stored={},
        )  # fmt: skip


# ------------------------------------------------------------------ the store's events


def record_now(store: Store) -> int:
    """The record op, committed as the gateway's ledger timer submits it."""
    seq: int = store.commit(lambda db: store.ledger_record_in(db))
    return seq


def deliver_all(store: Store) -> None:
    """Every waiting reading in one message, completed by the broker (hop mode)."""
    top = store.given_seq()
    begin(store, "k", [Message(0, 1, 2, OutState.QUEUED, "t", 1, top)])
    apply(store, "k", released=[1])
    apply(store, "k", completed=[1])


def test_skipped_block_is_told_at_the_first_commit_after_an_open(tmp_path: Path) -> None:
    """After a restart the seqs go on above the floor: the block between the newest seq
    on disk and the floor is a ``skipped`` event, written with the first reading given
    (an open that gives nothing tells nothing; a second open does not tell it again).
    Old code: no ``ledger_events`` table, no record op (AttributeError)."""
    path = tmp_path / "s.db"
    with Store(path, gateway_id="gw") as s:
        append(s, own(3))
        deliver_all(s)  # rows gone, the floor raised a block ahead
        record_now(s)  # a clean stop's record: seq 4, the highest given
        stream = s.store_stream
    with Store(path, gateway_id="gw") as s:
        assert s.ledger_events() == []  # nothing given yet: nothing skipped yet
    with Store(path, gateway_id="gw") as s:
        first, _ = append(s, own(2))
        assert first == 3 + 10_000 + 1  # the floor: a block above the highest given
        assert [(e.stream, e.kind, e.lo, e.hi) for e in s.ledger_events()] == [
            (stream, "skipped", 5, 10_003)
        ]
        append(s, own(1))
        assert len(s.ledger_events()) == 1  # told once per open
        seq = record_now(s)
        rec = records(s)[-1]
        assert rec["id"] == f"gw/{s.epoch}/{seq}" and rec["value"] is None
        assert rec["record"]["streams"][stream]["skipped"] == [[5, 10_003]]
        # The clean stop's record (4) waits for the uplink like any reading.
        assert rec["record"]["streams"][stream]["held"] == [[4, 4], [10_004, 10_006]]
        assert rec["record"]["top"] == 10_006
        assert s.ledger_events() == []  # taken by the record, in its transaction


def test_drop_oldest_tells_the_store_seqs_and_the_node_messages_it_evicted(tmp_path: Path) -> None:
    """Under a small quota ``drop_oldest`` drops the oldest rows: the record's ``evicted``
    names their store seqs and, for node rows, the node messages (src, src_seq), and
    evicted + held + the record's own seq tile every seq given. Old code: no event."""
    with Store(
        tmp_path / "s.db", gateway_id="gw", quota_bytes=64 * 1024, policy="drop_oldest"
    ) as s:
        for q in range(200):  # a commit each, as the ingress's messages come
            assert append_batches(s, [node_batch("n1", 3, q, 50)]) == [True]
        assert s.stats()["counters"]["dropped_quota"] > 0
        record_now(s)
        rec = records(s)[-1]["record"]
        gw = rec["streams"][s.store_stream]
        evicted = [r for e in gw["evicted"] for r in e["ranges"]]
        node = rec["streams"]["n1/3"]
        node_evicted = [r for e in node["evicted"] for r in e["ranges"]]
        assert evicted[0][0] == 1 and node_evicted[0][0] == 0
        # Each node message is one row of 50 readings: the same cut in both streams.
        assert (evicted[-1][1]) // 50 == node_evicted[-1][1] + 1
        assert merged(sorted(map(tuple, evicted + gw["held"]))) == [[1, rec["top"]]]  # type: ignore[arg-type]
        assert merged(sorted(map(tuple, node_evicted + node["held"]))) == [[0, 199]]  # type: ignore[arg-type]
        assert node["stored"] == [[0, 199]]


def test_the_quota_never_evicts_a_ledger_record(tmp_path: Path) -> None:
    """What a record tells is told nowhere else: its row outlives the quota."""
    with Store(
        tmp_path / "s.db", gateway_id="gw", quota_bytes=64 * 1024, policy="drop_oldest"
    ) as s:
        append(s, own(5))
        seq = record_now(s)
        for _ in range(200):
            append(s, own(50))
        assert s.stats()["counters"]["dropped_quota"] > 0
        assert next(r["id"] for r in records(s)) == f"gw/{s.epoch}/{seq}"


def test_dead_letters_are_told_with_their_node_messages(tmp_path: Path) -> None:
    """A permanent refusal by the broker moves readings to ``dead_letter``: the ledger
    tells it in the same transaction."""
    with Store(tmp_path / "s.db", gateway_id="gw") as s:
        append_batches(s, [node_batch("n1", 1, 7), node_batch("n1", 1, 8)])
        begin(s, "k", [Message(0, 1, 2, OutState.QUEUED, "t", 1, 4)])
        apply(s, "k", refused=[(1, 0x87, True)])
        got = {(e.stream, e.kind, e.lo, e.hi) for e in s.ledger_events()}
        assert got == {(s.store_stream, "dead_letter", 1, 4), ("n1/1", "dead_letter", 7, 8)}


def test_node_dropped_is_stored_with_the_message_that_carries_it_once(tmp_path: Path) -> None:
    """A node's report of what it gave up is stored in the transaction of its message,
    and not again when the message is retried (its key seen before)."""
    with Store(tmp_path / "s.db", gateway_id="gw") as s:
        key, rs = node_batch("n1", 2, 10)
        drops = {key: [("n1/2", "ring_overflow", 3, 9)]}
        assert s.commit(lambda db: s.append_batches_in(db, [(key, rs)], dropped=drops)) == [True]
        assert s.commit(lambda db: s.append_batches_in(db, [(key, rs)], dropped=drops)) == [False]
        got = [(e.stream, e.kind, e.lo, e.hi, e.reason) for e in s.ledger_events()]
        assert got == [("n1/2", "node_dropped", 3, 9, "ring_overflow")]


def test_refusals_coalesce_into_one_range(tmp_path: Path) -> None:
    with Store(tmp_path / "s.db", gateway_id="gw") as s:
        for q in (5, 6, 7, 9):
            s.commit(
                lambda db, q=q: s.ledger_event_in(db, [("n1/1", "refused", q, q, "invalid_time")])
            )
        got = [(e.lo, e.hi) for e in s.ledger_events()]
        assert got == [(5, 7), (9, 9)]


def test_outbox_rows_name_the_node_message_they_hold(tmp_path: Path) -> None:
    """Schema 5: ``src`` (node/boot) and ``src_seq`` at append; NULL for the gateway's
    own readings; a split row keeps them."""
    path = tmp_path / "s.db"
    with Store(path, gateway_id="gw") as s:
        append(s, own(2))
        append_batches(s, [node_batch("n1", 4, 17, 3)])
        s.commit(lambda db: s.split_row_in(db, 3, 10_000, max_readings=1))
    db = sqlite3.connect(path)
    rows = db.execute("SELECT seq, n, src, src_seq FROM outbox ORDER BY seq").fetchall()
    db.close()
    assert SCHEMA_VERSION == 5
    assert rows == [(1, 2, None, None), (3, 1, "n1/4", 17), (4, 1, "n1/4", 17), (5, 1, "n1/4", 17)]


def test_a_schema_4_store_is_migrated_and_its_rows_named(tmp_path: Path) -> None:
    """A file of the previous pubcomp: the columns are added and the rows already
    waiting are named from their readings' ids, once, at the open."""
    path = tmp_path / "s.db"
    with Store(path, gateway_id="gw") as s:
        append(s, own(2))
        append_batches(s, [node_batch("n1", 4, 17, 3), node_batch("n2", 1, 0, 1)])
    db = sqlite3.connect(path)
    db.execute("ALTER TABLE outbox DROP COLUMN src")
    db.execute("ALTER TABLE outbox DROP COLUMN src_seq")
    db.execute("DROP TABLE ledger_events")
    db.execute("UPDATE meta SET value = '4' WHERE key = 'schema_version'")
    db.commit()
    db.close()
    with Store(path, gateway_id="gw") as s:
        record_now(s)
        rec = records(s)[-1]["record"]
        assert rec["streams"]["n1/4"]["held"] == [[17, 17]]
        assert rec["streams"]["n2/1"]["held"] == [[0, 0]]
    db = sqlite3.connect(path)
    assert db.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()[0] == "5"
    db.close()


def test_the_record_travels_in_the_cloud_wire_format(tmp_path: Path) -> None:
    """The record's reading passes the shipped cloud schema, inside a payload as the
    uplink builds it; a node cannot send a ``$`` sensor."""
    with Store(tmp_path / "s.db", gateway_id="gw") as s:
        append_batches(s, [node_batch("n1", 1, 0)])
        seq = record_now(s)
        bodies = s.bodies_between(seq, seq)
        payload = json.loads(wire.encode_payload("gw", bodies, (s.epoch, seq, seq)))
        assert not list(wire.validator(wire.CLOUD_SCHEMA).iter_errors(payload))
        (r,) = payload["readings"]
        assert r["sensor"] == "$ledger" and r["origin"] == "gw" and r["unit"] is None
        assert r["record"]["streams"]["n1/1"]["stored"] == [[0, 0]]


def test_a_skip_told_by_the_records_own_seq_waits_for_the_next_record(tmp_path: Path) -> None:
    """After a restart with nothing else to store, the record is the first seq given: the
    block it jumps is told by the next record, not deleted with the events it took."""
    path = tmp_path / "s.db"
    with Store(path, gateway_id="gw") as s:
        append(s, own(3))
        deliver_all(s)
        record_now(s)
        deliver_all(s)
        stream = s.store_stream
    with Store(path, gateway_id="gw") as s:
        first = record_now(s)
        assert first == 3 + 10_000 + 1  # the floor, raised when 3 was the highest given
        assert "skipped" not in records(s)[-1]["record"]["streams"][stream]
        record_now(s)
        assert records(s)[-1]["record"]["streams"][stream]["skipped"] == [[5, 10_003]]


def test_the_documented_examples_follow_the_schemas() -> None:
    """docs/wire-format.md: the node message with ``dropped`` and the ``$ledger`` reading
    are valid JSON that the shipped schemas and the ingress's model take, in the shapes
    the record builder makes."""
    import re

    doc = (Path(__file__).parent.parent / "docs/wire-format.md").read_text()

    def blocks(heading: str) -> list[Any]:
        section = doc[doc.index(heading) :]
        section = section[: section.index("\n## ", 1)]
        return [json.loads(b) for b in re.findall(r"```json\n(.*?)```", section, re.S)]

    node = [b for b in blocks("## Node to gateway") if "dropped" in b]
    assert len(node) == 1
    assert not list(wire.validator(wire.NODE_SCHEMA).iter_errors(node[0]))
    msg = wire.parse_node_message(json.dumps(node[0]).encode())
    assert isinstance(msg, wire.NodeMessage)
    assert msg.dropped_ranges() == [("node-7/42", "ring_overflow", 1100, 1187)]
    (reading,) = blocks("## The ledger")
    payload = {"v": 1, "gateway": "gw-7", "readings": [reading]}
    assert not list(wire.validator(wire.CLOUD_SCHEMA).iter_errors(payload))
    rec = reading["record"]
    assert reading["sensor"] == LEDGER_SENSOR and set(rec) == {"v", "window", "top", "streams"}
    shapes = {"held": list, "stored": list, "skipped": list, "evicted": list}
    shapes |= {"dead_letter": list, "refused": dict, "node_dropped": dict}
    for stream in rec["streams"].values():
        assert set(stream) <= set(shapes)
        assert all(isinstance(v, shapes[k]) for k, v in stream.items())


@pytest.mark.parametrize(
    ("payload", "key"),
    [
        (
            b'{"v":1,"node":"n-1","boot":3,"seq":41,"ts":"2026-02-30T00:00:00Z","readings":[]}',
            ("n-1", 3, 41),
        ),
        (b'{"v": 1, "node": "n-1", "boot": 3, "seq": 41}', ("n-1", 3, 41)),
        (b'{"v":1,"node":"n-1","boot":3,"seq":41,"readings":' + b"x" * 100_000, ("n-1", 3, 41)),
        (b'{"v":1,"node":"n-1","boot":3}', None),
        (b'{"v":1,"node":"n-1","boot":-3,"seq":41}', None),
        (b'{"v":1,"node":"n-1","boot":99999999999999999,"seq":41}', None),
        (b"\xff\xfe not json", None),
        (b" " * 600 + b'{"node":"n-1","boot":3,"seq":41}', None),  # past the head read
    ],
)
def test_a_refused_message_names_its_position_from_its_head(
    payload: bytes, key: tuple[str, int, int] | None
) -> None:
    """The ingress tells the ledger which position it refused only when the message's
    first bytes name its node, boot and seq (it may be oversize or not JSON at all)."""
    assert wire.message_key(payload) == key


def test_seqs_of_an_op_undone_are_told_as_skipped(tmp_path: Path) -> None:
    """An op that gave seqs and then failed (a value that is not finite, after two good
    readings) is undone alone; its seqs are never given again, and the ledger tells them
    as ``skipped`` with the next seqs given, so the cloud does not count them missing."""
    with Store(tmp_path / "s.db", gateway_id="gw") as s:
        append(s, own(3))
        bad = [*own(2), Reading("t", float("nan"), "2026-11-25T00:00:00.000Z", "C")]
        ok, err = s.commit_ops([(lambda db: s.append_in(db, bad), False)])[0]
        assert not ok and isinstance(err, ValueError)
        assert s.ledger_events() == []  # told with the next seqs, in their transaction
        assert append(s, own(1)) == (6, 6)
        got = [(e.stream, e.kind, e.lo, e.hi) for e in s.ledger_events()]
        assert got == [(s.store_stream, "skipped", 4, 5)]
