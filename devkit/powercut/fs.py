"""The power-cut file system over FUSE: ``python -m devkit.powercut.fs BACKING MOUNT CONTROL``.

model.py holds the rules; this module only speaks FUSE (mfusepy over libfuse 3)
and listens on a Unix socket for the harness: ``freeze`` (from now on every
file system call blocks forever, as on a machine whose power just went, so
nothing more reaches the backing directory), ``stats`` (JSON) and ``ping``.
A dying SD card: ``readonly`` (as ext4 remounting itself read-only on errors:
every mutating call fails with EROFS, an fsync only if it has dirty data to
carry; reads go on), ``eio`` (the same calls, and every fsync, fail with EIO)
and ``heal`` (both gone; what was durable before stays so).
A cut is: freeze, SIGKILL the programs using the mount, SIGKILL this process
(its memory is the volatile state), unmount; mount.py does that.

Writeback mode (``--writeback``, model.py rules 4-6): ``freeze SEED`` first lets
``random.Random(SEED)`` choose what background writeback had carried to the
backing directory (the reply says what), and ``arm N SEED`` freezes by itself
right after the N-th write from now has reached the live image, before the
writer can fsync it: the write-then-cut moment, hit every time.
``--write-delay S`` makes every write return S seconds late (after it is in
the live image), so cuts at random times fall between a write and its fsync
more often. ``ping`` says whether the file system is frozen.
"""

from __future__ import annotations

import argparse
import errno
import functools
import json
import os
import random
import socket
import stat
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import mfusepy

from .model import FsError, Image

F = TypeVar("F", bound=Callable[..., Any])


def gated(fn: F) -> F:
    """Every call waits while the power is on; after a freeze it never returns."""

    @functools.wraps(fn)
    def call(self: PowerCutFS, *args: Any) -> Any:
        lock = self.image.lock
        lock.acquire()
        try:
            if self.frozen.is_set():
                lock.release()  # the freeze must still get the lock
                lock = None
                threading.Event().wait()
            return fn(self, *args)
        except FsError as exc:
            raise mfusepy.FuseOSError(exc.errno) from None
        except KeyError:
            raise mfusepy.FuseOSError(errno.EBADF) from None
        finally:
            if lock is not None:
                lock.release()

    return call  # type: ignore[return-value]


FAULTS = {"readonly": errno.EROFS, "eio": errno.EIO}


def mutating(fn: F) -> F:
    """A call that changes the file system: refused while a fault is set (inside ``gated``)."""

    @functools.wraps(fn)
    def call(self: PowerCutFS, *args: Any) -> Any:
        if self.fault is not None:
            self.refused[fn.__name__.lstrip("_")] += 1
            raise FsError(FAULTS[self.fault])
        return fn(self, *args)

    return call  # type: ignore[return-value]


class PowerCutFS(mfusepy.Operations):
    use_ns = True

    def __init__(self, image: Image, fsync_delay: float = 0.0, write_delay: float = 0.0) -> None:
        self.image = image
        self.fsync_delay = fsync_delay
        self.write_delay = write_delay
        self.frozen = threading.Event()
        self.armed: tuple[int, str] | None = None  # (writes left, seed): freeze after them
        self.at_freeze: dict[str, Any] = {}  # what writeback did when the power went
        self.handles: Counter[int] = Counter()
        self.fault: str | None = None  # "readonly" or "eio": a dying card (FAULTS)
        self.refused: Counter[str] = Counter()  # calls a fault refused, by name

    def _node(self, path: str | None, fh: int | None) -> Any:
        if fh:
            return self.image.inodes[fh]
        assert path is not None
        return self.image.lookup(path)

    @gated
    def getattr(self, path: str | None, fh: int | None = None) -> dict[str, Any]:
        node = self._node(path, fh)
        ns = int(node.mtime * 1e9)
        return {
            "st_mode": node.mode,
            "st_ino": node.ino,
            "st_nlink": 2 if node.is_dir else 1,
            "st_size": len(node.data),
            "st_uid": os.getuid(),
            "st_gid": os.getgid(),
            "st_mtime": ns,
            "st_ctime": ns,
            "st_atime": ns,
            "st_blocks": (len(node.data) + 511) // 512,
        }

    @gated
    def readdir(self, path: str | None, fh: int) -> list[str]:
        return [".", "..", *self._node(path, fh).entries]

    @gated
    def opendir(self, path: str) -> int:
        node = self.image.lookup(path)
        if not node.is_dir:
            raise FsError(errno.ENOTDIR)
        return node.ino

    @gated
    def releasedir(self, path: str | None, fh: int) -> int:
        return 0

    @gated
    @mutating
    def mkdir(self, path: str, mode: int) -> int:
        self.image.make(path, stat.S_IFDIR | (mode & 0o7777))
        return 0

    @gated
    @mutating
    def rmdir(self, path: str) -> int:
        self.image.remove(path, want_dir=True)
        return 0

    @gated
    @mutating
    def unlink(self, path: str) -> int:
        self.image.remove(path, want_dir=False)
        return 0

    @gated
    @mutating
    def rename(self, old: str, new: str) -> int:
        self.image.rename(old, new)
        return 0

    @gated
    @mutating
    def create(self, path: str, mode: int, fi: Any = None) -> int:
        node = self.image.make(path, stat.S_IFREG | (mode & 0o7777))
        self.handles[node.ino] += 1
        return node.ino

    @gated
    def open(self, path: str, flags: int) -> int:
        node = self.image.lookup(path)
        if flags & os.O_TRUNC:
            if self.fault is not None:
                self.refused["open"] += 1
                raise FsError(FAULTS[self.fault])
            self.image.truncate(node.ino, 0)
        self.handles[node.ino] += 1
        return node.ino

    @gated
    def release(self, path: str | None, fh: int) -> int:
        self.handles[fh] -= 1
        if self.handles[fh] <= 0:
            del self.handles[fh]
            self.image.forget_unreachable(set(self.handles))
        return 0

    @gated
    def flush(self, path: str | None, fh: int) -> int:
        return 0  # close() is not a barrier: nothing reaches the backing directory

    @gated
    def read(self, path: str | None, size: int, offset: int, fh: int) -> bytes:
        return bytes(self.image.inodes[fh].data[offset : offset + size])

    def write(self, path: str | None, data: bytes, offset: int, fh: int) -> int:
        n = self._write(path, data, offset, fh)
        if self.write_delay:
            time.sleep(self.write_delay)  # in the live image, not yet returned: no fsync yet
        return n

    @gated
    @mutating
    def _write(self, path: str | None, data: bytes, offset: int, fh: int) -> int:
        n = self.image.write(fh, data, offset)
        if self.armed is not None:
            left, seed = self.armed
            self.armed = (left - 1, seed) if left > 1 else None
            if left <= 1:
                self._freeze(seed)  # under the lock: nothing else happens after this write
        return n

    def _freeze(self, seed: str | None) -> dict[str, Any]:
        """The power goes: from now on every call blocks (``gated``). In writeback mode the
        seed chooses what had reached the disk. Call with the image lock held."""
        if not self.frozen.is_set():
            self.frozen.set()
            self.at_freeze = {"frozen": True}
            if self.image.writeback_mode:
                done = self.image.writeback(random.Random(seed))
                self.at_freeze |= {"seed": seed, **done}
        return self.at_freeze

    @gated
    @mutating
    def truncate(self, path: str | None, length: int, fh: int | None = None) -> int:
        self.image.truncate(self._node(path, fh).ino, length)
        return 0

    def fsync(self, path: str | None, datasync: int, fh: int) -> int:
        if self.fsync_delay:
            time.sleep(self.fsync_delay)  # slow flash: the caller waits, others go on
        return self._fsync(path, datasync, fh)

    @gated
    def _fsync(self, path: str | None, datasync: int, fh: int) -> int:
        self._fsync_fault(self.image.inodes[fh].dirty)
        self.image.fsync(fh)
        return 0

    @gated
    def fsyncdir(self, path: str | None, datasync: int, fh: int) -> int:
        self._fsync_fault([])
        self.image.fsyncdir(fh or self.image.lookup(path or "/").ino)
        return 0

    def _fsync_fault(self, dirty: list[tuple[int, int]]) -> None:
        """EIO fails every fsync; read-only fails one with dirty data to carry."""
        if self.fault == "eio" or (self.fault == "readonly" and dirty):
            self.refused["fsync"] += 1
            raise FsError(FAULTS[self.fault])

    @gated
    @mutating
    def chmod(self, path: str | None, mode: int) -> int:
        node = self.image.lookup(path or "/")
        node.mode = (node.mode & ~0o7777) | (mode & 0o7777)
        return 0

    @gated
    @mutating
    def chown(self, path: str | None, uid: int, gid: int) -> int:
        return 0

    @gated
    @mutating
    def utimens(self, path: str | None, times: tuple[int, int] | None = None) -> int:
        node = self.image.lookup(path or "/")
        node.mtime = times[1] / 1e9 if times else time.time()
        return 0

    @gated
    def access(self, path: str, amode: int) -> int:
        self.image.lookup(path)
        return 0

    @gated
    def statfs(self, path: str) -> dict[str, int]:
        cap = self.image.capacity or 1 << 34
        free = max(0, cap - self.image.used()) // 4096
        blocks = {"f_blocks": cap // 4096, "f_bfree": free, "f_bavail": free}
        return {"f_bsize": 4096, "f_frsize": 4096, "f_namemax": 255, **blocks}

    def control(self, sock_path: Path) -> None:
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock_path.unlink(missing_ok=True)
        srv.bind(str(sock_path))
        srv.listen(4)
        while True:
            conn, _ = srv.accept()
            with conn:
                cmd, _, arg = conn.recv(256).decode().strip().partition(" ")
                if cmd == "freeze":
                    with self.image.lock:  # an fsync under way finishes first, then nothing
                        reply: dict[str, Any] = self._freeze(arg or None)
                elif cmd == "arm":
                    writes, _, seed = arg.partition(" ")
                    with self.image.lock:
                        self.armed = (max(1, int(writes)), seed)
                    reply = {"armed": int(writes)}
                elif cmd == "stats":
                    with self.image.lock:
                        reply = self.image.stats.as_dict() | {"used": self.image.used()}
                elif cmd in FAULTS or cmd == "heal":
                    with self.image.lock:  # a call under way finishes first
                        self.fault = None if cmd == "heal" else cmd
                        reply = {"fault": self.fault, "refused": dict(self.refused)}
                else:
                    reply = {"pong": True, "frozen": self.frozen.is_set()}
                conn.sendall(json.dumps(reply).encode())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("backing", type=Path)
    ap.add_argument("mount", type=Path)
    ap.add_argument("control", type=Path)
    ap.add_argument("--capacity", type=int, default=None, help="bytes of file data (ENOSPC)")
    ap.add_argument("--journal", action="store_true", help="any fsync commits every rename")
    ap.add_argument("--fsync-delay", type=float, default=0.0, help="seconds added to each fsync")
    ap.add_argument("--write-delay", type=float, default=0.0, help="seconds added to each write")
    ap.add_argument(
        "--writeback", action="store_true", help="a cut keeps a seeded subset of unsynced pages"
    )
    args = ap.parse_args()
    image = Image(args.backing, args.capacity, args.journal, writeback=args.writeback)
    fs = PowerCutFS(image, args.fsync_delay, args.write_delay)
    threading.Thread(target=fs.control, args=(args.control,), daemon=True).start()
    # hard_remove: an unlinked open file stays reachable by handle, no .fuse_hidden renames.
    mfusepy.FUSE(fs, str(args.mount), foreground=True, hard_remove=True, allow_other=True,
                 default_permissions=False, fsname="powercut")  # fmt: skip


if __name__ == "__main__":
    main()
