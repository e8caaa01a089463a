"""Signed gateway releases and the keys that sign them (issue 28), sans-I/O.

Shared by the operator's side (``pubcomp fleet release|plan|rollout|keys``) and the
gateway's apply; it reads no file, opens no socket and reads no clock: times come in
as arguments. docs/wire-format.md ("Releases") is the format; this is the rules.

Theory of operation
-------------------
Two documents, each an envelope ``{"signed": DOC, "signatures": [{"keyid", "sig"}]}``
whose signatures are Ed25519 over ``canonical(DOC)`` (sorted keys, no spaces, UTF-8,
no floats), ``keyid`` the hex SHA-256 of the raw 32-byte public key:

- the **keys document** (``type: release-keys``) lists the release keys. It is signed
  by the **root** key, which stays offline on the operator's machine; a gateway is
  provisioned with the root's public key only. A keys document with a higher
  ``version`` replaces the one held (rotation: a stolen release key is retired by
  signing a keys document without it); a lower one is refused (rollback), the same
  one again is no change (retained messages come again at every reconnection);
- a **release** (``type: gateway-release``) carries one gateway's effective
  configuration as fleet-file YAML text and its SHA-256, for one fleet and one
  gateway, with a ``version`` that every new release of the fleet raises. It must be
  signed by a key of the keys document the gateway holds.

What a gateway checks, in this order, each refusal a ``ReleaseRefused`` with a
``reason`` (one of ``REASONS``: counted by it) and a sentence:

1. the bytes are an envelope of the right shape (``malformed``), with at least one
   signature (``unsigned``);
2. it holds a keys document (``no-keys``) that has not expired (``keys-expired``);
   a signature is by one of its keys (``unknown-key``) and verifies
   (``bad-signature``);
3. the release is for its fleet and itself (``wrong-fleet``, ``wrong-gateway``);
4. its version is newer than the newest it has applied or marked bad (``old-version``;
   ``same-version``: the one it has, delivered again, which is no news);
5. it has not expired (``expired``), its config matches its hash (``bad-sha256``),
   and the config passes the caller's validation (``invalid-config``).

Signatures are checked before anything the document says is believed, so a forged
document can only ever draw ``unsigned``, ``unknown-key`` or ``bad-signature``.

Large envelopes travel in chunks (``split``, ``Reassembly``): a manifest where the
envelope would be and chunks beside it, each tagged with the whole's SHA-256 and its
index, so a chunk of an older release is told apart (stale: ignored) from a chunk in
the wrong place or a whole that does not hash (``chunk``: refused).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Literal, get_args

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from .errors import ReleaseRefused as ReleaseRefused  # re-exported: what verify raises

V = 1
RELEASE_TYPE = "gateway-release"
KEYS_TYPE = "release-keys"
# A retained message larger than this is split (the contract; brokers often cap a
# message near 256 kB, and a gateway holds a chunk in memory at a time).
CHUNK_BYTES = 64 * 1024
# Nothing a gateway will take is larger: a fleet file of one gateway is a few kB.
MAX_RELEASE_BYTES = 8 * 1024 * 1024

Reason = Literal[
    "malformed",
    "unsigned",
    "no-keys",
    "keys-expired",
    "unknown-key",
    "bad-signature",
    "wrong-fleet",
    "wrong-gateway",
    "old-version",
    "same-version",
    "expired",
    "bad-sha256",
    "invalid-config",
    "chunk",
    "too-large",
    "keys-not-root",
    "keys-old-version",
]
REASONS: tuple[Reason, ...] = get_args(Reason)

_TIME = re.compile(r"^[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}\.[0-9]{3}Z$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def _refuse(reason: Reason, text: str) -> ReleaseRefused:
    return ReleaseRefused(reason, text)


# ------------------------------------------------------------------ encoding


def _no_floats(obj: Any, where: str = "") -> None:
    # A float has more than one text form; a signed document must have exactly one.
    if isinstance(obj, float):
        raise ValueError(f"{where or 'document'}: floats have no canonical form")
    if isinstance(obj, Mapping):
        for k, v in obj.items():
            if not isinstance(k, str):
                raise ValueError(f"{where}: keys must be strings")
            _no_floats(v, f"{where}.{k}" if where else k)
    elif isinstance(obj, list | tuple):
        for i, v in enumerate(obj):
            _no_floats(v, f"{where}[{i}]")


def canonical(obj: Any) -> bytes:
    """The one byte form of a document that is signed: sorted keys, no spaces, UTF-8."""
    _no_floats(obj)
    return json.dumps(
        obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode("utf-8")


def sha256_hex(data: bytes | str) -> str:
    return hashlib.sha256(data.encode("utf-8") if isinstance(data, str) else data).hexdigest()


def time_text(t: datetime) -> str:
    """A time as releases write it: UTC, milliseconds, ``Z``."""
    return t.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def parse_time(text: Any, what: str) -> datetime:
    if not isinstance(text, str) or not _TIME.match(text):
        raise _refuse("malformed", f"{what}: expected a UTC time like 2026-01-31T12:00:00.000Z")
    try:
        return datetime.fromisoformat(text)
    except ValueError:
        raise _refuse("malformed", f"{what}: {text!r} is no date") from None


_SPAN = re.compile(r"^\s*([0-9]+)\s*([smhdw])\s*$")
_SPAN_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_span(text: str) -> timedelta:
    """``30d``, ``12h``, ``90m``, ``2w``: how long a document stays valid."""
    m = _SPAN.match(text)
    if not m or int(m.group(1)) == 0:
        raise ValueError(f"{text!r}: expected a duration like 30d, 12h, 90m or 2w")
    return timedelta(seconds=int(m.group(1)) * _SPAN_S[m.group(2)])


# ------------------------------------------------------------------ keys


def public_raw(key: Ed25519PublicKey | Ed25519PrivateKey) -> bytes:
    pub = key.public_key() if isinstance(key, Ed25519PrivateKey) else key
    return pub.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def keyid(key: Ed25519PublicKey | Ed25519PrivateKey) -> str:
    """A key's id: the hex SHA-256 of its raw 32-byte public key."""
    return sha256_hex(public_raw(key))


def public_text(key: Ed25519PublicKey | Ed25519PrivateKey) -> str:
    """A public key as it is written in a keys document and a ``.pub`` file: base64 raw."""
    return base64.b64encode(public_raw(key)).decode("ascii")


def load_public(text: str | bytes) -> Ed25519PublicKey:
    """A public key from its base64 raw form (a ``.pub`` file's one line) or PEM."""
    data = text.encode("ascii", "replace") if isinstance(text, str) else text
    data = data.strip()
    if data.startswith(b"-----BEGIN"):
        key = serialization.load_pem_public_key(data)
        if not isinstance(key, Ed25519PublicKey):
            raise ValueError("not an Ed25519 public key")
        return key
    try:
        raw = base64.b64decode(data, validate=True)
    except binascii.Error:
        raise ValueError("expected an Ed25519 public key: 44 characters of base64") from None
    if len(raw) != 32:
        raise ValueError(f"expected 32 bytes of Ed25519 public key, found {len(raw)}")
    return Ed25519PublicKey.from_public_bytes(raw)


def private_pem(key: Ed25519PrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def load_private(pem: bytes) -> Ed25519PrivateKey:
    key = serialization.load_pem_private_key(pem, password=None)
    if not isinstance(key, Ed25519PrivateKey):
        raise ValueError("not an Ed25519 private key")
    return key


def new_key() -> Ed25519PrivateKey:
    return Ed25519PrivateKey.generate()


# ------------------------------------------------------------------ envelopes


def sign(signed: Mapping[str, Any], keys: Sequence[Ed25519PrivateKey]) -> dict[str, Any]:
    """The envelope of a document, signed by each of ``keys``."""
    body = canonical(signed)
    return {
        "signed": dict(signed),
        "signatures": [
            {"keyid": keyid(k), "sig": base64.b64encode(k.sign(body)).decode("ascii")} for k in keys
        ],
    }


def encode(envelope: Mapping[str, Any]) -> bytes:
    """An envelope's bytes on the wire (canonical too: the same release, the same bytes)."""
    return canonical(envelope)


def decode(payload: bytes | str | Mapping[str, Any], what: str = "release") -> dict[str, Any]:
    """An envelope from its bytes (or parsed): ``ReleaseRefused`` unless it has the
    envelope's shape."""
    if isinstance(payload, Mapping):
        env: Any = dict(payload)
    else:
        if len(payload) > MAX_RELEASE_BYTES:
            raise _refuse("too-large", f"{what}: {len(payload)} bytes, over {MAX_RELEASE_BYTES}")
        if not payload:
            raise _refuse("malformed", f"{what}: empty message")
        try:
            env = json.loads(payload)
        except (ValueError, UnicodeDecodeError) as exc:
            raise _refuse("malformed", f"{what}: not JSON ({exc})") from None
    if not isinstance(env, dict) or not isinstance(env.get("signed"), dict):
        raise _refuse("malformed", f"{what}: expected {{'signed': ..., 'signatures': [...]}}")
    if set(env) - {"signed", "signatures"}:
        raise _refuse(
            "malformed", f"{what}: unknown keys {sorted(set(env) - {'signed', 'signatures'})}"
        )
    sigs = env.get("signatures")
    if not isinstance(sigs, list) or not sigs:
        raise _refuse("unsigned", f"{what}: no signature")
    for s in sigs:
        if (
            not isinstance(s, dict)
            or not isinstance(s.get("keyid"), str)
            or not isinstance(s.get("sig"), str)
        ):
            raise _refuse("malformed", f"{what}: a signature must be {{'keyid', 'sig'}}")
    return env


def check_signature(
    envelope: Mapping[str, Any], trusted: Mapping[str, Ed25519PublicKey], what: str, signer: str
) -> str:
    """The keyid that signed ``envelope`` among ``trusted``; refused otherwise.

    One valid signature by a trusted key is enough (threshold 1, docs/architecture.md);
    a signature by an unknown key is skipped (a keys document may carry a key the
    gateway does not yet know), a bad one by a trusted key is refused.
    """
    try:
        body = canonical(envelope["signed"])
    except ValueError as exc:
        raise _refuse("malformed", f"{what}: {exc}") from None
    bad = None
    for s in envelope.get("signatures") or []:
        key = trusted.get(s["keyid"])
        if key is None:
            continue
        try:
            key.verify(base64.b64decode(s["sig"], validate=True), body)
        except (InvalidSignature, binascii.Error, ValueError):
            bad = s["keyid"]
            continue
        return str(s["keyid"])
    if bad is not None:
        raise _refuse(
            "bad-signature",
            f"{what}: the signature by key {bad[:12]} does not verify (altered, or "
            "signed over other bytes)",
        )
    ids = ", ".join(s["keyid"][:12] for s in envelope.get("signatures") or [])
    reason: Reason = "keys-not-root" if signer == "the root key" else "unknown-key"
    raise _refuse(reason, f"{what}: signed by {ids or 'nobody'}, none of them {signer}")


# ------------------------------------------------------------------ documents


@dataclass(frozen=True)
class KeysDoc:
    """A verified keys document."""

    version: int
    keys: dict[str, Ed25519PublicKey]
    expires: datetime
    envelope: dict[str, Any] = field(repr=False, compare=False)

    @property
    def signed(self) -> dict[str, Any]:
        return dict(self.envelope["signed"])


@dataclass(frozen=True)
class Release:
    """A verified release (``signed_by``: the key's id)."""

    fleet: str
    gateway: str
    version: int
    created: datetime
    expires: datetime
    config: str
    config_sha256: str
    nodes: dict[str, Any] | None
    signed_by: str
    envelope: dict[str, Any] = field(repr=False, compare=False)

    def encoded(self) -> bytes:
        return encode(self.envelope)


def keys_document(
    version: int, keys: Iterable[Ed25519PublicKey | Ed25519PrivateKey], expires: datetime
) -> dict[str, Any]:
    """The signed part of a keys document (sign it with the root key: ``sign``)."""
    if version < 1:
        raise ValueError("a keys document's version starts at 1")
    listed = [{"keyid": keyid(k), "public": public_text(k)} for k in keys]
    if not listed:
        raise ValueError("a keys document lists at least one release key")
    return {
        "v": V,
        "type": KEYS_TYPE,
        "version": version,
        "keys": listed,
        "expires": time_text(expires),
    }


def release_document(
    *,
    fleet: str,
    gateway: str,
    version: int,
    config: str,
    created: datetime,
    expires: datetime,
    nodes: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The signed part of a release (sign it with a release key: ``sign``)."""
    if version < 1:
        raise ValueError("a release's version starts at 1")
    doc: dict[str, Any] = {
        "v": V,
        "type": RELEASE_TYPE,
        "fleet": fleet,
        "gateway": gateway,
        "version": version,
        "created": time_text(created),
        "expires": time_text(expires),
        "config": config,
        "config_sha256": sha256_hex(config),
    }
    if nodes is not None:
        doc["nodes"] = dict(nodes)
    return doc


def _int(doc: Mapping[str, Any], key: str, what: str) -> int:
    v = doc.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise _refuse("malformed", f"{what}: {key}: expected a whole number from 1")
    return v


def _str(doc: Mapping[str, Any], key: str, what: str) -> str:
    v = doc.get(key)
    if not isinstance(v, str) or not v:
        raise _refuse("malformed", f"{what}: {key}: expected a string")
    return v


def _expect_type(doc: Mapping[str, Any], kind: str, what: str) -> None:
    if doc.get("v") != V or doc.get("type") != kind:
        raise _refuse(
            "malformed",
            f"{what}: expected v {V} type {kind!r}, found v {doc.get('v')!r} "
            f"type {doc.get('type')!r}",
        )


_KEYS_FIELDS = {"v", "type", "version", "keys", "expires"}
_RELEASE_FIELDS = {
    "v",
    "type",
    "fleet",
    "gateway",
    "version",
    "created",
    "expires",
    "config",
    "config_sha256",
    "nodes",
}


def _keys_from(envelope: dict[str, Any], what: str) -> KeysDoc:
    doc = envelope["signed"]
    _expect_type(doc, KEYS_TYPE, what)
    if set(doc) - _KEYS_FIELDS:
        raise _refuse("malformed", f"{what}: unknown keys {sorted(set(doc) - _KEYS_FIELDS)}")
    listed = doc.get("keys")
    if not isinstance(listed, list) or not listed:
        raise _refuse("malformed", f"{what}: keys: expected a list of {{'keyid', 'public'}}")
    keys: dict[str, Ed25519PublicKey] = {}
    for i, k in enumerate(listed):
        if not isinstance(k, dict) or not isinstance(k.get("public"), str):
            raise _refuse("malformed", f"{what}: keys[{i}]: expected {{'keyid', 'public'}}")
        try:
            pub = load_public(k["public"])
        except ValueError as exc:
            raise _refuse("malformed", f"{what}: keys[{i}]: {exc}") from None
        if k.get("keyid") != keyid(pub):
            raise _refuse("malformed", f"{what}: keys[{i}]: keyid is not its key's SHA-256")
        keys[keyid(pub)] = pub
    return KeysDoc(
        version=_int(doc, "version", what),
        keys=keys,
        expires=parse_time(doc.get("expires"), f"{what}: expires"),
        envelope=envelope,
    )


# ------------------------------------------------------------------ the trust a gateway holds


@dataclass
class Trust:
    """What a gateway trusts: the root's public key and the newest keys document it took.

    ``accept_keys`` and ``verify`` are the gateway's two doors; the caller keeps
    ``keys.envelope`` (to take it again at the next start: ``accept_keys`` with
    ``stored=True``) and the newest release version it has seen.
    """

    root: Ed25519PublicKey
    keys: KeysDoc | None = None

    @property
    def root_id(self) -> str:
        return keyid(self.root)

    def accept_keys(
        self, payload: bytes | str | Mapping[str, Any], now: datetime, stored: bool = False
    ) -> bool:
        """Take a keys document: True when it replaced the one held, False when it is the
        same one again. Refused when not signed by the root, older than the one held, or
        expired (``stored``: the caller's own copy, read at start, may be expired: it is
        taken, and every release is refused ``keys-expired`` until a newer one comes)."""
        what = "keys document"
        env = decode(payload, what)
        check_signature(env, {self.root_id: self.root}, what, "the root key")
        doc = _keys_from(env, what)
        if self.keys is not None:
            if doc.version < self.keys.version:
                raise _refuse(
                    "keys-old-version",
                    f"{what}: version {doc.version} is older than the version "
                    f"{self.keys.version} held (a replay)",
                )
            if doc.version == self.keys.version:
                if canonical(env["signed"]) != canonical(self.keys.envelope["signed"]):
                    raise _refuse(
                        "keys-old-version",
                        f"{what}: another document under the version {doc.version} held",
                    )
                return False
        if not stored and doc.expires <= now:
            raise _refuse("keys-expired", f"{what}: expired at {time_text(doc.expires)}")
        self.keys = doc
        return True

    def verify(
        self,
        payload: bytes | str | Mapping[str, Any],
        *,
        fleet: str | None,
        gateway: str,
        newest: int | None,
        now: datetime,
        validate: Callable[[str], Sequence[str]] | None = None,
    ) -> Release:
        """A release this gateway may apply, or ``ReleaseRefused`` saying why not.

        ``newest``: the newest version it has applied or marked bad (None: none yet).
        ``validate``: the gateway's own check of the config text (gateway/config.py;
        sync/ cannot import it): the problems it finds, none when valid.
        """
        what = "release"
        env = decode(payload, what)
        if self.keys is None:
            raise _refuse("no-keys", f"{what}: no keys document yet (on {{prefix}}/release-keys)")
        if self.keys.expires <= now:
            raise _refuse(
                "keys-expired",
                f"{what}: the keys document (version {self.keys.version}) expired at "
                f"{time_text(self.keys.expires)}: publish a new one (pubcomp fleet keys)",
            )
        signer = check_signature(
            env, self.keys.keys, what, f"a key of the keys document version {self.keys.version}"
        )
        doc = env["signed"]
        _expect_type(doc, RELEASE_TYPE, what)
        if set(doc) - _RELEASE_FIELDS:
            raise _refuse("malformed", f"{what}: unknown keys {sorted(set(doc) - _RELEASE_FIELDS)}")
        version = _int(doc, "version", what)
        what = f"release {version}"
        doc_fleet, doc_gw = _str(doc, "fleet", what), _str(doc, "gateway", what)
        if fleet is not None and doc_fleet != fleet:
            raise _refuse("wrong-fleet", f"{what}: for fleet {doc_fleet!r}, this is {fleet!r}")
        if doc_gw != gateway:
            raise _refuse("wrong-gateway", f"{what}: for gateway {doc_gw!r}, this is {gateway!r}")
        if newest is not None and version < newest:
            raise _refuse(
                "old-version",
                f"{what}: older than version {newest}, the newest applied or marked bad "
                "(a replay, or a rolled-back version: it comes back only as a new release)",
            )
        if newest is not None and version == newest:
            raise _refuse("same-version", f"{what}: already the newest applied or marked bad")
        created = parse_time(doc.get("created"), f"{what}: created")
        expires = parse_time(doc.get("expires"), f"{what}: expires")
        if expires <= now:
            raise _refuse("expired", f"{what}: expired at {time_text(expires)}")
        config = doc.get("config")
        if not isinstance(config, str):
            raise _refuse("malformed", f"{what}: config: expected the fleet file's text")
        digest = doc.get("config_sha256")
        if not isinstance(digest, str) or not _HEX64.match(digest):
            raise _refuse("malformed", f"{what}: config_sha256: expected 64 hex digits")
        if sha256_hex(config) != digest:
            raise _refuse("bad-sha256", f"{what}: the config does not hash to config_sha256")
        nodes = doc.get("nodes")
        if nodes is not None and not isinstance(nodes, dict):
            raise _refuse("malformed", f"{what}: nodes: expected a mapping")
        if validate is not None:
            problems = list(validate(config))
            if problems:
                shown = "; ".join(problems[:3]) + (
                    f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
                )
                raise _refuse("invalid-config", f"{what}: the config is not valid: {shown}")
        return Release(
            fleet=doc_fleet,
            gateway=doc_gw,
            version=version,
            created=created,
            expires=expires,
            config=config,
            config_sha256=digest,
            nodes=nodes,
            signed_by=signer,
            envelope=env,
        )


def read_release(payload: bytes | str | Mapping[str, Any]) -> Release:
    """A release's contents WITHOUT verifying its signature: for the operator's own tools
    (plan, rollout read back what they published); a gateway uses ``Trust.verify``."""
    env = decode(payload)
    doc = env["signed"]
    _expect_type(doc, RELEASE_TYPE, "release")
    return Release(
        fleet=_str(doc, "fleet", "release"),
        gateway=_str(doc, "gateway", "release"),
        version=_int(doc, "version", "release"),
        created=parse_time(doc.get("created"), "release: created"),
        expires=parse_time(doc.get("expires"), "release: expires"),
        config=str(doc.get("config", "")),
        config_sha256=str(doc.get("config_sha256", "")),
        nodes=doc.get("nodes"),
        signed_by=str(env["signatures"][0]["keyid"]),
        envelope=env,
    )


# ------------------------------------------------------------------ topics and chunks


def release_topic(prefix: str, gateway: str) -> str:
    return f"{prefix}/{gateway}/release"


def chunk_topic(prefix: str, gateway: str, i: int) -> str:
    return f"{prefix}/{gateway}/release/chunk/{i}"


def keys_topic(prefix: str) -> str:
    return f"{prefix}/release-keys"


def split(payload: bytes, limit: int = CHUNK_BYTES) -> tuple[bytes, list[bytes]]:
    """What goes on the release topic, and the chunks (none when it fits whole).

    A chunk is ``b"<sha256 of the whole> <index>\\n"`` and its slice of the bytes.
    Publish the chunks first and the manifest last, so a gateway that reads the new
    manifest finds the new chunks already retained.
    """
    if len(payload) <= limit:
        return payload, []
    digest = sha256_hex(payload)
    parts = [payload[i : i + limit] for i in range(0, len(payload), limit)]
    chunks = [f"{digest} {i}\n".encode("ascii") + p for i, p in enumerate(parts)]
    manifest = canonical({"chunks": len(parts), "sha256": digest, "size": len(payload)})
    return manifest, chunks


def is_manifest(payload: bytes) -> bool:
    # An envelope starts {"signatures" or {"signed"; a manifest {"chunks" (canonical).
    return payload.startswith(b'{"chunks":')


@dataclass
class Reassembly:
    """One gateway's release topic and its chunks, as they arrive (in any order).

    ``on_release`` and ``on_chunk`` take messages as they come; each returns the
    whole envelope's bytes once they are all there and verified, else None.
    ``ReleaseRefused("chunk", ...)`` for a manifest that is no manifest, a chunk
    in the wrong place, or a whole of the wrong size or hash; a chunk of another
    (older) manifest is stale and waits for its replacement (``stale`` counts them).
    """

    manifest: dict[str, Any] | None = None
    parts: dict[int, bytes] = field(default_factory=dict)
    stale: int = 0

    def on_release(self, payload: bytes) -> bytes | None:
        if not is_manifest(payload):
            self.manifest, self.parts = None, {}
            return payload
        try:
            m = json.loads(payload)
        except ValueError:
            raise _refuse("chunk", "release manifest: not JSON") from None
        n, digest, size = m.get("chunks"), m.get("sha256"), m.get("size")
        if (
            set(m) != {"chunks", "sha256", "size"}
            or not isinstance(n, int)
            or not 1 <= n <= MAX_RELEASE_BYTES // 1024
            or not isinstance(digest, str)
            or not _HEX64.match(digest)
            or not isinstance(size, int)
            or not 0 < size <= MAX_RELEASE_BYTES
        ):
            raise _refuse("chunk", "release manifest: expected {'chunks', 'sha256', 'size'}")
        if self.manifest != m:
            self.manifest = m
            self.parts = {i: p for i, p in self.parts.items() if i < n}
        return self._whole()

    def on_chunk(self, index: int, payload: bytes) -> bytes | None:
        head, nl, _body = payload.partition(b"\n")
        fields = head.split(b" ")
        if not nl or len(fields) != 2 or not fields[1].isdigit():
            raise _refuse("chunk", f"release chunk {index}: no '<sha256> <index>' line")
        digest, tagged = fields[0].decode("ascii", "replace"), int(fields[1])
        if tagged != index:
            raise _refuse(
                "chunk", f"release chunk {index}: holds chunk {tagged} (reordered or misfiled)"
            )
        self.parts[index] = payload  # kept whole: the manifest may come after it
        if self.manifest is not None and digest != self.manifest["sha256"]:
            self.stale += 1
            return None
        return self._whole()

    def _whole(self) -> bytes | None:
        m = self.manifest
        if m is None:
            return None
        tag = m["sha256"].encode("ascii")
        mine: list[bytes] = []
        for i in range(m["chunks"]):
            p = self.parts.get(i)
            if p is None or not p.startswith(tag + b" "):
                return None
            mine.append(p.partition(b"\n")[2])
        whole = b"".join(mine)
        self.manifest, self.parts = None, {}
        if len(whole) != m["size"]:
            raise _refuse(
                "chunk",
                f"release chunks: {len(whole)} bytes, the manifest says {m['size']} (truncated)",
            )
        if sha256_hex(whole) != m["sha256"]:
            raise _refuse(
                "chunk", "release chunks: the whole does not hash to the manifest's sha256"
            )
        return whole
