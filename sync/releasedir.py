"""The operator's side of releases, on disk (issue 28): the keys folder and the release
history. Shared by ``pubcomp fleet release`` (gateway/release_render.py: it renders)
and ``pubcomp fleet plan|rollout|keys`` (pipeline/: they read and revert), which is
why it is in sync/ (pipeline/ never imports gateway/).

The keys folder (``pubcomp fleet keys init --keys DIR``)::

    root.key              the root's Ed25519 private key (PEM; 0600; keep it offline)
    root.pub              its public key, one line of base64: each gateway's
                          /etc/pubcomp/release-root.pub (release.root_key)
    release-<id>.key      a release key (PEM; 0600), <id> the first 12 of its keyid
    keys.json             the keys document, signed by the root (the newest)

The history (``--state-dir``, default ``<fleet file's stem>.releases`` beside the fleet
file, so it sits with the file in the operator's version control, and two operators
sharing the checkout share one counter)::

    counter               the last version given (the fleet's versions only go up)
    lock                  flock'ed while a version is given and written
    <version>/index.json  what the release is: its gateways, their topics and hashes,
                          whether it reverts another
    <version>/<gw>.json   each gateway's signed envelope, as published

Each version's folder is written as ``<version>.tmp`` and renamed when whole, so a
reader sees a version complete or not at all.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from . import release as rel


def write_atomic(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Write temp, fsync, rename, fsync the folder: the old file or the new, whole."""
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class ReleaseDirError(Exception):
    """A keys folder or history that cannot be used as asked (one line: where, why)."""


# ------------------------------------------------------------------ keys


class KeyDir:
    """The operator's keys folder (see the module docstring)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    @property
    def doc_path(self) -> Path:
        return self.path / "keys.json"

    def _key_path(self, key: Ed25519PrivateKey) -> Path:
        return self.path / f"release-{rel.keyid(key)[:12]}.key"

    def init(self, expires: datetime) -> tuple[Ed25519PrivateKey, Path]:
        """A new root, a first release key and the keys document version 1."""
        if (self.path / "root.key").exists():
            raise ReleaseDirError(f"{self.path}: already holds a root key (rotate instead)")
        self.path.mkdir(parents=True, exist_ok=True)
        os.chmod(self.path, 0o700)
        root = rel.new_key()
        write_atomic(self.path / "root.key", rel.private_pem(root), 0o600)
        write_atomic(self.path / "root.pub", (rel.public_text(root) + "\n").encode())
        key = rel.new_key()
        write_atomic(self._key_path(key), rel.private_pem(key), 0o600)
        self._write_doc(root, 1, [key], expires)
        return key, self._key_path(key)

    def root(self) -> Ed25519PrivateKey:
        p = self.path / "root.key"
        try:
            return rel.load_private(p.read_bytes())
        except OSError as exc:
            raise ReleaseDirError(f"{p}: {exc.strerror} (pubcomp fleet keys init)") from None

    def root_public(self) -> str:
        return (self.path / "root.pub").read_text().strip()

    def keys_doc(self) -> rel.KeysDoc:
        """The newest keys document, checked against the root's public key."""
        try:
            payload = self.doc_path.read_bytes()
            root = rel.load_public(self.root_public())
        except OSError as exc:
            raise ReleaseDirError(
                f"{self.path}: {exc.strerror}: no keys document (pubcomp fleet keys init)"
            ) from None
        trust = rel.Trust(root)
        trust.accept_keys(payload, datetime.now().astimezone(), stored=True)
        assert trust.keys is not None
        return trust.keys

    def rotate(self, expires: datetime, keep: bool = False) -> tuple[Ed25519PrivateKey, Path]:
        """A new release key in a keys document one version up (``keep``: the old keys
        stay listed, for releases already out; default: retired)."""
        old = self.keys_doc()
        key = rel.new_key()
        write_atomic(self._key_path(key), rel.private_pem(key), 0o600)
        keys: list[Any] = [key]
        if keep:
            keys = list(old.keys.values()) + keys
        self._write_doc(self.root(), old.version + 1, keys, expires)
        return key, self._key_path(key)

    def renew(self, expires: datetime) -> int:
        """The same keys in a keys document one version up, with a new expiry."""
        old = self.keys_doc()
        self._write_doc(self.root(), old.version + 1, list(old.keys.values()), expires)
        return old.version + 1

    def _write_doc(
        self, root: Ed25519PrivateKey, version: int, keys: list[Any], expires: datetime
    ) -> None:
        env = rel.sign(rel.keys_document(version, keys, expires), [root])
        write_atomic(self.doc_path, rel.encode(env))


def load_signing_key(path: str | os.PathLike[str]) -> tuple[Ed25519PrivateKey, rel.KeysDoc]:
    """A release key and the keys document beside it, which must list it (else every
    gateway would refuse what it signs: ``unknown-key``)."""
    p = Path(path)
    try:
        key = rel.load_private(p.read_bytes())
    except OSError as exc:
        raise ReleaseDirError(f"--signing-key {p}: {exc.strerror}") from None
    except ValueError as exc:
        raise ReleaseDirError(f"--signing-key {p}: {exc}") from None
    doc = KeyDir(p.parent).keys_doc()
    if rel.keyid(key) not in doc.keys:
        raise ReleaseDirError(
            f"--signing-key {p}: key {rel.keyid(key)[:12]} is not in the keys document "
            f"version {doc.version} beside it (retired by a rotation?): gateways would refuse it"
        )
    return key, doc


# ------------------------------------------------------------------ history


@dataclass(frozen=True)
class Target:
    """Where one gateway's release goes and how it is seen."""

    gateway: str
    prefix: str  # uplink.topic_prefix: the release goes to {prefix}/{gateway}/release
    status_topic: str
    sha256: str


@dataclass(frozen=True)
class Entry:
    """One version in the history."""

    version: int
    fleet: str
    created: str
    targets: dict[str, Target]
    reverts: int | None  # a revert made by a halted rollout: the version it undoes
    note: str | None

    def envelope(self, history: History, gateway: str) -> bytes:
        return (history.path / str(self.version) / f"{gateway}.json").read_bytes()

    def release(self, history: History, gateway: str) -> rel.Release:
        return rel.read_release(self.envelope(history, gateway))


class History:
    """The fleet's release history (see the module docstring)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    @staticmethod
    def beside(fleet_file: str | os.PathLike[str]) -> History:
        f = Path(fleet_file)
        return History(f.parent / f"{f.stem}.releases")

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        self.path.mkdir(parents=True, exist_ok=True)
        with open(self.path / "lock", "a+") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)

    def counter(self) -> int:
        try:
            return int((self.path / "counter").read_text().strip() or 0)
        except FileNotFoundError:
            return 0

    def add(
        self,
        fleet: str,
        created: str,
        targets: list[Target],
        sign: Any,
        *,
        at_least: int = 0,
        reverts: int | None = None,
        note: str | None = None,
    ) -> Entry:
        """Give the next version (above the counter and ``at_least``: what the broker and
        the gateways have seen, so a lost history cannot give a version they refuse),
        and write each gateway's envelope ``sign(version, target)`` under it."""
        with self.locked():
            version = max(self.counter(), at_least) + 1
            tmp = self.path / f"{version}.tmp"
            tmp.mkdir(exist_ok=True)
            for t in targets:
                write_atomic(tmp / f"{t.gateway}.json", sign(version, t))
            index = {
                "version": version,
                "fleet": fleet,
                "created": created,
                "reverts": reverts,
                "note": note,
                "gateways": {
                    t.gateway: {
                        "prefix": t.prefix,
                        "status_topic": t.status_topic,
                        "sha256": t.sha256,
                    }
                    for t in targets
                },
            }
            write_atomic(tmp / "index.json", json.dumps(index, indent=1, sort_keys=True).encode())
            os.replace(tmp, self.path / str(version))
            _fsync_dir(self.path)
            write_atomic(self.path / "counter", f"{version}\n".encode())
        return self.entry(version)

    def versions(self) -> list[int]:
        if not self.path.is_dir():
            return []
        return sorted(int(p.name) for p in self.path.iterdir() if p.name.isdigit() and p.is_dir())

    def entry(self, version: int) -> Entry:
        p = self.path / str(version) / "index.json"
        try:
            d = json.loads(p.read_text())
        except FileNotFoundError:
            known = self.versions()
            raise ReleaseDirError(
                f"{self.path}: no release {version} (known: "
                f"{', '.join(map(str, known[-10:])) or 'none'})"
            ) from None
        return Entry(
            version=d["version"],
            fleet=d["fleet"],
            created=d["created"],
            reverts=d.get("reverts"),
            note=d.get("note"),
            targets={
                g: Target(g, t["prefix"], t["status_topic"], t["sha256"])
                for g, t in d["gateways"].items()
            },
        )

    def latest(self) -> Entry | None:
        v = self.versions()
        return self.entry(v[-1]) if v else None

    def find(self, gateway: str, sha256: str, below: int | None = None) -> rel.Release | None:
        """The newest release of ``gateway`` whose config hashes to ``sha256`` (what a
        gateway reports running is a hash; the text is here)."""
        for v in reversed(self.versions()):
            if below is not None and v >= below:
                continue
            e = self.entry(v)
            t = e.targets.get(gateway)
            if t is not None and t.sha256 == sha256:
                return e.release(self, gateway)
        return None
