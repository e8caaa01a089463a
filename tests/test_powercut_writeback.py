"""The power-cut model's writeback mode (devkit/powercut/model.py, rules 4-6), without FUSE.

Each case builds the same live image on a fresh backing directory for many seeds,
lets ``writeback`` choose what reached the disk, and reads the durable image back
as the next mount would. What must hold for every seed: fsynced bytes and names are
never touched, a sector is old or new (never mixed), metadata is a prefix of what
was done. What must vary with the seed: an unsynced page is absent, whole or torn;
an unsynced rename is there or not.
"""

from __future__ import annotations

import random
import stat
from collections.abc import Callable
from pathlib import Path

import pytest

from devkit.powercut.model import PAGE, SECTOR, Image

SEEDS = range(120)
FILE = stat.S_IFREG | 0o644
DIR = stat.S_IFDIR | 0o755


def after_cut(tmp: Path, seed: int, build: Callable[[Image], None]) -> Image:
    """Build a live image, cut with ``seed``, return the image the next mount sees."""
    backing = tmp / f"seed-{seed}"
    image = Image(backing, writeback=True)
    build(image)
    image.writeback(random.Random(seed))
    return Image(backing)


def put(image: Image, path: str, data: bytes, offset: int = 0, sync: bool = False) -> int:
    try:
        node = image.lookup(path)
    except OSError:
        node = image.make(path, FILE)
    image.write(node.ino, data, offset)
    if sync:
        image.fsync(node.ino)
    return node.ino


def read(image: Image, path: str) -> bytes | None:
    try:
        return bytes(image.lookup(path).data)
    except OSError:
        return None


def names(image: Image, path: str = "/") -> set[str]:
    return set(image.lookup(path).entries)


def sectors(data: bytes) -> list[bytes]:
    return [data[i : i + SECTOR] for i in range(0, len(data), SECTOR)]


def test_an_unsynced_page_is_absent_whole_or_torn_depending_on_the_seed(tmp_path: Path) -> None:
    new = bytes(range(256)) * (PAGE // 256)

    def build(image: Image) -> None:
        ino = put(image, "f", b"", sync=True)  # the name and an empty file are durable
        image.write(ino, new, 0)  # one page, never fsynced

    kinds = set()
    for seed in SEEDS:
        got = read(after_cut(tmp_path, seed, build), "f")
        assert got is not None and len(got) in (0, *range(SECTOR, PAGE + 1, SECTOR)), len(got)
        # Each sector is the new one or a hole (zeros), never a mix inside a sector.
        fresh = sectors(new)
        assert all(s in (fresh[i], bytes(SECTOR)) for i, s in enumerate(sectors(got))), seed
        if got == new:
            kinds.add("whole")
        elif got.strip(b"\0") == b"":
            kinds.add("absent")  # or only its size: zeros where it should be
        else:
            kinds.add("torn")
            written = [s != bytes(SECTOR) for s in sectors(got)]
            if written != sorted(written, reverse=True):
                kinds.add("torn, not a prefix")  # a later sector on disk, an earlier not
    assert kinds == {"whole", "absent", "torn", "torn, not a prefix"}, kinds


def test_the_same_seed_gives_the_same_disk(tmp_path: Path) -> None:
    def build(image: Image) -> None:
        put(image, "a", b"x" * 3 * PAGE)
        put(image, "b", b"y" * 5000)

    for seed in (1, 2, 3):
        one = after_cut(tmp_path / "one", seed, build)
        two = after_cut(tmp_path / "two", seed, build)
        assert (read(one, "a"), read(one, "b")) == (read(two, "a"), read(two, "b"))


def test_fsynced_bytes_always_survive_and_later_ones_may(tmp_path: Path) -> None:
    """A log appended past its last fsync, and an fsynced file overwritten in place:
    the fsynced bytes are there for every seed, the later ones sector by sector."""
    synced = b"".join(b"%07d\n" % i for i in range(1000))  # 8000 bytes: two pages
    later = b"".join(b"%07d\n" % i for i in range(1000, 1700))
    old, patch = b"o" * 3 * PAGE, b"n" * 1500

    def build(image: Image) -> None:
        put(image, "log", synced, sync=True)
        put(image, "log", later, offset=len(synced))
        put(image, "inplace", old, sync=True)
        put(image, "inplace", patch, offset=1000)

    seen = set()
    for seed in SEEDS:
        disk = after_cut(tmp_path, seed, build)
        log = read(disk, "log")
        assert log is not None and log[: len(synced)] == synced, seed
        tail = log[len(synced) :]
        assert len(tail) <= len(later)
        assert all(a == b or a == 0 for a, b in zip(tail, later, strict=False)), seed
        seen.add(len(tail))
        inplace = read(disk, "inplace")
        want = old[:1000] + patch + old[2500:]
        assert inplace is not None and len(inplace) == len(old)
        for i, s in enumerate(sectors(inplace)):
            assert s in (sectors(old)[i], sectors(want)[i]), (seed, i)
    assert len(seen) > 3, "the unsynced tail never varied"


def test_an_unsynced_rename_may_or_may_not_reach_the_disk(tmp_path: Path) -> None:
    def build(image: Image) -> None:
        put(image, "db.tmp", b"new state", sync=True)  # bytes and the tmp name durable
        put(image, "db", b"old state", sync=True)
        image.rename("/db.tmp", "/db")  # never followed by a directory fsync

    outcomes = set()
    for seed in SEEDS:
        disk = after_cut(tmp_path, seed, build)
        state = (tuple(sorted(names(disk))), read(disk, "db"))
        # The rename is one operation: never both names, never neither.
        assert state in {(("db", "db.tmp"), b"old state"), (("db",), b"new state")}, state
        outcomes.add(state)
    assert len(outcomes) == 2, outcomes


def test_metadata_reaches_the_disk_as_a_prefix_of_what_was_done(tmp_path: Path) -> None:
    """Creates, a mkdir, renames and unlinks, none fsynced: the names after the cut are
    those after some prefix of the operations, never a later one without an earlier."""
    steps: list[Callable[[Image], None]] = [
        lambda im: put(im, "a", b"A"),
        lambda im: put(im, "b", b"B"),
        lambda im: im.make("/d", DIR) and None,
        lambda im: im.rename("/a", "/d/a"),
        lambda im: put(im, "c", b"C"),
        lambda im: im.remove("/b", want_dir=False),
        lambda im: im.rename("/c", "/b"),
        lambda im: put(im, "e", b"E"),
    ]

    def tree(image: Image) -> frozenset[str]:
        out = {f"/{n}" for n in names(image)}
        if "/d" in out:
            out |= {f"/d/{n}" for n in names(image, "/d")}
        return frozenset(out)

    states = []
    for k in range(len(steps) + 1):
        image = Image(tmp_path / f"prefix-{k}")  # the strict model's live view after k steps
        for step in steps[:k]:
            step(image)
        states.append(tree(image))

    def build(image: Image) -> None:
        for step in steps:
            step(image)

    reached = set()
    for seed in SEEDS:
        got = tree(after_cut(tmp_path, seed, build))
        assert got in states, (seed, sorted(got))
        reached.add(states.index(got))
    assert len(reached) >= len(steps) - 1, sorted(reached)


def test_what_an_fsync_made_durable_is_never_undone(tmp_path: Path) -> None:
    """Create a, fsync it; rename it to b, fsync the directory; create c, rename a new a:
    the replayed prefix must not bring back the name a for the first file."""

    def build(image: Image) -> None:
        put(image, "a", b"first", sync=True)
        image.rename("/a", "/b")
        image.fsyncdir(1)
        put(image, "c", b"third")
        put(image, "a", b"second")

    outcomes = set()
    for seed in SEEDS:
        disk = after_cut(tmp_path, seed, build)
        assert read(disk, "b") == b"first", seed
        state = tuple(sorted(names(disk)))
        assert state in {("b",), ("b", "c"), ("a", "b", "c")}, state
        outcomes.add(state)
    assert len(outcomes) == 3, outcomes


def test_a_truncation_since_the_last_fsync_lands_or_not(tmp_path: Path) -> None:
    old = b"o" * 2 * PAGE

    def build(image: Image) -> None:
        ino = put(image, "f", old, sync=True)
        image.truncate(ino, 0)  # O_TRUNC, then a shorter rewrite, not fsynced
        image.write(ino, b"n" * 700, 0)

    new = b"n" * 700 + bytes(2 * SECTOR - 700)  # sectors go whole: the page's zeros past 700
    lengths = set()
    for seed in SEEDS:
        got = read(after_cut(tmp_path, seed, build), "f")
        assert got is not None
        lengths.add(len(got))
        for i, s in enumerate(sectors(got)):
            options = (sectors(old)[i], sectors(new)[i] if i < 2 else b"", bytes(SECTOR))
            assert any(s == o[: len(s)] for o in options), (seed, i, s[:20])
    assert len(old) in lengths and min(lengths) < len(old), lengths


def test_the_strict_model_records_no_pending_metadata(tmp_path: Path) -> None:
    image = Image(tmp_path / "strict")
    put(image, "a", b"x")
    image.rename("/a", "/b")
    assert image.pending == []
    with pytest.raises(OSError):
        image.lookup("/a")
