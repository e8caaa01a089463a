"""Mount the power-cut file system, cut its power, mount it again.

with PowerCutMount(tmp / "backing", tmp / "mnt") as disk:
    proc = start_program(state_dir=disk.path)
    disk.cut(proc)            # the program and every unsynced byte are gone
    start_program(...)        # boots from what was durable

Writeback mode (model.py rules 4-6): ``PowerCutMount(..., writeback=SEED)``.
Cut number i (from 0) draws its choices from ``random.Random(f"{SEED}:{i}")``;
each cut prints its seed and what writeback did (pytest shows it with a
failure) and appends it to ``cut_log``. ``arm(n)`` makes the file system cut
its own power right after the n-th write from now (before that write can be
fsynced); ``wait_frozen()`` waits for it, then ``cut(...)`` does the rest.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def fuse_missing() -> str | None:
    """Why the power-cut tests cannot run here, or None when they can."""
    if not Path("/dev/fuse").exists():
        return "/dev/fuse is missing (no FUSE in this kernel or container)"
    if shutil.which("fusermount3") is None:
        return "fusermount3 is missing (Debian package fuse3; make setup installs it)"
    try:
        import mfusepy  # noqa: F401
    except (ImportError, OSError) as exc:
        return f"mfusepy cannot load libfuse3: {exc}"
    return None


class PowerCutMount:
    def __init__(
        self,
        backing: Path,
        mount: Path,
        capacity: int | None = None,
        journal: bool = False,
        fsync_delay: float = 0.0,
        writeback: int | str | None = None,
        write_delay: float = 0.0,
    ) -> None:
        self.backing, self.path, self.capacity, self.journal = backing, mount, capacity, journal
        self.fsync_delay, self.write_delay = fsync_delay, write_delay
        self.writeback = writeback  # the base seed; None: the strict fsync-only model
        self.cut_log: list[dict[str, Any]] = []
        self.control = backing.parent / f".{mount.name}.control"
        self.log = backing.parent / f"{mount.name}.fs.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.cuts = 0
        self.totals: dict[str, int] = {}

    def __enter__(self) -> PowerCutMount:
        return self.mount()

    def __exit__(self, *exc: object | TracebackType) -> None:
        self.unmount()

    def mount(self) -> PowerCutMount:
        self.backing.mkdir(parents=True, exist_ok=True)
        self.path.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "devkit.powercut.fs", str(self.backing), str(self.path)]
        cmd += [str(self.control)]
        if self.capacity is not None:
            cmd += ["--capacity", str(self.capacity)]
        if self.journal:
            cmd.append("--journal")
        if self.fsync_delay:
            cmd += ["--fsync-delay", str(self.fsync_delay)]
        if self.write_delay:
            cmd += ["--write-delay", str(self.write_delay)]
        if self.writeback is not None:
            cmd.append("--writeback")
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=log)
        deadline = time.monotonic() + 20
        while not (os.path.ismount(self.path) and self._ask("ping", quiet=True)):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"power-cut fs did not mount: {self.log.read_text()[-2000:]}")
            time.sleep(0.02)
        return self

    def _ask(self, cmd: str, quiet: bool = False) -> dict[str, Any] | None:
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(30)
                s.connect(str(self.control))
                s.sendall(cmd.encode())
                return dict(json.loads(s.recv(65536)))
        except OSError:
            if quiet:
                return None
            raise

    def stats(self) -> dict[str, int]:
        """Counters since the first mount: bytes written, bytes fsynced, fsyncs, cuts (and
        what writeback carried at the cuts)."""
        now = self._ask("stats") or {}
        out = dict(self.totals)
        for k, v in now.items():
            out[k] = out.get(k, 0) + v if k != "used" else v
        out["cuts"] = self.cuts
        return out

    def _count(self) -> None:
        for k, v in (self._ask("stats") or {}).items():
            if k != "used":
                self.totals[k] = self.totals.get(k, 0) + v

    def readonly(self) -> dict[str, Any]:
        """The card turns read-only (ext4 ``errors=remount-ro``): mutating calls fail with
        EROFS, reads go on. Until ``heal`` or the next cut."""
        return self._ask("readonly") or {}

    def eio(self) -> dict[str, Any]:
        """The card fails its writes: mutating calls and fsyncs fail with EIO, reads go on."""
        return self._ask("eio") or {}

    def heal(self) -> dict[str, Any]:
        """The fault is gone (a new card, in effect; what was durable stays)."""
        return self._ask("heal") or {}

    def seed(self) -> str | None:
        """The seed of the next cut's writeback (None in the strict model)."""
        return None if self.writeback is None else f"{self.writeback}:{self.cuts}"

    def arm(self, writes: int = 1) -> None:
        """Cut the power right after the ``writes``-th write from now reaches the page
        cache, before it can be fsynced; then ``wait_frozen`` and ``cut``."""
        self._ask(f"arm {writes} {self.seed()}")

    def wait_frozen(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if (self._ask("ping") or {}).get("frozen"):
                return True
            time.sleep(0.005)
        return False

    def cut(self, *victims: subprocess.Popen[Any] | int) -> None:
        """Power off and on: nothing more reaches the backing directory, the programs
        using the mount die where they stand, the page cache is gone (in writeback mode:
        all but what the seed lets through), then it mounts again from the backing
        directory. Restart the programs afterwards."""
        seed = self.seed()
        at = self._ask("freeze" if seed is None else f"freeze {seed}") or {}
        self._count()  # after the freeze: with what writeback carried
        if seed is not None:
            self.cut_log.append(at)
            print(f"powercut: cut {self.cuts} writeback {json.dumps(at)}", flush=True)
        for v in victims:
            pid = v if isinstance(v, int) else v.pid
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        # A victim blocked in a call this process is serving waits for its answer even
        # through SIGKILL; killing the file system ends those calls, then the victims die.
        self._kill_fs()
        for v in victims:
            if not isinstance(v, int):
                v.wait(30)
        self.cuts += 1
        self.mount()

    def _kill_fs(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        subprocess.run(["fusermount3", "-u", "-z", str(self.path)], capture_output=True)

    def unmount(self) -> None:
        """Tear down (not a cut: used at the end of a test)."""
        if self.proc is not None and self.proc.poll() is None:
            subprocess.run(["fusermount3", "-u", "-z", str(self.path)], capture_output=True)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._kill_fs()
