"""The landing files' recovery under the writeback model: it trusts only what verifies.

The write-then-cut moment replayed without processes: messages appended and
fsynced, one more group written and not fsynced, then devkit/powercut's model
decides, by seed, which of the unsynced pages reached the disk (some torn at
512-byte sectors, holes reading as zeros). The next start's ``LandingWriter``
recovers the file. For every seed: every fsynced message is there, whole; what is
kept beyond is whole messages in order (a prefix of what was written); no rolled
line is malformed; the receive records the ingest rebuilds come only from kept
messages; what was cut is in ``_quarantine``, which nothing reads.

The same for a plain writer (status lines) and by hand for each case named.
"""

from __future__ import annotations

import json
import random
import stat
from pathlib import Path

import pytest

from devkit.powercut.model import Image
from pubcomp.pipeline import audit
from pubcomp.pipeline.landing import LandingWriter, seal, verified_length

SEEDS = range(200)


def message(m: int, readings: int = 10) -> bytes:
    """A message as the ingest writes it: one line a reading, its receive record last."""
    readings_ = [
        {"id": f"gw/e/{m * 100 + i}", "value": i, "received": "2026-11-24T10:00:00Z"}
        for i in range(readings)
    ]
    readings_[-1]["_mqtt"] = {"session": "s", "packet_id": m % 65535 + 1, "qos": 2,
                              "digest": f"d{m}"}  # fmt: skip
    return b"".join(json.dumps(r, separators=(",", ":")).encode() + b"\n" for r in readings_)


def after_cut(tmp: Path, seed: int, synced: bytes, unsynced: bytes) -> bytes:
    """The file's bytes at the next start: ``synced`` fsynced, ``unsynced`` written after."""
    image = Image(tmp / "backing", writeback=True)
    node = image.make("/f", stat.S_IFREG | 0o644)
    image.write(node.ino, synced, 0)
    image.fsync(node.ino)
    image.write(node.ino, unsynced, len(synced))
    image.writeback(random.Random(seed))
    return bytes(Image(tmp / "backing").lookup("/f").data)


def recover(tmp: Path, data: bytes, messages: bool) -> tuple[bytes, list[dict[str, object]]]:
    """Put ``data`` where a crash leaves a file, start a writer: (the rolled bytes, records)."""
    incoming = tmp / "landing" / "_incoming" / "readings"
    incoming.mkdir(parents=True)
    (incoming / "w-20261124T100000000000Z-1.jsonl").write_bytes(data)
    w = LandingWriter(tmp / "landing", "w", message_records=messages)
    rolled = list((tmp / "landing").glob("date=*/*.jsonl"))
    assert len(rolled) <= 1 and not list(incoming.iterdir())
    return (rolled[0].read_bytes() if rolled else b""), list(w.receive_records())


@pytest.mark.parametrize("unsynced_messages", [1, 6])
def test_the_write_then_cut_moment_keeps_every_fsynced_message_and_only_whole_ones(
    tmp_path: Path, unsynced_messages: int
) -> None:
    msgs = [seal(message(m)) for m in range(12 + unsynced_messages)]
    synced, unsynced = b"".join(msgs[:12]), b"".join(msgs[12:])
    prefixes = [b"".join(msgs[:j]) for j in range(12, len(msgs) + 1)]
    beyond = 0
    for seed in SEEDS:
        tmp = tmp_path / str(seed)
        data = after_cut(tmp, seed, synced, unsynced)
        kept, records = recover(tmp, data, messages=True)
        # Every fsynced message, then whole messages in order: never a hole, never a torn one.
        assert kept in prefixes, f"seed {seed}: kept {len(kept)} bytes, not whole messages"
        beyond += kept != synced
        assert all(isinstance(json.loads(line), dict) for line in kept.splitlines()), seed
        n = prefixes.index(kept) + 12
        assert {r["digest"] for r in records} == {f"d{m}" for m in range(n)}, seed
        audit.landed(tmp / "landing")  # the audit reads it
        cut = list((tmp / "landing" / "_quarantine").rglob("*"))
        assert (data != kept) == any(p.is_file() for p in cut), seed
    assert beyond > 0, "no seed kept an unsynced message: the replay never tested the tail"


def test_a_status_file_keeps_its_fsynced_lines_and_only_whole_ones(tmp_path: Path) -> None:
    lines = [
        json.dumps({"gateway": "gw", "id": f"s{i}", "received": "2026-11-24T10:00:00Z"}).encode()
        + b"\n"
        for i in range(80)
    ]
    synced, unsynced = b"".join(lines[:50]), b"".join(lines[50:])
    prefixes = [b"".join(lines[:j]) for j in range(50, 81)]
    for seed in range(100):
        tmp = tmp_path / str(seed)
        kept, _ = recover(tmp, after_cut(tmp, seed, synced, unsynced), messages=False)
        assert kept in prefixes, f"seed {seed}: {kept[len(synced) :][:200]!r}"


def sealed(*ms: int) -> list[bytes]:
    return [seal(message(m, readings=3)) for m in ms]


def test_a_record_on_disk_whose_lines_are_not_is_not_trusted(tmp_path: Path) -> None:
    """The issue's loss: a page holding the record reached the disk, one holding the
    message's first lines did not (zeros). The old recovery trusted the record, so the
    broker's resend was acknowledged without being written: readings lost."""
    a, b = sealed(1, 2)
    hole = b[:20] + bytes(30) + b[50:]  # the message's first line half a hole
    kept, records = recover(tmp_path, a + hole, messages=True)
    assert kept == a
    assert [r["digest"] for r in records] == ["d1"]  # d2 will land when resent


def test_a_message_whose_record_fell_in_a_hole_is_cut_with_all_after_it(tmp_path: Path) -> None:
    """The issue's double: the record is zeros but later messages are whole. The old
    recovery kept those lines (before a later record) and landed the resend again."""
    a, b, c = sealed(1, 2, 3)
    hole = b[:-60] + bytes(59) + b"\n"
    kept, records = recover(tmp_path, a + hole + c, messages=True)
    assert kept == a and [r["digest"] for r in records] == ["d1"]
    cut = next((tmp_path / "landing" / "_quarantine" / "readings").iterdir())
    assert cut.read_bytes() == hole + c and cut.name.endswith(f".{len(a)}")


def test_a_whole_message_after_a_hole_is_cut_too(tmp_path: Path) -> None:
    """After a hole nothing was acknowledged (all of it follows the last fsync): a sealed
    message there does not start where the last verified one ended."""
    a, b, c = sealed(1, 2, 3)
    kept, _ = recover(tmp_path, a + bytes(len(b)) + c, messages=True)
    assert kept == a


def test_a_message_changed_under_its_seal_is_cut(tmp_path: Path) -> None:
    a, b = sealed(1, 2)
    kept, _ = recover(tmp_path, a + b.replace(b'"value":1', b'"value":7'), messages=True)
    assert kept == a


def test_a_file_from_before_the_seal_is_read_as_before_plus_a_parse(tmp_path: Path) -> None:
    """Legacy records (no seal): a message ends at a record line, every line must parse;
    the lines after the last record are cut as they always were."""
    a, b, c = message(1, 3), message(2, 3), message(3, 3)
    assert verified_length(a + b + c[:30], messages=True) == len(a + b)
    assert verified_length(a + b[:10] + bytes(20) + b[30:] + c, messages=True) == len(a)
    kept, records = recover(tmp_path, a + b + c[:-5], messages=True)
    assert kept == a + b and [r["digest"] for r in records] == ["d2", "d1"]


def test_receive_records_skip_a_record_whose_seal_does_not_match(tmp_path: Path) -> None:
    """A rolled file changed later (bit rot, a hand edit): its record is not used to
    recognise a resend; the resend lands again and the pipeline's dedup removes it."""
    a, b = sealed(1, 2)
    day = tmp_path / "date=2026-11-24"
    day.mkdir(parents=True)
    (day / "w-20261124T100000000000Z-1.jsonl").write_bytes(a + b.replace(b'"d2"', b'"d9"'))
    w = LandingWriter(tmp_path, "w", message_records=True)
    assert [r["digest"] for r in w.receive_records()] == ["d1"]


def test_a_plain_file_is_cut_at_its_first_line_that_is_not_json(tmp_path: Path) -> None:
    lines = [b'{"id":"s%d"}\n' % i for i in range(5)]
    data = b"".join(lines)
    torn = data[:30] + bytes(10) + data[40:]
    assert verified_length(torn, messages=False) == data.index(b"\n", 0) + 1 + 12
    kept, _ = recover(tmp_path, torn, messages=False)
    assert kept == data[: verified_length(torn, messages=False)]
    assert b"\0" not in kept


def test_a_line_with_zero_bytes_never_passes_as_json() -> None:
    """Given bytes, json.loads guesses UTF-16 from zero bytes: b"\\0{\\0}" would be {}."""
    assert verified_length(b'{"a":1}\n\0{\0}\n{"b":2}\n', messages=False) == 8


def test_seal_refuses_a_message_without_its_record_last() -> None:
    with pytest.raises(ValueError):
        seal(b'{"id":"a/b/1"}\n')
    with pytest.raises(ValueError):
        seal(b'{"id":"a/b/1","_mqtt":{"qos":2}}\n{"id":"a/b/2"}\n')


def test_the_sweep_in_bench_runs_and_the_old_recovery_fails_it() -> None:
    """bench/ingest_writeback.py's replay, small: the current recovery faults on no seed,
    the one before the seal (same bytes, same run) on some."""
    import subprocess
    import sys

    bench = Path(__file__).resolve().parent.parent / "bench" / "ingest_writeback.py"
    res = subprocess.run(
        [sys.executable, str(bench), "--replay", "60"], capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, res.stderr
    rows = {ln.split()[0]: ln.split()[1:] for ln in res.stdout.splitlines() if ln[:14].strip()}
    assert rows["now"] == ["0", "0", "0", "0"], res.stdout
    assert int(rows["9dbb07f"][3]) > 0, res.stdout


def test_the_audit_counts_an_open_file_s_whole_lines_only(tmp_path: Path) -> None:
    """A file the ingest is still writing ends, between two writes, inside a line: the
    audit (what the end-to-end tests count landed readings with) counts the lines
    before it and does not fail on it; a rolled file's lines are all counted."""
    incoming = tmp_path / "landing" / "_incoming" / "readings"
    incoming.mkdir(parents=True)
    whole = message(1, readings=3)
    (incoming / "open.jsonl").write_bytes(whole + message(2, readings=3)[:40])
    rolled = tmp_path / "landing" / "date=2026-11-24"
    rolled.mkdir()
    (rolled / "a.jsonl").write_bytes(message(3, readings=2))
    got = audit.landed(tmp_path / "landing", rolled_only=False)
    assert got == {"gw/e/100": 1, "gw/e/101": 1, "gw/e/102": 1, "gw/e/300": 1, "gw/e/301": 1}
    assert audit.landed(tmp_path / "landing") == {"gw/e/300": 1, "gw/e/301": 1}
