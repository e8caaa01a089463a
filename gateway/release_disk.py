"""The release directory on the gateway's disk (``pubcomp gateway run --release-dir``).

::

    DIR/releases/<version>/fleet.yaml       the release's configuration (its config text)
    DIR/releases/<version>/envelope.json    the signed envelope as received
    DIR/current                             the running version ("7\\n"); absent: --config
    DIR/previous                            what a rollback returns to ("6\\n", or "config")

A release is **staged** whole before anything names it: written in a temporary folder,
each file fsynced, the folder fsynced, renamed into ``releases/``, and ``releases/``
fsynced. ``current`` and ``previous`` are replaced the same way (write a temporary
file, fsync it, rename it over, fsync the folder): after a power cut each names the
old version or the new one, never a torn one (devkit/powercut's strict model loses
the rename without the folder's fsync; its writeback model may keep a rename whose
file was never fsynced, which the fsync before the rename rules out).

Nothing here decides anything: gateway/release_rules.py says what to write, in which
order relative to the store's commits; a start believes a staged release only if its
``fleet.yaml`` hashes to the sha256 the store holds for it (``verified``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

from pubcomp.sync.release import sha256_hex
from pubcomp.sync.store import fsync_dir

CONFIG = "fleet.yaml"
ENVELOPE = "envelope.json"
CURRENT, PREVIOUS = "current", "previous"
NO_RELEASE = "config"  # ``previous`` when a rollback returns to the --config file
KEEP_OLD = 3  # releases kept beyond current and previous (for recovery by hand)


class ReleaseDir:
    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.releases = self.root / "releases"

    def ensure(self) -> None:
        if not self.releases.is_dir():
            self.releases.mkdir(parents=True, exist_ok=True)
            fsync_dir(self.root)
            if self.root.parent != self.root:
                fsync_dir(self.root.parent)

    # ------------------------------------------------------------ reading

    def current(self) -> int | None:
        """The running version; None: no release (the --config file)."""
        return self._read(CURRENT)

    def previous(self) -> int | None:
        return self._read(PREVIOUS)

    def _read(self, name: str) -> int | None:
        try:
            text = (self.root / name).read_text(encoding="ascii").strip()
        except (OSError, UnicodeDecodeError):
            return None
        return int(text) if text.isdigit() else None

    def config_path(self, version: int) -> Path:
        return self.releases / str(version) / CONFIG

    def config_text(self, version: int) -> str | None:
        try:
            return self.config_path(version).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            return None

    def verified(self, version: int, sha256: str | None) -> bool:
        """Is release ``version`` whole on disk: its fleet.yaml hashes to ``sha256``?"""
        try:
            data = self.config_path(version).read_bytes()
        except OSError:
            return False
        return sha256 is None or sha256_hex(data) == sha256

    # ------------------------------------------------------------ writing

    def stage(self, version: int, config: str, envelope: bytes) -> Path:
        """``releases/<version>/`` whole and durable (module docstring); returns it."""
        self.ensure()
        final = self.releases / str(version)
        if final.exists():  # an earlier try, cut short: staged again from scratch
            shutil.rmtree(final)
        tmp = self.releases / f".staging-{version}"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        _write_synced(tmp / CONFIG, config.encode("utf-8"))
        _write_synced(tmp / ENVELOPE, envelope)
        fsync_dir(tmp)
        os.rename(tmp, final)
        fsync_dir(self.releases)
        return final

    def set_current(self, version: int | None) -> None:
        """``current`` names ``version`` (None: removed, so --config runs), durably."""
        self._replace(CURRENT, version)

    def set_previous(self, version: int | None) -> None:
        self._replace(PREVIOUS, version)

    def _replace(self, name: str, version: int | None) -> None:
        self.ensure()
        path = self.root / name
        if version is None and name == CURRENT:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                fsync_dir(self.root)
            return
        tmp = self.root / f".{name}.tmp"
        _write_synced(tmp, f"{NO_RELEASE if version is None else version}\n".encode())
        os.rename(tmp, path)
        fsync_dir(self.root)

    def prune(self, keep: set[int | None]) -> list[int]:
        """Delete old releases: all but ``keep`` and the newest ``KEEP_OLD`` others."""
        if not self.releases.is_dir():
            return []
        versions = sorted(int(p.name) for p in self.releases.iterdir() if p.name.isdigit())
        spare = [v for v in versions if v not in keep]
        gone = spare[: max(0, len(spare) - KEEP_OLD)]
        for v in gone:
            shutil.rmtree(self.releases / str(v), ignore_errors=True)
        return gone


def _write_synced(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o640)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
