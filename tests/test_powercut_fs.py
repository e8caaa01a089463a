"""The power-cut file system's own tests: it follows its rules, and it can fail a system.

SIGKILL leaves the page cache to the next boot; this mount does not. If SQLite
with synchronous=OFF survived it, it would prove nothing about anyone else.
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from devkit.powercut import PowerCutMount, fuse_missing
from pubcomp.sync.store import fsync_dir

pytestmark = pytest.mark.skipif(fuse_missing() is not None, reason=str(fuse_missing()))


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[PowerCutMount]:
    with PowerCutMount(tmp_path / "backing", tmp_path / "mnt") as d:
        yield d


def write(path: Path, data: bytes, sync: bool = False) -> None:
    fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
    try:
        os.write(fd, data)
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)


def test_only_fsynced_data_and_names_survive_a_cut(disk: PowerCutMount) -> None:
    m = disk.path
    write(m / "never-synced", b"gone")
    write(m / "synced", b"kept", sync=True)  # rule 1: data and its new name
    with (m / "synced").open("ab") as f:
        f.write(b" and not this")
    os.mkdir(m / "d")
    write(m / "d" / "named-only", b"bytes never synced")
    fsync_dir(m / "d")  # rule 2: the entry, not the bytes
    write(m / "d" / "x", b"old", sync=True)
    write(m / "d" / "x.tmp", b"new", sync=True)
    os.rename(m / "d" / "x.tmp", m / "d" / "x")  # not durable until the directory is fsynced
    assert (m / "never-synced").read_bytes() == b"gone"  # the live view has it all

    disk.cut()

    assert not (m / "never-synced").exists()
    assert (m / "synced").read_bytes() == b"kept"
    assert (m / "d" / "named-only").read_bytes() == b""  # the zero-length file after a crash
    assert (m / "d" / "x").read_bytes() == b"old"
    assert (m / "d" / "x.tmp").read_bytes() == b"new"


def test_directory_fsync_makes_renames_and_unlinks_durable(disk: PowerCutMount) -> None:
    m = disk.path
    write(m / "a", b"A", sync=True)
    write(m / "b", b"B", sync=True)
    write(m / "c.tmp", b"C", sync=True)
    fsync_dir(m)
    os.unlink(m / "a")
    os.rename(m / "c.tmp", m / "b")
    fsync_dir(m)
    os.unlink(m / "b")  # after the last directory fsync: comes back

    disk.cut()

    assert sorted(os.listdir(m)) == ["b"]
    assert (m / "b").read_bytes() == b"C"
    assert disk.stats()["cuts"] == 1


def test_a_cut_freezes_the_program_where_it_stands(disk: PowerCutMount, tmp_path: Path) -> None:
    """Nothing the program does after the cut reaches the disk, even an fsync under way."""
    script = (
        "import os, sys\n"
        f"fd = os.open({str(disk.path / 'log')!r}, os.O_CREAT | os.O_WRONLY | os.O_APPEND)\n"
        "i = 0\n"
        "while True:\n"
        "    os.write(fd, b'%08d\\n' % i)\n"
        "    if i % 10 == 9:\n"
        "        os.fsync(fd)\n"
        "        print(i, flush=True)\n"
        "    i += 1\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    lines = [proc.stdout.readline() for _ in range(30)]  # type: ignore[union-attr]
    disk.cut(proc)
    synced = int([*lines, *proc.stdout.read().split()][-1])  # type: ignore[union-attr]
    kept = (disk.path / "log").read_bytes().split()
    # Every line up to the last fsync that returned is there, and nothing beyond a group of 10.
    assert len(kept) >= synced + 1
    assert len(kept) % 10 == 0
    assert [int(x) for x in kept] == list(range(len(kept)))


WRITER = """
import sqlite3, sys
db = sqlite3.connect(sys.argv[1], isolation_level=None)
db.execute("PRAGMA journal_mode=WAL")
db.execute("PRAGMA synchronous=" + sys.argv[2])
i = 0
while True:
    db.execute("BEGIN")
    db.execute("INSERT INTO t VALUES (?)", (i,))
    db.execute("COMMIT")
    print(i, flush=True)  # after COMMIT returned: the transaction is committed
    i += 1
"""


def committed_then_cut(disk: PowerCutMount, synchronous: str, commits: int) -> tuple[int, int]:
    """(transactions committed before the cut, transactions found after it)."""
    path = disk.path / "t.db"
    db = sqlite3.connect(path)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=FULL")
    db.execute("CREATE TABLE t (i INTEGER PRIMARY KEY)")
    db.commit()
    db.close()
    fsync_dir(disk.path)  # the database exists durably, empty
    cmd = [sys.executable, "-c", WRITER, str(path), synchronous]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    for _ in range(commits):
        proc.stdout.readline()
    disk.cut(proc)
    done = commits + len(proc.stdout.read().split())
    db = sqlite3.connect(path)
    try:
        assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        rows = [r[0] for r in db.execute("SELECT i FROM t ORDER BY i")]
    finally:
        db.close()
    assert rows == list(range(len(rows)))  # a prefix, never a hole
    return done, len(rows)


def test_sqlite_synchronous_off_loses_committed_transactions(disk: PowerCutMount) -> None:
    done, found = committed_then_cut(disk, "OFF", commits=200)
    assert done >= 200
    assert found < done, "the cut lost nothing: this file system would not catch a missing fsync"


def test_sqlite_synchronous_full_in_wal_keeps_every_committed_transaction(
    disk: PowerCutMount,
) -> None:
    done, found = committed_then_cut(disk, "FULL", commits=100)
    assert found >= done  # every COMMIT that returned; one more may have landed unreported
    assert found <= done + 1


def test_journal_mode_commits_every_rename_on_any_fsync_but_no_bytes(tmp_path: Path) -> None:
    """ext4's one journal: an fsync anywhere makes earlier renames durable; bytes still need
    their own file's fsync (the mode bench/chaos_compare.py gives every system)."""
    with PowerCutMount(tmp_path / "b", tmp_path / "m", journal=True) as d:
        m = d.path
        write(m / "db.new", b"state", sync=True)
        os.rename(m / "db.new", m / "db")  # no directory fsync
        write(m / "unsynced", b"bytes")
        write(m / "other", b"x", sync=True)  # an fsync elsewhere commits the journal
        d.cut()
        assert sorted(os.listdir(m)) == ["db", "other", "unsynced"]
        assert (m / "db").read_bytes() == b"state"
        assert (m / "unsynced").read_bytes() == b""


def test_a_dying_card_turns_read_only_or_fails_with_eio_and_reads_go_on(
    disk: PowerCutMount,
) -> None:
    import errno

    m = disk.path
    write(m / "kept", b"durable", sync=True)
    with (m / "kept").open("ab") as f:
        f.write(b"+dirty")
        f.flush()
        disk.readonly()
        with pytest.raises(OSError) as e:
            os.fsync(f.fileno())  # dirty data to carry: refused
        assert e.value.errno == errno.EROFS
    for call in (
        lambda: write(m / "new", b"x"),
        lambda: os.mkdir(m / "dir"),
        lambda: os.rename(m / "kept", m / "moved"),
        lambda: os.unlink(m / "kept"),
        lambda: os.truncate(m / "kept", 0),
        lambda: os.chmod(m / "kept", 0o600),
    ):
        with pytest.raises(OSError) as e:
            call()
        assert e.value.errno == errno.EROFS
    assert (m / "kept").read_bytes() == b"durable+dirty"  # reads go on
    disk.eio()
    fd = os.open(m / "kept", os.O_RDWR)
    try:
        with pytest.raises(OSError) as e:
            os.pwrite(fd, b"x", 0)
        assert e.value.errno == errno.EIO
        with pytest.raises(OSError) as e:
            os.fsync(fd)  # even with nothing dirty
        assert e.value.errno == errno.EIO
        assert os.pread(fd, 7, 0) == b"durable"
    finally:
        os.close(fd)
    refused = disk.heal()["refused"]
    assert refused["write"] >= 1 and refused["fsync"] >= 2, refused
    write(m / "after", b"healed", sync=True)
    disk.cut()
    assert (m / "after").read_bytes() == b"healed"
    assert (m / "kept").read_bytes() == b"durable"


# -- writeback mode (model.py rules 4-6; tests/test_powercut_writeback.py has the model's) --

LOGGER = """
import os, sys
fd = os.open(sys.argv[1], os.O_CREAT | os.O_WRONLY | os.O_APPEND, 0o644)
i = 0
while True:
    os.write(fd, b"%07d" % i + b"." * 92 + b"\\n")  # 100 bytes: a tail spans sectors
    if i % 20 == 19:
        os.fsync(fd)
        print(i, flush=True)  # after the fsync returned
    i += 1
"""


def test_writeback_keeps_what_was_fsynced_and_a_seeded_part_of_the_rest(tmp_path: Path) -> None:
    """A log fsynced every 20 lines, cut right after a write (``arm``): every line the
    last fsync covered is there, whole, at every cut; beyond it the disk holds, by the
    seed, nothing, whole lines or lines with holes (zeros), never another byte: the
    strict model would keep nothing there. The seed of each cut is logged."""
    expected = b"".join(b"%07d" % i + b"." * 92 + b"\n" for i in range(10_000))
    tails: list[bytes] = []
    with PowerCutMount(tmp_path / "b", tmp_path / "m", writeback=42) as d:
        log = d.path / "log"
        for cut in range(8):
            cmd = [sys.executable, "-c", LOGGER, str(log)]
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
            assert proc.stdout is not None
            first = proc.stdout.readline()
            d.arm(3 + 7 * cut)  # some land on a line that is not the last before its fsync
            assert d.wait_frozen(30)
            d.cut(proc)
            last = max(int(x) for x in [first, *proc.stdout.read().split()])
            kept = log.read_bytes()
            synced = 100 * (last + 1)
            assert kept[:synced] == expected[:synced], cut  # every fsynced line, whole
            tail = kept[synced:]
            assert len(tail) <= 100 * 20, cut
            assert all(b in (0, e) for b, e in zip(tail, expected[synced:], strict=False)), cut
            tails.append(tail)
            os.unlink(log)  # the next run starts a new log
            fsync_dir(d.path)
    assert [c["seed"] for c in d.cut_log] == [f"42:{i}" for i in range(8)]
    assert any(tails), "writeback never kept an unsynced byte: the mode is off"
    assert any(0 in t for t in tails), "no hole in any unsynced tail"


CHECKPOINTER = """
import sqlite3, sys
db = sqlite3.connect(sys.argv[1], isolation_level=None)
db.execute("PRAGMA page_size=512")  # the gateway store's settings (sync/store/files.py)
db.execute("PRAGMA journal_mode=WAL")
db.execute("PRAGMA synchronous=FULL")
db.execute("PRAGMA wal_autocheckpoint=0")
db.execute("CREATE TABLE IF NOT EXISTS t (i INTEGER PRIMARY KEY, pad BLOB)")
i = (db.execute("SELECT max(i) FROM t").fetchone()[0] or -1) + 1
while True:
    db.execute("BEGIN")
    db.execute("INSERT INTO t VALUES (?, randomblob(300))", (i,))
    db.execute("COMMIT")
    print(i, flush=True)  # after COMMIT returned: the transaction is committed
    i += 1
    if i % 25 == 0:
        print("checkpoint", flush=True)
        sys.stdin.readline()  # the test arms the cut, then lets the checkpoint run
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
"""


def test_sqlite_wal_survives_writeback_cuts_inside_its_checkpoints(tmp_path: Path) -> None:
    """The gateway store's SQLite settings (512-byte pages, WAL, synchronous=FULL, TRUNCATE
    checkpoints) cut by the writeback model while a checkpoint copies the WAL into the
    database file (torn database pages, a torn -shm, a WAL truncation that may or may not
    land), 8 seeds: every committed transaction is there, integrity_check is ok, and the
    next checkpoint succeeds. The WAL's frame checksums and salts decide what counts."""
    with PowerCutMount(tmp_path / "b", tmp_path / "m", writeback=7) as d:
        path = d.path / "t.db"
        done = 0
        for cut in range(8):
            cmd = [sys.executable, "-c", CHECKPOINTER, str(path)]
            proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            assert proc.stdout is not None and proc.stdin is not None
            while (line := proc.stdout.readline().strip()) != "checkpoint":
                done = int(line) + 1
            d.arm(1 + cut % 4)  # one of the checkpoint's first writes
            proc.stdin.write("\n")
            proc.stdin.flush()
            assert d.wait_frozen(30), "the checkpoint wrote nothing"
            d.cut(proc)
            done += len([x for x in proc.stdout.read().split() if x.isdigit()])
            db = sqlite3.connect(path)
            try:
                assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok", cut
                rows = [r[0] for r in db.execute("SELECT i FROM t ORDER BY i")]
                db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            finally:
                db.close()
            assert rows == list(range(len(rows))), cut  # a prefix, never a hole
            assert len(rows) >= done, f"cut {cut} (seed 7:{cut}) lost a committed transaction"
            done = len(rows)
    assert sum(c["pages_written_back"] + c["pages_torn"] for c in d.cut_log) > 0
    assert all("t.db" in c["dirty"] for c in d.cut_log), "a cut outside the checkpoint"


STORE_WRITER = """
import sys
from pubcomp.sync.store import Reading, Store
store = Store(sys.argv[1], gateway_id="gw1")
i = 0
while True:
    batch = [Reading("s", float(i), "2026-11-25T00:00:00.000Z", "C")] * 3
    first, last = store.commit(lambda db: store.append_in(db, batch))
    print(first, last, flush=True)  # the commit returned: committed, fsynced
    i += 1
    if i % 30 == 0:
        print("checkpoint", flush=True)
        sys.stdin.readline()
        store.checkpoint()  # what a gateway does on a full disk: TRUNCATE
"""


def test_the_gateway_store_survives_writeback_cuts_inside_its_checkpoints(tmp_path: Path) -> None:
    """The gateway's own ``Store`` (sync/store/), appending, cut by the writeback model
    right after one of its checkpoint's first writes, 6 seeds: every append that
    returned is there, and the store opens without being moved aside as corrupt."""
    from pubcomp.sync.store import Store

    with PowerCutMount(tmp_path / "b", tmp_path / "m", writeback=11) as d:
        path = d.path / "state" / "gw.db"
        committed: set[int] = set()
        for cut in range(6):
            cmd = [sys.executable, "-c", STORE_WRITER, str(path)]
            proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            assert proc.stdout is not None and proc.stdin is not None
            while (line := proc.stdout.readline().strip()) != "checkpoint":
                first, last = map(int, line.split())
                committed |= set(range(first, last + 1))
            d.arm(1 + cut % 3)
            proc.stdin.write("\n")
            proc.stdin.flush()
            assert d.wait_frozen(30), "the checkpoint wrote nothing"
            d.cut(proc)
            for line in proc.stdout.read().splitlines():
                if line[:1].isdigit():
                    first, last = map(int, line.split())
                    committed |= set(range(first, last + 1))
            with Store(path, gateway_id="gw1") as store:
                assert store.moved_aside is None, f"cut {cut} (seed 11:{cut}): corrupt"
                kept = store.count_between(min(committed), max(committed))
            assert kept >= len(committed), f"cut {cut} (seed 11:{cut}) lost committed readings"
        assert any("gw.db" in c.get("dirty", {}) for c in d.cut_log), "no cut in the database"
