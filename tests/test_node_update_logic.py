"""Node software updates, the pure logic on both sides: offers made by the gateway's code
(gateway/nodesets.py, nodeoffer.py: CPython's hmac) checked by the node's code under the
real MicroPython interpreter (WebAssembly port: tests/firmware/update_check.py), and the
gateway's sets and offers on disk."""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

from pubcomp.gateway.nodeoffer import chunk_message, manifest_message, parse_offer
from pubcomp.gateway.nodesets import (
    SetFile,
    SoftwareSet,
    UpdateError,
    compile_dir,
    load_set,
    make_offer,
    save_set,
    update_key,
)
from pubcomp.gateway.nodeupdate import outcome, parse_waves

ROOT = Path(__file__).resolve().parent.parent
WASM = ROOT / "tests" / "firmware"
CHECKS = [
    "key",
    "full_update",
    "resume_after_reboot",
    "bad_offers",
    "bad_chunks",
    "file_sha_mismatch",
    "withdrawn_and_replaced",
    "pointer_switch",
]
NODE, PASSWORD = "node-a", "correct-horse-battery-staple-0123"
CHUNK = 256
RAM_SIZES = (256, 512, 1024, 2048, 4096)


def _files(seed: bytes, big: int) -> list[SetFile]:
    return [
        SetFile("pubnode/__init__.py", b"VERSION = '" + seed + b"'\n"),
        SetFile("pubnode/big.mpy", hashlib.sha256(seed).digest() * (big // 32)),
        SetFile("pubnode/sensors/__init__.py", b""),
        SetFile("pubnode/sensors/adc.mpy", bytes(range(256)) * 3 + seed),
    ]


def _vector(key: bytes, node: str, s: SoftwareSet, chunk: int, **tamper: Any) -> dict[str, Any]:
    offer = make_offer(key, node, s, chunk)
    if "sha_of" in tamper:  # a manifest whose hash for one file is wrong, its chunk MACs right
        m = json.loads(offer["manifest"])
        m["files"][tamper["sha_of"]][2] = "0" * 64
        body = json.dumps(m, separators=(",", ":")).encode()
        offer["manifest"] = body.decode()
        offer["mac"] = hmac.new(key, b"pubcomp manifest v1\x00" + body, hashlib.sha256).hexdigest()
    parsed = parse_offer(json.dumps(offer).encode(), node)
    chunks = {
        (i, off): chunk_message(parsed, s, i, off)
        for i, f in enumerate(s.files)
        for off in range(0, len(f.data), chunk)
    }
    return {"manifest": manifest_message(parsed), "chunks": chunks}


def write_vectors(path: Path) -> None:
    key = update_key(PASSWORD, NODE)
    v1 = SoftwareSet(1, "test v1", "mpy", tuple(_files(b"one", 700)))
    v2 = SoftwareSet(2, "test v2", "mpy", tuple(_files(b"two", 900)))
    other = update_key("another password", "node-b")
    escaping = SoftwareSet(1, "x", "mpy", (SetFile("../boot.py", b"x"),))
    ram: dict[int, Any] = {}
    for size in RAM_SIZES:
        s = SoftwareSet(1, "ram", "mpy", (SetFile("pubnode/big.mpy", b"\x5a" * (size * 5)),))
        ram[size] = _vector(key, NODE, s, size)
    values = {
        "NODE": NODE,
        "PASSWORD": PASSWORD,
        "KEY": key,
        "CHUNK": CHUNK,
        "LONG_KEY_MAC": hmac.new(b"k" * 100, b"abc", hashlib.sha256).digest(),
        "FILES1": [(f.path, f.data) for f in v1.files],
        "V1": _vector(key, NODE, v1, CHUNK),
        "V2": _vector(key, NODE, v2, CHUNK),
        "BAD_MAC": _vector(update_key("not the password", NODE), NODE, v1, CHUNK)["manifest"],
        "OTHER_NODE": _vector(other, "node-b", v1, CHUNK)["manifest"],
        "NOT_JSON": b"M " + b"0" * 64 + b"\n{not json",
        "ESCAPING": _vector(key, NODE, escaping, CHUNK)["manifest"],
        "SHA_BAD": _vector(key, NODE, v1, CHUNK, sha_of=1),
        "RAM_SIZES": RAM_SIZES,
        "RAM": ram,
    }
    path.write_text("".join(f"{k} = {v!r}\n" for k, v in values.items()))


def test_node_update_logic_under_micropython(tmp_path: Path) -> None:
    vectors = tmp_path / "update_vectors.py"
    write_vectors(vectors)
    done = subprocess.run(
        [
            "node",
            str(WASM / "run_mpy.mjs"),
            str(ROOT / "firmware" / "lib"),
            str(WASM / "update_check.py"),
            str(ROOT / "firmware" / "pubboot.py"),
            str(vectors),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=WASM,
    )
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    assert re.findall(r"^PASS (\w+)$", out, re.M) == CHECKS, out
    assert out.rstrip().endswith("DONE"), out
    per_chunk = {
        int(size): (int(ram), int(msg))
        for size, ram, msg in re.findall(r"^MEASURE ram_bytes_chunk_(\d+) (\d+) (\d+)$", out, re.M)
    }
    assert sorted(per_chunk) == list(RAM_SIZES), out
    for size, (ram, msg) in per_chunk.items():
        assert msg >= size and ram >= msg, (size, ram, msg)  # at least the message itself
        assert ram < size + 3072, (size, ram)  # and a bounded overhead on top of it
    held = int(re.search(r"^MEASURE ram_bytes_updater_held (\d+)$", out, re.M)[1])  # type: ignore[index]
    assert 0 < held < 8192, held
    print(out)


def test_sets_get_versions_once_and_are_checked_on_load(tmp_path: Path) -> None:
    root = tmp_path / "node-updates"
    files = _files(b"one", 100)
    s1 = save_set(root, files, "a", "mpy")
    assert s1.version == 1 and load_set(root, 1) == s1
    assert save_set(root, files, "a again", "mpy").version == 1  # the same files: the same set
    s2 = save_set(root, _files(b"two", 100), "b", "mpy")
    assert s2.version == 2
    # Versions are never given twice, even when a set is deleted.
    for p in sorted((root / "sets" / "2").rglob("*"), reverse=True):
        p.unlink() if p.is_file() else p.rmdir()
    (root / "sets" / "2").rmdir()
    assert save_set(root, _files(b"three", 100), "c", "mpy").version == 3
    # A damaged disk is not served.
    (root / "sets" / "1" / "files" / "pubnode" / "big.mpy").write_bytes(b"rot")
    with pytest.raises(UpdateError, match=r"set 1: pubnode/big.mpy: does not match set.json"):
        load_set(root, 1)
    with pytest.raises(UpdateError, match=r"not a file name a node takes"):
        save_set(root, [SetFile("../x.py", b"")], "bad", "py")


def test_the_firmware_library_compiles_into_a_set() -> None:
    files = compile_dir(ROOT / "firmware" / "lib", "mpy")
    paths = {f.path for f in files}
    assert "pubnode/update.mpy" in paths and "pubnode/app.mpy" in paths
    assert all(f.data[:1] == b"M" for f in files)  # mpy-cross's header
    assert len(files) == len(list((ROOT / "firmware" / "lib").rglob("*.py")))


def test_waves_and_outcomes() -> None:
    assert parse_waves("1,100%", 10) == [1, 9]
    assert parse_waves("1,25%,100%", 10) == [1, 2, 7]
    assert parse_waves("2", 5) == [2, 3]  # the rest always goes last
    assert parse_waves("1,100%", 1) == [1]
    with pytest.raises(UpdateError, match="cumulative"):
        parse_waves("5,2", 10)
    with pytest.raises(UpdateError, match="not a count or a share"):
        parse_waves("one", 10)
    base = {"version": 0, "state": "running", "bad": 0, "last": None, "offer": 3, "total": 10}
    assert outcome(None, 3) == (None, "no word from it yet")
    assert outcome({**base, "version": 3}, 3)[0] == "done"
    assert outcome({**base, "version": 3, "state": "trial"}, 3)[0] is None
    assert outcome({**base, "bad": 3}, 3)[0] == "rolled_back"
    assert outcome({**base, "last": [3, "refused", "why"]}, 3) == ("refused", "why")
    assert outcome({**base, "last": [2, "refused", "older"]}, 3)[0] is None  # another offer
    assert outcome({**base, "image": 3, "image_bad": 0}, 3, "image")[0] == "done"
