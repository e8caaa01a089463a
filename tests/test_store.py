"""The durable session store on real SQLite files (design rules 1-8)."""

from __future__ import annotations

import contextlib
import errno
import json
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from devkit.store_helpers import append, append_batches, apply, begin
from pubcomp.sync import wire
from pubcomp.sync.session import Outgoing, OutState
from pubcomp.sync.store import (
    ROW_BYTES,
    ROW_READINGS,
    SCHEMA_VERSION,
    Message,
    Reading,
    Store,
    StoreError,
    StoreFull,
    held_receive_ids,
    is_disk_full,
    is_unwritable,
    unpack_body,
)

QUEUED = OutState.QUEUED  # (brevity)


def readings(n: int, start: int = 0) -> list[Reading]:
    return [
        Reading("t", float(i), "2026-11-21T00:00:00.000Z", "C") for i in range(start, start + n)
    ]


def two(a1: int, a2: int, b1: int, b2: int) -> list[Message]:
    """Two new messages, packet ids 1 and 2, over the given seq ranges."""
    return [
        Message(0, 1, 2, QUEUED, "t", a1, a2),
        Message(0, 2, 2, QUEUED, "t", b1, b2),
    ]


def test_pragmas_wal_and_synchronous_full(tmp_path: Path) -> None:
    with Store(tmp_path / "s.db") as s:
        pragmas = s.pragmas()
        assert pragmas["journal_mode"] == "wal"
        assert pragmas["synchronous"] == 2  # FULL


def test_epoch_is_random_per_file_and_stable_across_opens(tmp_path: Path) -> None:
    with Store(tmp_path / "a.db", gateway_id="gw") as a:
        epoch = a.epoch
    with Store(tmp_path / "a.db") as a2:
        assert (a2.epoch, a2.gateway_id) == (epoch, "gw")
    with Store(tmp_path / "b.db", gateway_id="gw") as b:
        assert b.epoch != epoch  # a replaced SD card never repeats reading ids


def test_seq_is_never_reused_after_delivery(tmp_path: Path) -> None:
    with Store(tmp_path / "s.db") as s:
        assert append(s, readings(3)) == (1, 3)
        begin(s, "k", [Message(0, 1, 2, QUEUED, "t", 1, 3)])
        apply(s, "k", released=[1])
        assert apply(s, "k", completed=[1]) == 3
        assert append(s, readings(1)) == (4, 4)  # AUTOINCREMENT: ids are unique forever


def test_message_lifecycle_rules_1_to_3(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    with Store(path) as s:
        append(s, readings(4))  # a row each: messages take whole rows
        append(s, readings(6, 4))
        m1 = Message(0, 7, 2, QUEUED, "t", 1, 4)
        m2 = Message(0, 8, 2, QUEUED, "t", 5, 10)
        begin(s, "k", [m1, m2])
        assert s.taken_seq() == 10 and s.waiting(10, 5) == []
    # Rule 1: after a reopen (a crash), ids and ranges are there, in send order.
    with Store(path) as s:
        _, last, msgs = s.load_session("k")
        assert last == 8
        assert [(m.packet_id, m.state, m.first_seq, m.last_seq) for m in msgs] == [
            (7, "PUBLISH_SENT", 1, 4),
            (8, "PUBLISH_SENT", 5, 10),
        ]
        apply(s, "k", released=[7])  # rule 2
    with Store(path) as s:
        assert [m.state for m in s.load_session("k")[2]] == ["PUBREL_SENT", "PUBLISH_SENT"]
        # Rule 3: PUBCOMP deletes the message and exactly its readings.
        assert apply(s, "k", completed=[7]) == 4
        assert s.stats()["backlog"] == 6
        assert [r["value"] for r in s.readings_between(1, 10)] == [4.0, 5, 6, 7, 8, 9]


def test_session_loss_requeues_with_the_same_readings(tmp_path: Path) -> None:
    with Store(tmp_path / "s.db", gateway_id="gw") as s:
        append(s, readings(3))
        append(s, readings(3, 3))
        begin(
            s,
            "k",
            [
                Message(0, 1, 2, QUEUED, "t", 1, 3),
                Message(0, 2, 2, QUEUED, "t", 4, 6),
            ],
        )
        apply(s, "k", released=[1])
        before = [r["id"] for r in s.readings_between(1, 6)]
        assert s.commit(lambda db: s.requeue_lost_in(db, "k"), frees=True) == 6
        msgs = s.load_session("k")[2]
        assert [(m.packet_id, m.state) for m in msgs] == [
            (None, QUEUED),
            (None, QUEUED),
        ]
        assert s.counters()["resent_after_session_loss"] == 6
        # Same reading ids: the cloud dedup recognises any copy the broker delivered.
        assert [r["id"] for r in s.readings_between(1, 6)] == before
        # New ids for the queued messages (rule 1 again), original order kept.
        msgs[0].packet_id, msgs[1].packet_id = 3, 4
        begin(s, "k", msgs)
        assert [(m.packet_id, m.first_seq) for m in s.load_session("k")[2]] == [(3, 1), (4, 4)]


def test_refusals_dead_letter_or_requeue(tmp_path: Path) -> None:
    with Store(tmp_path / "s.db", gateway_id="gw") as s:
        append(s, readings(2))
        append(s, readings(2, 2))
        begin(
            s,
            "k",
            [
                Message(0, 1, 2, QUEUED, "t", 1, 2),
                Message(0, 2, 2, QUEUED, "t", 3, 4),
            ],
        )
        apply(s, "k", refused=[(1, 0x87, True), (2, 0x97, False)])
        st = s.stats()
        assert st["dead_letter"] == 2 and st["backlog"] == 2
        dead = [(d["id"], d["reason"]) for d in s.dead_letters()]
        assert dead == [(f"gw/{s.epoch}/1", 0x87), (f"gw/{s.epoch}/2", 0x87)]
        assert [(m.packet_id, m.state) for m in s.load_session("k")[2]] == [(None, QUEUED)]


def test_adopt_orphans_from_another_session(tmp_path: Path) -> None:
    with Store(tmp_path / "s.db") as s:
        append(s, readings(2))
        begin(s, "old-broker#gw", [Message(0, 5, 2, QUEUED, "t", 1, 2)])
        assert s.commit(lambda db: s.adopt_orphans_in(db, "new-broker#gw"), frees=True) == 1
        assert [(m.packet_id, m.state) for m in s.load_session("new-broker#gw")[2]] == [
            (None, QUEUED)
        ]


def test_quota_refuse_new(tmp_path: Path) -> None:
    with Store(tmp_path / "s.db", quota_bytes=256 * 1024, policy="refuse_new") as s:
        with pytest.raises(StoreFull, match="refuse_new"):
            for i in range(1000):
                append(s, readings(50, i * 50))
        kept = s.stats()["backlog"]
        assert kept > 0
        # Nothing already stored was lost, and a refused append stored nothing.
        assert kept % 50 == 0


def test_quota_drop_oldest_never_drops_inflight(tmp_path: Path) -> None:
    # 64 kB: 10,000 readings take about 100 kB in packed rows.
    with Store(tmp_path / "s.db", quota_bytes=64 * 1024, policy="drop_oldest") as s:
        append(s, readings(10))
        begin(s, "k", [Message(0, 1, 2, QUEUED, "t", 1, 10)])
        for i in range(200):
            append(s, readings(50, 100 + i * 50))
        st = s.stats()
        assert st["counters"]["dropped_quota"] > 0
        assert st["store_bytes"] <= 64 * 1024 * 1.25
        assert len(s.readings_between(1, 10)) == 10  # the in-flight message is intact
        # What survives is the newest data.
        newest = s.waiting(10, 100_000)
        assert newest[-1][1]["value"] == 100 + 200 * 50 - 1


def test_corrupt_store_is_moved_aside_never_deleted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "s.db"
    with Store(path, gateway_id="gw") as s:
        append(s, readings(5))
        old_epoch = s.epoch
    raw = bytearray(path.read_bytes())
    raw[100:4000] = b"\xde\xad" * 1950  # wreck the header and the first pages
    path.write_bytes(bytes(raw))
    with Store(path, gateway_id="gw") as s:
        assert s.moved_aside is not None and s.moved_aside.exists()
        assert s.moved_aside.read_bytes() == bytes(raw)  # kept byte for byte
        assert ".corrupt-" in s.moved_aside.name
        assert s.epoch != old_epoch and s.stats()["backlog"] == 0
        assert s.stats()["replaced_corrupt_store"] == str(s.moved_aside)
    assert "is corrupt" in caplog.text and "moved aside" in caplog.text


def test_non_finite_values_are_refused(tmp_path: Path) -> None:
    with Store(tmp_path / "s.db") as s, pytest.raises(ValueError, match="not finite"):
        append(s, [Reading("t", float("nan"))])


# ------------------------------------------------------------ command line


def pubcomp(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pubcomp", *args], capture_output=True, text=True, timeout=60
    )


def test_import_is_all_or_nothing_and_names_the_bad_line(tmp_path: Path) -> None:
    store = tmp_path / "s.db"
    good = tmp_path / "good.jsonl"
    good.write_text(
        "\n".join(
            json.dumps({"sensor": "t", "ts": None, "value": i, "unit": "C"}) for i in range(5)
        )
    )
    res = pubcomp("store", "import", "--store", str(store), "--gateway-id", "gw", str(good))
    assert res.returncode == 0 and "imported 5 readings" in res.stdout
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        '{"sensor": "t", "value": 1}\n{"sensor": "t", "value": 2}\n{"sensor": "t", "value": "x"}\n'
    )
    res = pubcomp("store", "import", "--store", str(store), str(bad))
    assert res.returncode == 1
    assert f"{bad}:3: 'value' must be a finite number" in res.stderr
    assert "nothing was imported" in res.stderr
    stats = json.loads(pubcomp("store", "stats", "--store", str(store), "--json").stdout)
    assert stats["backlog"] == 5 and stats["gateway_id"] == "gw"


def test_stats_text(tmp_path: Path) -> None:
    store = tmp_path / "s.db"
    with Store(store, gateway_id="gw-9") as s:
        append(s, readings(3))
    out = pubcomp("store", "stats", "--store", str(store)).stdout
    assert "backlog" in out and "3 readings" in out and "gw-9" in out


# --------------------------------------------------------------- full disk


@contextlib.contextmanager
def tiny_tmpfs(path: Path, size: str) -> Iterator[Path]:
    path.mkdir()
    res = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
        capture_output=True,
        text=True,
    )
    if res.returncode:
        pytest.skip(f"cannot mount a tmpfs here to fill a disk: {res.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def test_full_disk_refuses_new_and_keeps_delivering(tmp_path: Path) -> None:
    """A real full disk: new readings are refused (not acknowledged), nothing committed is
    lost, and deliveries still commit thanks to the reserve, which frees room again."""
    with tiny_tmpfs(tmp_path / "disk", "4m") as disk:
        s = Store(disk / "s.db")
        assert s.reserve_path.stat().st_size == 2 << 20
        stored = 0
        with pytest.raises(StoreFull, match="disk full"):
            for i in range(10_000):
                append(s, readings(100, i * 100))
                stored += 100
        assert stored > 0 and s.refused_disk_full == 1
        assert s.stats()["backlog"] == stored  # every committed reading is still there
        # Deliveries (batch-sized messages, as the uplink sends) commit although the disk
        # is full: the reserve is spent for them.
        delivered = 0
        for pid, first in enumerate(range(1, stored + 1, 100), 1):
            begin(s, "k", [Message(0, pid, 2, QUEUED, "t", first, first + 99)])
            delivered += apply(s, "k", completed=[pid])
        assert (delivered == stored and not s.reserve_path.exists()) or delivered == stored
        append(s, readings(10))  # room again for new readings
        assert s.stats()["backlog"] == 10
        s.close()


def _coded(message: str, code: int) -> sqlite3.OperationalError:
    exc = sqlite3.OperationalError(message)
    exc.sqlite_errorcode = code  # type: ignore[attr-defined]
    return exc


def test_write_failures_are_classified_by_code_never_by_message() -> None:
    """Disk full and a refusing file system, by SQLite result code (extended codes
    included) or errno; a message that merely says "full" is neither."""
    full = [_coded("whatever", sqlite3.SQLITE_FULL), OSError(errno.ENOSPC, "x")]
    refusing = [
        _coded("disk I/O error", 778),  # SQLITE_IOERR_WRITE
        _coded("attempt to write a readonly database", sqlite3.SQLITE_READONLY),
        _coded("unable to open database file", sqlite3.SQLITE_CANTOPEN),
        OSError(errno.EROFS, "x"),
        OSError(errno.EIO, "x"),
    ]
    neither = [
        _coded("database or disk is full", sqlite3.SQLITE_CONSTRAINT),
        sqlite3.OperationalError("database or disk is full"),  # no code at all
        OSError(errno.EACCES, "full"),
    ]
    assert all(is_disk_full(e) and not is_unwritable(e) for e in full)
    assert all(is_unwritable(e) and not is_disk_full(e) for e in refusing)
    assert not any(is_disk_full(e) or is_unwritable(e) for e in neither)


def test_outgoing_state_enum_matches_store_text() -> None:
    assert Outgoing(1, 2).state == "PUBLISH_SENT" == OutState.PUBLISH_SENT


def test_a_message_key_commits_with_its_readings_rule_5(tmp_path: Path) -> None:
    """A receiver (the ingress) stores what it got with its message key in one op of the
    group commit, before its PUBACK: an op that fails part way leaves neither behind, so
    the node's retry is stored, not taken for a message seen before."""
    path = tmp_path / "s.db"
    r = [Reading("t", 1.5, origin="node-1", id="node-1/3/9.0")]
    with Store(path, gateway_id="gw") as s:
        assert append_batches(s, [("node-1/3/9", r)]) == [True]

        def crash(db: sqlite3.Connection) -> None:
            s.append_batches_in(db, [("node-1/3/10", r)])
            raise RuntimeError("crash before commit")

        with pytest.raises(RuntimeError):
            s.commit(crash)
    with Store(path) as s:  # after a restart: message 9 and its reading, not message 10
        assert [r["id"] for r in s.readings_between(1, 10)] == ["node-1/3/9.0"]
        assert append_batches(s, [("node-1/3/9", r), ("node-1/3/10", r)]) == [False, True]


def test_held_receive_ids_reads_a_store_left_behind_and_says_store_error_otherwise(
    tmp_path: Path,
) -> None:
    """What the ingest reads from a previous version's store file: the ids, read only;
    a file that is no store is a StoreError (the reader need not know SQLite)."""
    path = tmp_path / "s.db"
    with Store(path, gateway_id="gw"):
        pass
    db = sqlite3.connect(path)  # as a receiver of before kept its QoS 2 ids
    db.execute("INSERT INTO in_qos2 VALUES ('in', 9, 0)")
    db.commit()
    db.close()
    assert held_receive_ids(path) == [("in", 9)]
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"not a database, not at all" * 100)
    with pytest.raises(StoreError):
        held_receive_ids(junk)


def test_group_commit_with_message_keys_stores_each_message_once(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    with Store(path, gateway_id="gw") as s:
        r = [Reading("t", 1.0, None, "C", origin="node-1", id="node-1/3/9.0")]
        assert append_batches(
            s,
            [("node-1/3/9", r), ("node-2/1/1", readings(2)), (None, readings(1))],
            state={"pulse:rain": "1012"},
        ) == [True, True, True]
        # A node retrying a message it never saw acknowledged: acknowledged, not stored again.
        assert append_batches(s, [("node-1/3/9", r), ("node-1/3/10", r)]) == [False, True]
        assert s.stats()["backlog"] == 5
        assert s.get_state("pulse:rain") == "1012"
    with Store(path) as s:  # keys and state are durable
        assert append_batches(s, [("node-1/3/9", r)]) == [False]
        assert s.commit(lambda db: s.prune_seen_in(db, -1)) == 2  # node-1 boot 3, node-2 boot 1
        assert append_batches(s, [("node-1/3/9", r)]) == [True]


def test_a_store_made_before_schema_3_is_packed_with_its_seqs_and_ids(tmp_path: Path) -> None:
    """Schema 1 and 2 kept one outbox row per reading. Opening such a file packs them
    once: the same ids and values, in-flight ranges intact, seqs never given twice."""
    from pubcomp.sync.store import SCHEMA

    path = tmp_path / "old.db"
    db = sqlite3.connect(path)
    db.executescript(
        """
        CREATE TABLE outbox (
            seq INTEGER PRIMARY KEY AUTOINCREMENT, rid TEXT, origin TEXT NOT NULL,
            sensor TEXT NOT NULL, ts TEXT, value REAL, unit TEXT, flags TEXT,
            queued REAL NOT NULL);
        CREATE TABLE out_inflight (
            ord INTEGER PRIMARY KEY AUTOINCREMENT, session TEXT NOT NULL, packet_id INTEGER,
            state TEXT NOT NULL, qos INTEGER NOT NULL, topic TEXT NOT NULL,
            first_seq INTEGER NOT NULL, last_seq INTEGER NOT NULL, UNIQUE (session, packet_id));
        """
        + SCHEMA
    )
    db.executemany(
        "INSERT INTO meta VALUES (?, ?)",
        [("epoch", "e0"), ("gateway_id", "gw"), ("schema_version", "1")],
    )
    old = [(None, "gw", "t", "2026-11-21T00:00:00.000Z", float(i), "C", None, 0) for i in range(12)]
    old[3] = ("node-1/2/9.0", "node-1", "h", None, None, None, "clock_unsynced,x", 0)
    db.executemany(
        "INSERT INTO outbox (rid, origin, sensor, ts, value, unit, flags, queued) "
        "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
        old,
    )
    db.execute("DELETE FROM outbox WHERE seq > 6")  # delivered; AUTOINCREMENT remembers 12
    db.execute(
        "INSERT INTO out_inflight (session, packet_id, state, qos, topic, first_seq, last_seq) "
        "VALUES ('k', 4, 'PUBREL_SENT', 2, 't', 1, 4)"
    )
    db.commit()
    db.close()
    with Store(path) as s:
        assert [r["id"] for r in s.readings_between(1, 4)] == [
            "gw/e0/1",
            "gw/e0/2",
            "gw/e0/3",
            "node-1/2/9.0",
        ]
        assert s.readings_between(4, 4)[0]["flags"] == ["clock_unsynced", "x"]
        assert [r["value"] for _, r in s.waiting(4, 10)] == [4.0, 5.0]
        assert apply(s, "k", completed=[4]) == 4  # rule 3 on the packed rows
        assert s.stats()["backlog"] == 2
        first, _ = append(s, readings(1))
        assert first > 12  # above the AUTOINCREMENT high-water mark of the old file
    db = sqlite3.connect(path)
    cols = [r[1] for r in db.execute("PRAGMA table_info(outbox)")]
    inflight = db.execute("SELECT sql FROM sqlite_master WHERE name = 'out_inflight'").fetchone()
    version = db.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()[0]
    db.close()
    assert cols == ["seq", "n", "marks", "body", "queued"] and version == str(SCHEMA_VERSION)
    assert "AUTOINCREMENT" not in inflight[0]  # one page less per commit


def test_packed_rows_are_split_for_a_small_broker_and_keep_their_seqs(tmp_path: Path) -> None:
    with Store(tmp_path / "s.db", gateway_id="gw") as s:
        append(s, readings(40))
        before = s.readings_between(1, 40)
        assert s.commit(lambda db: s.split_row_in(db, 1, 600), frees=True) > 1
        rows = s.waiting_rows(0, 100)
        assert all(len(body) <= 600 for _, _, body in rows)
        assert rows[0][0] == 1 and sum(n for _, n, _ in rows) == 40
        assert s.readings_between(1, 40) == before  # the same ids (gw/epoch/seq), in order


def test_a_row_holds_at_most_its_readings_and_bytes_and_keeps_the_order(tmp_path: Path) -> None:
    """One append of 250 readings with long sensor names: rows of at most ROW_READINGS
    readings and ROW_BYTES of encoded readings, contiguous seqs, every reading in order,
    and each row's marks from its own readings only."""
    name = "s" * 150  # 100 such readings encode to about 25 kB: more than a row holds
    batch = [
        Reading(f"{name}{i}", float(i), "2026-11-21T00:00:00.000Z", "C", flags=["late"] * (i == 7))
        for i in range(250)
    ]
    with Store(tmp_path / "s.db", gateway_id="gw") as s:
        assert append(s, batch) == (1, 250)
        rows = s.rows_between(1, 250)
        bodies = [unpack_body(b) for b in s.bodies_between(1, 250)]
        got = s.readings_between(1, 250)
    assert len(rows) > 3  # 250 readings need 3 rows by count; the bytes split more
    assert all(n <= ROW_READINGS for _, n, _ in rows)
    assert all(len(body) <= ROW_BYTES for body in bodies)
    assert rows[0][0] == 1 and sum(n for _, n, _ in rows) == 250
    assert [seq for seq, _, _ in rows][1:] == [seq + n for seq, n, _ in rows][:-1]
    assert [r["sensor"] for r in got] == [f"{name}{i}" for i in range(250)]
    assert [r["id"] for r in got] == [f"gw/{s.epoch}/{i}" for i in range(1, 251)]
    assert [marks for _, _, marks in rows].count("late") == 1


def test_stats_count_a_completed_message_as_delivered_before_its_lazy_deletion(
    tmp_path: Path,
) -> None:
    """Rule 3 lets a PUBCOMP's deletion ride a later commit; the status must not show
    those readings as backlog meanwhile, nor their age as the oldest."""
    with Store(tmp_path / "s.db", gateway_id="gw") as s:
        append(s, readings(4))
        append(s, readings(6, 4))
        begin(s, "k", [Message(0, 1, 2, QUEUED, "t", 1, 4)])
        s.forget_later(1, 4)  # PUBCOMP received, deletion not yet committed
        assert s.stats()["backlog"] == 6
        assert apply(s, "k", completed=[1]) == 4
        assert s.stats()["backlog"] == 6  # and the range is dropped once its rows are gone
        append(s, readings(2, 10))
        assert s.stats()["backlog"] == 8


def test_a_counter_or_total_carries_its_kind_and_a_gauge_says_nothing(tmp_path: Path) -> None:
    """docs/wire-format.md: ``kind`` is absent for a gauge (old bodies and most readings)."""
    ts = "2026-11-21T00:00:00.000Z"
    batch = [
        Reading("air.temp", 4.5, ts, "C"),
        Reading("rain.count", 0.4, ts, "mm", kind="counter"),
        Reading("rain.total", 12.2, ts, "mm", kind="total"),
    ]
    with Store(tmp_path / "s.db", gateway_id="gw") as s:
        append(s, batch)
        got = s.readings_between(1, 3)
    assert [r.get("kind") for r in got] == [None, "counter", "total"]
    assert not list(
        wire.validator(wire.CLOUD_SCHEMA).iter_errors({"v": 1, "gateway": "gw", "readings": got})
    )
