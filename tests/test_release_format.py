"""sync/release.py: signed releases and keys documents, and every bad input a gateway
must refuse (issue 28, part 6) at the format's level, each with its reason.

The gateway's apply tests the same inputs end to end; these pin the rules: each test
builds a valid release, breaks exactly one thing, and checks the reason named.
"""

from __future__ import annotations

import json
import random
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from pubcomp.sync import release as rel
from pubcomp.sync.errors import ReleaseRefused

NOW = datetime(2026, 12, 1, 12, 0, 0, tzinfo=UTC)
CONFIG = "fleet: coast\ngateways:\n  gw-1:\n    uplink: {broker: 'mqtt://cloud:1883'}\n"


class Keys:
    """A root key, a release key and the keys document (version 1) the root signed."""

    def __init__(self) -> None:
        self.root = rel.new_key()
        self.signer = rel.new_key()
        self.doc = rel.sign(
            rel.keys_document(1, [self.signer], NOW + timedelta(days=365)), [self.root]
        )

    def trust(self) -> rel.Trust:
        t = rel.Trust(self.root.public_key())
        assert t.accept_keys(rel.encode(self.doc), NOW)
        return t

    def release(self, **over: Any) -> dict[str, Any]:
        args: dict[str, Any] = {
            "fleet": "coast",
            "gateway": "gw-1",
            "version": 7,
            "config": CONFIG,
            "created": NOW,
            "expires": NOW + timedelta(days=30),
        }
        args.update(over)
        return rel.release_document(**args)


@pytest.fixture
def keys() -> Keys:
    return Keys()


def refused(reason: str, fn: Any, *args: Any, **kwargs: Any) -> str:
    with pytest.raises(ReleaseRefused) as exc:
        fn(*args, **kwargs)
    assert exc.value.reason == reason, str(exc.value)
    assert exc.value.reason in rel.REASONS
    return str(exc.value)


def verify(trust: rel.Trust, payload: Any, **over: Any) -> rel.Release:
    args: dict[str, Any] = {"fleet": "coast", "gateway": "gw-1", "newest": 6, "now": NOW}
    args.update(over)
    return trust.verify(payload, **args)


# ------------------------------------------------------------------ the good path


def test_a_signed_release_verifies_and_says_what_it_carries(keys: Keys) -> None:
    env = rel.sign(keys.release(), [keys.signer])
    got = verify(keys.trust(), rel.encode(env))
    assert (got.fleet, got.gateway, got.version, got.config) == ("coast", "gw-1", 7, CONFIG)
    assert got.config_sha256 == rel.sha256_hex(CONFIG)
    assert got.signed_by == rel.keyid(keys.signer)
    assert got.expires == NOW + timedelta(days=30)
    assert verify(keys.trust(), env, newest=None).version == 7  # a gateway with none yet


def test_canonical_form_is_sorted_compact_utf8_and_refuses_floats() -> None:
    assert rel.canonical({"b": 1, "a": "é"}) == '{"a":"é","b":1}'.encode()
    with pytest.raises(ValueError, match="floats"):
        rel.canonical({"a": 1.5})


def test_the_same_release_encodes_to_the_same_bytes(keys: Keys) -> None:
    # Ed25519 is deterministic and the encoding canonical: publishing a release again
    # (a retry) gives byte-identical retained messages.
    doc = keys.release()
    assert rel.encode(rel.sign(doc, [keys.signer])) == rel.encode(
        rel.sign(dict(reversed(list(doc.items()))), [keys.signer])
    )


def test_keyid_is_sha256_of_the_raw_public_key_and_pub_text_round_trips(keys: Keys) -> None:
    import hashlib

    raw = rel.public_raw(keys.root)
    assert rel.keyid(keys.root) == hashlib.sha256(raw).hexdigest()
    assert rel.public_raw(rel.load_public(rel.public_text(keys.root))) == raw
    assert rel.public_raw(rel.load_private(rel.private_pem(keys.root))) == raw
    with pytest.raises(ValueError, match="32 bytes"):
        rel.load_public("AAAA")


def test_spans() -> None:
    assert rel.parse_span("30d") == timedelta(days=30)
    assert rel.parse_span("12h") == timedelta(hours=12)
    for bad in ("0d", "30", "d", "3 days"):
        with pytest.raises(ValueError):
            rel.parse_span(bad)


# ------------------------------------------------------------------ bad releases


def test_unsigned_release_is_refused(keys: Keys) -> None:
    env = {"signed": keys.release(), "signatures": []}
    assert "no signature" in refused("unsigned", verify, keys.trust(), rel.encode(env))
    refused("unsigned", verify, keys.trust(), json.dumps({"signed": keys.release()}))


def test_release_signed_by_a_key_not_in_the_keys_document_is_refused(keys: Keys) -> None:
    stranger = rel.new_key()
    env = rel.sign(keys.release(), [stranger])
    refused("unknown-key", verify, keys.trust(), rel.encode(env))


def test_release_signed_by_the_root_itself_is_refused(keys: Keys) -> None:
    # The root signs keys documents only; a release needs a release key.
    refused("unknown-key", verify, keys.trust(), rel.sign(keys.release(), [keys.root]))


def test_altered_release_is_refused_bad_signature(keys: Keys) -> None:
    env = rel.sign(keys.release(), [keys.signer])
    env["signed"]["config"] = CONFIG.replace("cloud", "evil")
    env["signed"]["config_sha256"] = rel.sha256_hex(env["signed"]["config"])
    assert "does not verify" in refused("bad-signature", verify, keys.trust(), env)


def test_garbage_signature_bytes_are_refused_bad_signature(keys: Keys) -> None:
    env = rel.sign(keys.release(), [keys.signer])
    env["signatures"][0]["sig"] = "not base64!"
    refused("bad-signature", verify, keys.trust(), env)


def test_older_version_replayed_is_refused(keys: Keys) -> None:
    env = rel.sign(keys.release(version=5), [keys.signer])
    assert "older than version 6" in refused("old-version", verify, keys.trust(), env)


def test_the_version_already_held_is_same_version_not_news(keys: Keys) -> None:
    env = rel.sign(keys.release(version=6), [keys.signer])
    refused("same-version", verify, keys.trust(), env)


def test_release_for_another_gateway_is_refused(keys: Keys) -> None:
    env = rel.sign(keys.release(gateway="gw-2"), [keys.signer])
    assert "'gw-2'" in refused("wrong-gateway", verify, keys.trust(), env)


def test_release_for_another_fleet_is_refused(keys: Keys) -> None:
    env = rel.sign(keys.release(fleet="inland"), [keys.signer])
    refused("wrong-fleet", verify, keys.trust(), env)


def test_expired_release_is_refused(keys: Keys) -> None:
    env = rel.sign(keys.release(expires=NOW - timedelta(seconds=1)), [keys.signer])
    assert "expired at" in refused("expired", verify, keys.trust(), env)


def test_release_whose_config_does_not_hash_is_refused(keys: Keys) -> None:
    doc = keys.release()
    doc["config_sha256"] = rel.sha256_hex("something else")
    refused("bad-sha256", verify, keys.trust(), rel.sign(doc, [keys.signer]))


def test_release_that_fails_validation_is_refused_with_the_problems(keys: Keys) -> None:
    env = rel.sign(keys.release(), [keys.signer])

    def validate(text: str) -> list[str]:
        assert text == CONFIG
        return ["fleet.yaml:4: gateways.gw-1.uplink.broker: expected mqtt://host:port"]

    msg = refused("invalid-config", verify, keys.trust(), env, validate=validate)
    assert "uplink.broker" in msg
    assert verify(keys.trust(), env, validate=lambda t: []).version == 7


def test_release_before_any_keys_document_is_refused(keys: Keys) -> None:
    env = rel.sign(keys.release(), [keys.signer])
    refused("no-keys", verify, rel.Trust(keys.root.public_key()), env)


@pytest.mark.parametrize(
    "payload",
    [b"", b"not json", b"[]", b'{"signed": 1}', b'{"signed": {}, "signatures": [1]}'],
)
def test_malformed_envelopes_are_refused(keys: Keys, payload: bytes) -> None:
    with pytest.raises(ReleaseRefused) as exc:
        verify(keys.trust(), payload)
    assert exc.value.reason in ("malformed", "unsigned")


def test_signed_document_of_the_wrong_type_is_refused(keys: Keys) -> None:
    # A keys document signed by a release key is no release.
    env = rel.sign(rel.keys_document(9, [keys.signer], NOW + timedelta(days=1)), [keys.signer])
    refused("malformed", verify, keys.trust(), env)


def test_oversized_payload_is_refused_before_parsing(keys: Keys) -> None:
    refused("too-large", verify, keys.trust(), b" " * (rel.MAX_RELEASE_BYTES + 1))


# ------------------------------------------------------------------ keys documents


def test_keys_document_not_signed_by_the_root_is_refused(keys: Keys) -> None:
    forged = rel.sign(rel.keys_document(2, [rel.new_key()], NOW + timedelta(days=1)), [keys.signer])
    t = keys.trust()
    assert "none of them the root key" in refused("keys-not-root", t.accept_keys, forged, NOW)
    assert t.keys is not None and t.keys.version == 1  # the one held stays


def test_unsigned_keys_document_is_refused(keys: Keys) -> None:
    doc = {"signed": rel.keys_document(2, [keys.signer], NOW + timedelta(days=1))}
    refused("unsigned", keys.trust().accept_keys, json.dumps(doc), NOW)


def test_rotation_retires_the_old_release_key(keys: Keys) -> None:
    t = keys.trust()
    new = rel.new_key()
    v2 = rel.sign(rel.keys_document(2, [new], NOW + timedelta(days=365)), [keys.root])
    assert t.accept_keys(rel.encode(v2), NOW)
    refused("unknown-key", verify, t, rel.sign(keys.release(), [keys.signer]))
    assert verify(t, rel.sign(keys.release(), [new])).signed_by == rel.keyid(new)


def test_older_keys_document_replayed_is_refused_and_the_same_one_is_no_change(
    keys: Keys,
) -> None:
    t = keys.trust()
    v2 = rel.sign(rel.keys_document(2, [rel.new_key()], NOW + timedelta(days=365)), [keys.root])
    assert t.accept_keys(v2, NOW)
    assert t.accept_keys(v2, NOW) is False  # the retained one again at a reconnection
    refused("keys-old-version", t.accept_keys, keys.doc, NOW)
    other = rel.sign(rel.keys_document(2, [rel.new_key()], NOW + timedelta(days=365)), [keys.root])
    refused("keys-old-version", t.accept_keys, other, NOW)


def test_expired_keys_document_is_refused_and_an_expired_held_one_refuses_releases(
    keys: Keys,
) -> None:
    old = rel.sign(rel.keys_document(1, [keys.signer], NOW - timedelta(days=1)), [keys.root])
    refused("keys-expired", rel.Trust(keys.root.public_key()).accept_keys, old, NOW)
    # What a gateway stored itself is taken at start even when expired (it is still the
    # newest it knows, for rollback protection), and then no release is taken.
    t = rel.Trust(keys.root.public_key())
    assert t.accept_keys(old, NOW, stored=True)
    refused("keys-expired", verify, t, rel.sign(keys.release(), [keys.signer]))


def test_keys_document_with_a_keyid_that_is_not_its_key_is_refused(keys: Keys) -> None:
    doc = rel.keys_document(2, [keys.signer], NOW + timedelta(days=1))
    doc["keys"][0]["keyid"] = rel.keyid(rel.new_key())
    refused("malformed", keys.trust().accept_keys, rel.sign(doc, [keys.root]), NOW)


# ------------------------------------------------------------------ chunks


def _big(keys: Keys) -> bytes:
    filler = "".join(f"# padding line {i:06d} to make a large fleet file\n" for i in range(4000))
    return rel.encode(rel.sign(keys.release(config=CONFIG + filler), [keys.signer]))


def test_small_release_goes_whole_large_one_in_chunks_in_any_order(keys: Keys) -> None:
    small = rel.encode(rel.sign(keys.release(), [keys.signer]))
    assert rel.split(small) == (small, [])
    assert rel.Reassembly().on_release(small) == small
    big = _big(keys)
    assert len(big) > 2 * rel.CHUNK_BYTES
    manifest, chunks = rel.split(big)
    assert json.loads(manifest) == {
        "chunks": len(chunks),
        "sha256": rel.sha256_hex(big),
        "size": len(big),
    }
    order = list(range(len(chunks)))
    random.Random(1).shuffle(order)
    r = rel.Reassembly()
    got = [r.on_chunk(i, chunks[i]) for i in order[:-1]]
    assert got == [None] * (len(chunks) - 1)
    assert r.on_release(manifest) is None
    assert r.on_chunk(order[-1], chunks[order[-1]]) == big
    assert verify(keys.trust(), big).version == 7


def test_truncated_chunk_is_refused(keys: Keys) -> None:
    manifest, chunks = rel.split(_big(keys))
    r = rel.Reassembly()
    r.on_release(manifest)
    for i, c in enumerate(chunks[:-1]):
        r.on_chunk(i, c)
    last = len(chunks) - 1
    assert "truncated" in refused("chunk", r.on_chunk, last, chunks[last][:-100])


def test_reordered_chunk_is_refused(keys: Keys) -> None:
    manifest, chunks = rel.split(_big(keys))
    r = rel.Reassembly()
    r.on_release(manifest)
    assert "reordered" in refused("chunk", r.on_chunk, 0, chunks[1])


def test_chunks_swapped_with_their_tags_rewritten_fail_the_hash(keys: Keys) -> None:
    manifest, chunks = rel.split(_big(keys))
    digest = rel.sha256_hex(_big(keys))
    swapped = [
        f"{digest} 0\n".encode() + chunks[1].partition(b"\n")[2],
        f"{digest} 1\n".encode() + chunks[0].partition(b"\n")[2],
        *chunks[2:],
    ]
    r = rel.Reassembly()
    r.on_release(manifest)
    for i, c in enumerate(swapped[:-1]):
        r.on_chunk(i, c)
    msg = refused("chunk", r.on_chunk, len(swapped) - 1, swapped[-1])
    assert "does not hash" in msg


def test_a_chunk_of_an_older_release_is_stale_and_waits_for_its_replacement(keys: Keys) -> None:
    old_manifest, old = rel.split(_big(keys))
    new_big = rel.encode(
        rel.sign(rel.read_release(_big(keys)).envelope["signed"] | {"version": 8}, [keys.signer])
    )
    manifest, new = rel.split(new_big)
    r = rel.Reassembly()
    assert r.on_release(manifest) is None
    for i in range(len(new)):
        assert r.on_chunk(i, old[i]) is None  # retained chunks of the old one, first
    assert r.stale == len(new)
    got = [r.on_chunk(i, new[i]) for i in range(len(new))]
    assert got[-1] == new_big
    assert old_manifest != manifest


def test_manifest_that_is_no_manifest_is_refused() -> None:
    refused("chunk", rel.Reassembly().on_release, b'{"chunks":"x"}')
    refused("chunk", rel.Reassembly().on_release, b'{"chunks":2,"sha256":"ab","size":9}')


@given(st.binary(min_size=1, max_size=3000), st.integers(min_value=16, max_value=700))
def test_split_and_reassemble_round_trip(payload: bytes, limit: int) -> None:
    assume(not rel.is_manifest(payload))  # an envelope starts {"signatures":
    manifest, chunks = rel.split(payload, limit)
    r = rel.Reassembly()
    if not chunks:
        assert r.on_release(manifest) == payload
        return
    out = None
    for i in reversed(range(len(chunks))):
        out = r.on_chunk(i, chunks[i])
    assert out is None
    assert r.on_release(manifest) == payload
