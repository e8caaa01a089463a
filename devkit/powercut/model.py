"""What survives a power cut: a file system image that reaches disk only through fsync.

Theory of operation. Two images share inode numbers:

- the *live* image (this process's memory) is what applications see: every
  create, write, rename and unlink lands here at once, as in a page cache;
- the *durable* image is the backing directory: ``inodes/<n>`` holds a file's
  bytes, ``tree.json`` the directory entries and modes.

Only these calls move state from live to durable (the rules; ext4 with
``data=ordered`` is the closest real file system, see the notes below):

1. ``fsync``/``fdatasync`` of a file: its bytes and size become durable, and so
   does every name it has now (a create or rename of it; a name it no longer
   has is dropped), with the entries that lead to those names from the root.
2. ``fsync`` of a directory: its entries become durable exactly as they are
   now (creates, renames in or out, unlinks). A file that enters the durable
   image this way brings only the bytes it already had there: none, if it was
   never fsynced (ext4's famous zero-length file after a crash).
3. Nothing else: not close, not rename, not time passing.

With ``journal=True`` (``--journal``) rule 1 and 2 commit *every* pending
create, rename and unlink in the file system, as ext4's one journal does on any
fsync, while bytes still reach the disk only through their own file's fsync.
The tests use the strict rules; bench/chaos_compare.py uses the journal, the
kinder and closer model of ext4, for every system it compares.

A cut throws the live image away; the next mount starts from the durable one.

**Writeback** (``writeback=True``, ``--writeback``; opt-in, seeded). A real
disk does not wait for fsync: the kernel writes dirty pages back in the
background, in no promised order, and the journal commits metadata every few
seconds. So at a cut, with a seeded ``random.Random`` (``writeback(rng)``):

4. a random *prefix* of the pending metadata operations (creates, mkdirs,
   renames, unlinks, rmdirs, in the order they were made; a rename is one
   operation) reaches the durable image: a journal commits in order, never a
   later operation without an earlier one. An operation leaves the pending
   list when an fsync commits the names it touched (rules 1 and 2), so replay
   never undoes what an fsync made durable;
5. of every durable file's pages dirtied since its last fsync (4 KiB), each is
   independently absent (the disk keeps what it had), written whole, or *torn*:
   a random non-empty proper *subset* of its eight 512-byte sectors written,
   the others keeping what the disk had. Any subset, not only a prefix: a disk
   promises only that one sector is written whole (its ECC unit; NVMe's
   atomic write unit is one logical block unless it says more), a 4 KiB write
   may be split and its pieces completed in any order (an SSD's FTL spreads
   them over channels; Zheng et al., FAST '13, saw such "shorn" and
   unserialisable writes on 13 of 15 SSDs), and a prefix is one of the
   subsets, so what survives any subset survives a prefix;
6. the file's size covers every sector written (and, one time in four, the
   whole live size: the size reached the journal before the data, as XFS
   and ext4 ``data=writeback`` allow), so what was not written reads as
   zeros (a hole) or as the old bytes; a truncation since the last fsync
   reaches the disk or not (a coin).

That is what background writeback leaves on ext4, XFS and F2FS, and what the
ALICE (OSDI '14) and CrashMonkey (OSDI '18) studies explore. With the same
seed and the same live image the outcome is the same (the model's tests
replay it); a process test's live image depends on timing, so its seed names
the choices, not the bytes. Never a state no disk could reach: fsynced bytes
and names are never touched, sectors are whole, pending metadata lands as a
prefix (rule 1 may already have made one file's names durable ahead of
others', as a per-file fsync does on F2FS; ``journal=True`` commits them all).
Beyond ``MAX_OPS`` pending operations the oldest half is committed, as the
journal's periodic commit would have done long before.

Where ext4 would keep more: its journal commits every few seconds on its own
(we assume the cut comes first), an fsync commits other files' metadata in the
same transaction (here only the file's own names), and ``auto_da_alloc``
flushes a file's data when it is renamed over another (not here). An fsync is
atomic here. So this image loses at least what ext4 could lose, never less: a
program that survives it has not relied on luck. Writeback adds what a disk
may keep *beyond* the fsynced state (pages and names nobody synced, torn
pages, holes), which is what a recovery that reads un-fsynced bytes trips on.
"""

from __future__ import annotations

import errno
import json
import os
import random
import stat
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = 1
PAGE = 4096  # a flash page as the kernel writes it back
SECTOR = 512  # what a disk writes whole
# Beyond this many separate dirty ranges a file's are merged into one (bounded memory).
MAX_RANGES = 256
# Writeback: beyond this many pending metadata operations the oldest half is committed,
# as the journal's periodic commit would have done long before (bounded memory).
MAX_OPS = 4096

Key = tuple[int, str]  # (directory inode, name)
Op = dict[Key, "int | None"]  # what one create, rename or unlink does to the names


class FsError(OSError):
    def __init__(self, code: int) -> None:
        super().__init__(code, os.strerror(code))


@dataclass
class Inode:
    ino: int
    mode: int
    data: bytearray = field(default_factory=bytearray)
    entries: dict[str, int] = field(default_factory=dict)  # directories only
    dirty: list[tuple[int, int]] = field(default_factory=list)  # (start, end) not yet durable
    low: int | None = None  # the shortest the file was since its last fsync (a truncation)
    mtime: float = field(default_factory=time.time)

    @property
    def is_dir(self) -> bool:
        return stat.S_ISDIR(self.mode)


@dataclass
class Stats:
    writes: int = 0
    bytes_written: int = 0  # what applications wrote (all of it would reach a disk in time)
    fsyncs: int = 0
    bytes_synced: int = 0  # bytes fsync carried to the durable image
    pages_synced: int = 0  # 4 KiB pages those bytes touched: what flash programs
    cuts: int = 0
    # What writeback carried at cuts (writeback mode): pages whole, torn, left behind;
    # pending metadata operations committed and dropped.
    pages_written_back: int = 0
    pages_torn: int = 0
    pages_left: int = 0
    ops_committed: int = 0
    ops_dropped: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


class Image:
    """The live image, with the durable one in ``backing``. Thread safe (one lock)."""

    def __init__(
        self,
        backing: Path,
        capacity: int | None = None,
        journal: bool = False,
        writeback: bool = False,
    ) -> None:
        self.backing = backing
        self.journal = journal
        self.writeback_mode = writeback
        self.pending: list[Op] = []  # metadata operations not yet durable (writeback mode)
        self._committed: set[Key] = set()  # names an fsync under way made durable
        self.capacity = capacity  # bytes of file data; beyond it, ENOSPC
        self.lock = threading.RLock()
        self.stats = Stats()
        (backing / "inodes").mkdir(parents=True, exist_ok=True)
        self.inodes: dict[int, Inode] = {}
        self.durable: dict[int, dict[str, int]] = {}  # durable dir entries by inode
        self.durable_modes: dict[int, int] = {}
        self._tree_text = ""  # what tree.json holds: most fsyncs change no name
        self._load()

    # -- the durable image ---------------------------------------------------------

    def _load(self) -> None:
        tree = self.backing / "tree.json"
        if tree.exists():
            doc = json.loads(tree.read_text())
            modes = {int(k): v for k, v in doc["modes"].items()}
            dirs = {int(k): v for k, v in doc["dirs"].items()}
        else:
            modes, dirs = {ROOT: stat.S_IFDIR | 0o755}, {ROOT: {}}
        self.durable_modes, self.durable = modes, {k: dict(v) for k, v in dirs.items()}
        for ino, mode in modes.items():
            node = Inode(ino, mode)
            if stat.S_ISDIR(mode):
                node.entries = dict(dirs.get(ino, {}))
            else:
                blob = self.backing / "inodes" / str(ino)
                node.data = bytearray(blob.read_bytes()) if blob.exists() else bytearray()
            self.inodes[ino] = node
        self.next_ino = max(self.inodes) + 1

    def _save_tree(self) -> None:
        live = self._durable_reachable()
        for ino in list(self.durable_modes):
            if ino not in live:
                del self.durable_modes[ino]
                self.durable.pop(ino, None)
                (self.backing / "inodes" / str(ino)).unlink(missing_ok=True)
        text = json.dumps({"modes": self.durable_modes, "dirs": self.durable})
        if text == self._tree_text:
            return
        tmp = self.backing / "tree.json.tmp"
        tmp.write_text(text)
        tmp.replace(self.backing / "tree.json")
        self._tree_text = text

    def _durable_reachable(self) -> set[int]:
        seen, todo = {ROOT}, [ROOT]
        while todo:
            for child in self.durable.get(todo.pop(), {}).values():
                if child not in seen:
                    seen.add(child)
                    todo.append(child)
        return seen

    def _enter_durable(self, ino: int) -> None:
        """Make an inode known to the durable image (its bytes stay as they were there)."""
        if ino in self.durable_modes:
            return
        node = self.inodes[ino]
        self.durable_modes[ino] = node.mode
        if node.is_dir:
            self.durable[ino] = {}
        else:
            (self.backing / "inodes" / str(ino)).touch()

    def _link_durably(self, ino: int) -> None:
        """Rule 1's names: every live name of ``ino`` and the path to it from the root."""
        for parent, name in self._names(ino):
            self._enter_durable(parent)
            self._enter_durable(ino)
            self.durable[parent][name] = ino
            self._committed.add((parent, name))
            if parent != ROOT:
                self._link_durably(parent)
        for parent, entries in self.durable.items():
            for name in [n for n, i in entries.items() if i == ino]:
                if self.inodes.get(parent) is None or self.inodes[parent].entries.get(name) != ino:
                    del entries[name]
                    self._committed.add((parent, name))

    def _names(self, ino: int) -> list[tuple[int, str]]:
        return [
            (p.ino, name)
            for p in self.inodes.values()
            if p.is_dir
            for name, child in p.entries.items()
            if child == ino
        ]

    def fsync(self, ino: int) -> None:
        with self.lock:
            node = self.inodes[ino]
            if node.is_dir:
                return self.fsyncdir(ino)
            self.stats.fsyncs += 1
            self._link_durably(ino)
            if self.journal:
                self._commit_namespace()
            if ino in self.durable_modes:
                self._sync_data(node)
            self._forget_committed()
            self._save_tree()

    def _sync_data(self, node: Inode) -> None:
        size = len(node.data)
        pages: set[int] = set()
        with open(self.backing / "inodes" / str(node.ino), "r+b") as f:
            f.truncate(size)
            for start, end in node.dirty:
                end = min(end, size)
                if end > start:
                    f.seek(start)
                    f.write(node.data[start:end])
                    self.stats.bytes_synced += end - start
                    pages.update(range(start // PAGE, (end - 1) // PAGE + 1))
        self.stats.pages_synced += len(pages)
        node.dirty.clear()
        node.low = None
        self.durable_modes[node.ino] = node.mode

    def fsyncdir(self, ino: int) -> None:
        with self.lock:
            node = self.inodes[ino]
            self.stats.fsyncs += 1
            self._enter_durable(ino)
            for child in node.entries.values():
                self._enter_durable(child)
            self._committed.update((ino, name) for name in (*self.durable[ino], *node.entries))
            self.durable[ino] = dict(node.entries)
            if ino != ROOT:
                self._link_durably(ino)
            if self.journal:
                self._commit_namespace()
            self._forget_committed()
            self._save_tree()

    def _commit_namespace(self) -> None:
        """The journal: every live directory's entries become durable (not file bytes)."""
        todo = [ROOT]
        while todo:
            d = self.inodes[todo.pop()]
            self._enter_durable(d.ino)
            for child in d.entries.values():
                self._enter_durable(child)
                if self.inodes[child].is_dir:
                    todo.append(child)
            self.durable[d.ino] = dict(d.entries)
        self.pending.clear()

    # -- writeback (rules 4 to 6) ----------------------------------------------------

    def _log(self, op: Op) -> None:
        """A metadata operation made live: pending until an fsync or the journal commits it."""
        if not self.writeback_mode:
            return
        self.pending.append(op)
        if len(self.pending) > MAX_OPS:
            old, self.pending = self.pending[: MAX_OPS // 2], self.pending[MAX_OPS // 2 :]
            for o in old:
                self._apply(o)
            self.stats.ops_committed += len(old)
            self._save_tree()

    def _forget_committed(self) -> None:
        """Drop from the pending operations what an fsync just made durable: replaying an
        older operation on those names would undo it."""
        keys, self._committed = self._committed, set()
        if not keys or not self.pending:
            return
        kept = []
        for op in self.pending:
            rest = {k: v for k, v in op.items() if k not in keys}
            if rest:
                kept.append(rest)
        self.pending = kept

    def _apply(self, op: Op) -> None:
        for (parent, name), ino in op.items():
            self._enter_durable(parent)
            if ino is None:
                self.durable[parent].pop(name, None)
            else:
                self._enter_durable(ino)
                self.durable[parent][name] = ino

    def writeback(self, rng: random.Random) -> dict[str, Any]:
        """What the disk holds when the power goes, beyond what was fsynced (rules 4-6):
        a prefix of the pending metadata operations, then a random subset of every
        durable file's dirty pages, some torn. Returns what it did (``dirty``: the
        files that had unsynced pages, by name, with how many)."""
        with self.lock:
            done = {"ops_committed": 0, "ops_dropped": 0, "pages_written_back": 0}
            done |= {"pages_torn": 0, "pages_left": 0}
            dirty: dict[str, int] = {}
            k = rng.randint(0, len(self.pending))
            for op in self.pending[:k]:
                self._apply(op)
            done["ops_committed"], done["ops_dropped"] = k, len(self.pending) - k
            self.pending = self.pending[k:]
            reachable = self._durable_reachable()
            for ino in sorted(self.durable_modes):
                node = self.inodes.get(ino)
                if node is not None and not node.is_dir and ino in reachable:
                    pages = self._write_back(node, rng, done)
                    if pages:
                        names = [name for _, name in self._names(ino)] or [f"#{ino}"]
                        dirty[names[0]] = pages
            self._save_tree()
            for key, n in done.items():
                setattr(self.stats, key, getattr(self.stats, key) + n)
            return {**done, "dirty": dirty}

    def _write_back(self, node: Inode, rng: random.Random, done: dict[str, int]) -> int:
        blob = self.backing / "inodes" / str(node.ino)
        blob.touch()
        live = node.data
        with open(blob, "r+b") as f:
            size = os.fstat(f.fileno()).st_size
            if node.low is not None and node.low < size and rng.random() < 0.5:
                f.truncate(node.low)  # the truncation reached the disk
                size = node.low
            end = size
            pages = sorted(
                {p for s, e in node.dirty if e > s for p in range(s // PAGE, (e - 1) // PAGE + 1)}
            )
            per_page = PAGE // SECTOR
            for page in pages:
                first = page * per_page
                sectors = [s for s in range(first, first + per_page) if s * SECTOR < len(live)]
                fate = rng.randrange(3)
                if not sectors or fate == 0:
                    done["pages_left"] += 1
                    continue
                if fate == 2 and len(sectors) > 1:
                    sectors = sorted(rng.sample(sectors, rng.randint(1, len(sectors) - 1)))
                    done["pages_torn"] += 1
                else:
                    done["pages_written_back"] += 1
                for s in sectors:  # a sector goes whole: past the live end, the page's zeros
                    data = bytes(live[s * SECTOR : (s + 1) * SECTOR])
                    f.seek(s * SECTOR)
                    f.write(data.ljust(SECTOR, b"\0"))
                    end = max(end, s * SECTOR + len(data))
            if pages and rng.random() < 0.25:
                end = max(end, len(live))  # the size was committed before the data
            f.truncate(end)
        return len(pages)

    # -- the live image ---------------------------------------------------------------

    def lookup(self, path: str) -> Inode:
        node = self.inodes[ROOT]
        for part in [p for p in path.split("/") if p]:
            if not node.is_dir:
                raise FsError(errno.ENOTDIR)
            ino = node.entries.get(part)
            if ino is None:
                raise FsError(errno.ENOENT)
            node = self.inodes[ino]
        return node

    def _parent(self, path: str) -> tuple[Inode, str]:
        head, _, name = path.rstrip("/").rpartition("/")
        parent = self.lookup(head or "/")
        if not parent.is_dir:
            raise FsError(errno.ENOTDIR)
        return parent, name

    def make(self, path: str, mode: int) -> Inode:
        with self.lock:
            parent, name = self._parent(path)
            if name in parent.entries:
                raise FsError(errno.EEXIST)
            node = Inode(self.next_ino, mode)
            self.next_ino += 1
            self.inodes[node.ino] = node
            parent.entries[name] = node.ino
            parent.mtime = time.time()
            self._log({(parent.ino, name): node.ino})
            return node

    def remove(self, path: str, want_dir: bool) -> None:
        with self.lock:
            parent, name = self._parent(path)
            node = self.lookup(path)
            if want_dir != node.is_dir:
                raise FsError(errno.ENOTDIR if want_dir else errno.EISDIR)
            if want_dir and node.entries:
                raise FsError(errno.ENOTEMPTY)
            del parent.entries[name]
            parent.mtime = time.time()
            self._log({(parent.ino, name): None})

    def rename(self, old: str, new: str) -> None:
        with self.lock:
            src_parent, src_name = self._parent(old)
            node = self.lookup(old)
            dst_parent, dst_name = self._parent(new)
            target = dst_parent.entries.get(dst_name)
            if target is not None and target != node.ino:
                other = self.inodes[target]
                if other.is_dir and (not node.is_dir or other.entries):
                    raise FsError(errno.ENOTEMPTY if node.is_dir else errno.EISDIR)
            del src_parent.entries[src_name]
            dst_parent.entries[dst_name] = node.ino
            src_parent.mtime = dst_parent.mtime = time.time()
            if (src_parent.ino, src_name) != (dst_parent.ino, dst_name):
                self._log({(src_parent.ino, src_name): None, (dst_parent.ino, dst_name): node.ino})

    def write(self, ino: int, data: bytes, offset: int) -> int:
        with self.lock:
            node = self.inodes[ino]
            end = offset + len(data)
            grow = end - len(node.data)
            if self.capacity is not None and grow > 0 and self.used() + grow > self.capacity:
                raise FsError(errno.ENOSPC)
            start = min(offset, len(node.data))  # a gap written past the end is zeros, dirty too
            if offset > len(node.data):
                node.data.extend(bytes(offset - len(node.data)))
            node.data[offset:end] = data
            self._dirty(node, start, end)
            self.stats.writes += 1
            self.stats.bytes_written += len(data)
            return len(data)

    def truncate(self, ino: int, length: int) -> None:
        with self.lock:
            node = self.inodes[ino]
            old = len(node.data)
            if length < old:
                del node.data[length:]
                node.low = length if node.low is None else min(node.low, length)
            else:
                node.data.extend(bytes(length - old))
                self._dirty(node, old, length)
            node.mtime = time.time()

    def _dirty(self, node: Inode, start: int, end: int) -> None:
        node.mtime = time.time()
        if node.dirty and node.dirty[-1][1] == start:  # appends: grow the last range
            node.dirty[-1] = (node.dirty[-1][0], end)
        else:
            node.dirty.append((start, end))
        if len(node.dirty) > MAX_RANGES:
            node.dirty = [(min(s for s, _ in node.dirty), max(e for _, e in node.dirty))]

    def used(self) -> int:
        return sum(len(n.data) for n in self.inodes.values())

    def forget_unreachable(self, open_inodes: set[int]) -> None:
        """Drop live inodes no name and no open file refers to (after unlink + close)."""
        with self.lock:
            named = {c for n in self.inodes.values() if n.is_dir for c in n.entries.values()}
            # A pending operation may still bring an unlinked file back at a cut.
            named |= {i for op in self.pending for (p, _), c in op.items() for i in (p, c) if i}
            for ino in list(self.inodes):
                if ino != ROOT and ino not in named and ino not in open_inodes:
                    del self.inodes[ino]
