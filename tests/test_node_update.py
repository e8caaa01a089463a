"""Node software through the gateway, with real processes: `pubcomp gateway run`, nodes on
the firmware's host port (firmware/host/run_node.py) that restart after machine.reset() as
a board does, and `pubcomp node update` itself. The sets offered are the firmware's own
library as source (--format py: the host port runs CPython), marked so the test can tell
which set a node runs."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from devkit.broker import Mosquitto
from devkit.gateway_helpers import GatewayProc
from devkit.link import LinkProxy
from devkit.node_helpers import Board, node_config, wait_until
from devkit.nodeproxy import RewritingProxy
from pubcomp.gateway.nodeoffer import parse_offer
from pubcomp.gateway.nodesets import (
    compile_dir,
    key_file,
    mac,
    make_offer,
    offer_path,
    save_set,
    update_key,
    write_key,
    write_offer,
)
from pubcomp.sync.exitcodes import EXIT_ROLLOUT_HALTED
from tests.hostile_helpers import Siege, connect_packet, raw_socket, read_connack

ROOT = Path(__file__).resolve().parent.parent
LIB = ROOT / "firmware" / "lib"
UPDATE = {"check_s": 0.5, "trial_s": 4}


def pubcomp(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pubcomp.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def make_lib(tmp: Path, marker: str, edit: dict[str, tuple[str, str]] | None = None) -> Path:
    """A copy of firmware/lib that prints ``set marker: <marker>`` when imported."""
    lib = tmp / f"lib-{marker}"
    shutil.copytree(LIB, lib, ignore=shutil.ignore_patterns("__pycache__"))
    init = lib / "pubnode" / "__init__.py"
    init.write_text(init.read_text() + f'print("set marker: {marker}")\n')
    for rel, (old, new) in (edit or {}).items():
        p = lib / rel
        text = p.read_text()
        assert old in text, (rel, old)
        p.write_text(text.replace(old, new))
    return lib


class Site:
    """A gateway, its fleet file with each node's update key, and boards."""

    def __init__(self, tmp: Path, broker: Mosquitto, nodes: list[str], **extra: Any) -> None:
        self.tmp = tmp
        self.passwords = {n: f"pw-{n}-0123456789abcdef" for n in nodes}
        self.gw = GatewayProc(tmp, broker.port, nodes=self.passwords, extra=extra)
        for n, pw in self.passwords.items():
            write_key(key_file(self.gw.fleet, self.gw.gid, n), update_key(pw, n))
        self.gw.start()
        self.boards: dict[str, Board] = {}
        self.state = self.gw.db.parent / "node-updates"

    def board(self, node: str, port: int | None = None, **over: Any) -> Board:
        cfg = node_config(
            node, self.passwords[node], port or self.gw.ingress_port,
            **{"interval_s": 0.3, "update": UPDATE, **over},
        )  # fmt: skip
        b = self.boards[node] = Board(self.tmp / f"flash-{node}", cfg)
        return b

    def software(self, node: str) -> dict[str, Any]:
        return self.gw.status()["nodes"][node].get("software") or {}

    def update(self, *args: str) -> subprocess.CompletedProcess[str]:
        return pubcomp(
            "node", "update", "--config", str(self.gw.fleet), "--gateway", self.gw.gid, *args
        )

    def close(self) -> None:
        for b in self.boards.values():
            b.stop()
        self.gw.kill()


@pytest.fixture
def site_factory(tmp_path: Path, mosquitto: Mosquitto) -> Iterator[Any]:
    sites: list[Site] = []

    def make(nodes: list[str], **extra: Any) -> Site:
        s = Site(tmp_path, mosquitto, nodes, **extra)
        sites.append(s)
        return s

    yield make
    for s in sites:
        s.close()


def runs(board: Board) -> str | None:
    """The committed set's version on the board's flash (None: the factory set)."""
    p = board.flash / "sets" / "current"
    return p.read_text() if p.exists() else None


def same_files(flash_set: Path, lib: Path) -> bool:
    for src in lib.rglob("*.py"):
        rel = src.relative_to(lib)
        if (flash_set / rel).read_bytes() != src.read_bytes():
            return False
    return True


def test_an_update_completes_in_waves_and_the_gateway_shows_the_version(site_factory: Any) -> None:
    site = site_factory(["node-a", "node-b"])
    a, b = site.board("node-a").run(), site.board("node-b").run()
    assert wait_until(lambda: site.software("node-a") and site.software("node-b"), 30)
    assert site.software("node-a")["version"] == 0  # the factory set, said on connect
    lib = make_lib(site.tmp, "two")
    done = site.update("--all", "--files", str(lib), "--format", "py", "--timeout", "60")
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    assert "wave 1/2: version 1 offered to node-a" in out, out
    assert "wave 2/2: version 1 offered to node-b" in out, out
    assert re.search(r"^node-a\s+done\s+1\s+runs version 1$", out, re.M), out
    assert re.search(r"^node-b\s+done\s+1\s+runs version 1$", out, re.M), out
    for board in (a, b):
        assert runs(board) == "1"
        assert same_files(board.flash / "sets" / "1", lib)
        assert "set marker: two" in board.output()
        assert "update: version 1 committed" in board.output()
        assert not (board.flash / "upd").exists()
        assert "WDT:" not in board.output()  # the watchdog was fed all along
        assert board.exits == [76]  # one reset: the update's own, into the new set
    status = pubcomp("status", "--config", str(site.gw.fleet), "--gateway", site.gw.gid)
    assert re.search(r"^node-a\s.*\s1$", status.stdout, re.M), status.stdout
    assert "software" in status.stdout.splitlines()[-3], status.stdout
    # The same files again: the same set, and nothing to do.
    again = site.update("--node", "node-a", "--files", str(lib), "--format", "py")
    assert again.returncode == 0 and "set 1:" in again.stdout, again.stdout + again.stderr
    print(out)


def test_an_update_interrupted_by_a_reboot_resumes(site_factory: Any) -> None:
    site = site_factory(["node-r"])
    board = site.board("node-r").run()
    assert wait_until(lambda: site.software("node-r"), 30)
    lib = make_lib(site.tmp, "resumed")
    cli = subprocess.Popen(
        [sys.executable, "-m", "pubcomp.cli", "node", "update", "--config", str(site.gw.fleet),
         "--gateway", site.gw.gid, "--node", "node-r", "--files", str(lib), "--format", "py",
         "--chunk", "128", "--timeout", "90"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:

        def share() -> float:
            sw = site.software("node-r")
            return sw.get("served", 0) / sw["total"] if sw.get("total") else 0.0

        assert wait_until(lambda: share() > 0.3, 60), site.software("node-r")
        cut_at = share()
        board.power_cut()  # mid-download; the board comes back up
        out, _ = cli.communicate(timeout=120)
    finally:
        if cli.poll() is None:
            cli.kill()
    assert cli.returncode == 0, out
    assert re.search(r"^node-r\s+done\s+1\s+runs version 1$", out, re.M), out
    log = board.output()
    m = re.search(r"update: resuming version 1 at (\S+), byte (\d+)", log)
    assert m, log[-3000:]
    files = sorted(p.relative_to(lib).as_posix() for p in lib.rglob("*.py"))
    resumed_at = sum((lib / f).stat().st_size for f in files[: files.index(m[1])]) + int(m[2])
    total = sum((lib / f).stat().st_size for f in files)
    # It went on from where the cut found it (a chunk or so back), not from the start.
    assert resumed_at >= cut_at * total - 2 * 128, (resumed_at, cut_at * total)
    assert log.count("update: taking version 1") == 1, log[-3000:]
    assert runs(board) == "1" and same_files(board.flash / "sets" / "1", lib)


def test_a_set_that_cannot_deliver_is_rolled_back_by_boot(site_factory: Any) -> None:
    site = site_factory(["node-x"])
    board = site.board("node-x").run()
    assert wait_until(lambda: site.software("node-x"), 30)
    # A set whose link goes to the wrong port: it boots, but never connects.
    broken = make_lib(
        site.tmp,
        "broken",
        {
            "pubnode/link.py": (
                "self.host, self.port = host, port",
                "self.host, self.port = host, 9",
            )
        },
    )
    done = site.update("--node", "node-x", "--files", str(broken), "--format", "py",
                       "--timeout", "60")  # fmt: skip
    assert done.returncode == EXIT_ROLLOUT_HALTED, done.stdout + done.stderr  # halted
    assert "nothing to revert: no node runs version 1" in done.stdout, done.stdout
    assert re.search(r"^node-x\s+rolled_back\s+0\s+version 1 did not commit", done.stdout, re.M), (
        done.stdout
    )
    log = board.output()
    assert "set marker: broken" in log  # it was tried
    assert "update: version 1 delivered no reading in 4 s" in log, log[-3000:]
    assert "pubboot: set 1 did not commit on its try: rolled back to 0" in log, log[-3000:]
    sets = board.flash / "sets"
    assert (sets / "bad").read_text() == "1" and not (sets / "1").exists()
    assert not (sets / "pending").exists() and not (sets / "trial").exists()
    # Back on the factory set it delivers again, and version 1 is not taken a second time.
    before = site.gw.status()["nodes"]["node-x"]["messages"]
    assert wait_until(lambda: site.gw.status()["nodes"]["node-x"]["messages"] > before + 5, 30)
    sw = site.software("node-x")
    assert sw["version"] == 0 and sw["bad"] == 1, sw
    assert log.count("set marker: broken") == 1


def _crafted_sha_offer(key: bytes, node: str, s: Any) -> dict[str, Any]:
    """An offer whose manifest (properly signed) names a wrong SHA-256 for one file."""
    offer = make_offer(key, node, s, 1024)
    m = json.loads(offer["manifest"])
    m["files"][0][2] = "f" * 64
    body = json.dumps(m, separators=(",", ":")).encode()
    offer["manifest"], offer["mac"] = (
        body.decode(),
        mac(key, b"pubcomp manifest v1\x00", body).hex(),
    )
    parse_offer(json.dumps(offer).encode(), node)  # the gateway will serve it
    return offer


def test_bad_offers_are_refused_counted_and_nothing_applied(site_factory: Any) -> None:
    nodes = ["node-mac", "node-other", "node-old", "node-sha"]
    site = site_factory(nodes)
    old = site.board("node-old")
    # node-old runs version 5 (from another gateway, say): version 1 would be a step back.
    shutil.copytree(LIB, old.flash / "sets" / "5", ignore=shutil.ignore_patterns("__pycache__"))
    (old.flash / "sets" / "current").write_text("5")
    boards = [site.board(n) for n in nodes if n != "node-old"] + [old]
    for b in boards:
        b.run()
    assert wait_until(lambda: all(site.software(n) for n in nodes), 30)
    assert site.software("node-old")["version"] == 5
    lib = make_lib(site.tmp, "bad-inputs")
    s = save_set(site.state, compile_dir(lib, "py"), "bad inputs", "py")
    keys = {n: update_key(pw, n) for n, pw in site.passwords.items()}
    write_offer(site.state, "node-mac", make_offer(update_key("a stale password", "node-mac"),
                                                    "node-mac", s))  # fmt: skip
    other = make_offer(keys["node-mac"], "node-mac", s)  # node-mac's offer in node-other's place
    offer_path(site.state, "node-other").parent.mkdir(parents=True, exist_ok=True)
    offer_path(site.state, "node-other").write_text(json.dumps(other))
    write_offer(site.state, "node-old", make_offer(keys["node-old"], "node-old", s))
    write_offer(site.state, "node-sha", _crafted_sha_offer(keys["node-sha"], "node-sha", s))
    expect = {
        "node-mac": ("bad_mac", "its HMAC does not verify under this node's key"),
        "node-other": ("other_node", "is for node node-mac, not this node (node-other)"),
        "node-old": ("not_newer", "not newer than the running version 5"),
        "node-sha": ("file_sha", "does not match the manifest's"),
    }

    def settled(n: str) -> bool:
        last = site.software(n).get("last")
        return bool(last) and last[1] in ("refused", "failed")

    assert wait_until(lambda: all(settled(n) for n in nodes), 60), {
        n: site.software(n) for n in nodes
    }
    for b in boards:
        n = b.node
        sw = site.software(n)
        reason, text = expect[n]
        assert sw["refused"].get(reason, 0) >= 1, (n, sw)
        assert text in b.output(), (n, b.output()[-2000:])
        assert sw["version"] == (5 if n == "node-old" else 0), (n, sw)
        assert not (b.flash / "sets" / "1").exists() and not (b.flash / "upd").exists(), n
        assert "set marker: bad-inputs" not in b.output(), n
    assert site.software("node-sha")["refused"]["file_sha"] == 3  # three tries, then given up
    assert site.software("node-sha")["last"][1] == "failed"
    # Refused once, then not offered again (no refusal loop at each check): three more
    # hellos (each would have been answered with the offer again) and still one refusal.
    hellos = {site.software("node-mac")["seen"]}
    while len(hellos) <= 3:
        assert wait_until(lambda: site.software("node-mac")["seen"] not in hellos, 30)
        hellos.add(site.software("node-mac")["seen"])
    assert site.software("node-mac")["refused"]["bad_mac"] == 1


def test_tampered_chunks_are_refused_and_the_update_still_completes(site_factory: Any) -> None:
    site = site_factory(["node-t"])
    seen = {"chunks": 0, "requests": 0}
    tampered: list[str] = []

    def rewrite(way: str, topic: str, payload: bytes) -> bytes:
        if way == "down" and topic == "nodes/node-t/update" and payload[:2] == b"C ":
            seen["chunks"] += 1
            if seen["chunks"] == 3:
                tampered.append("truncated")
                return payload[:-9]
            if seen["chunks"] == 9:
                tampered.append("forged")
                return payload[:-1] + bytes([payload[-1] ^ 0x20])
        if way == "up" and topic == "nodes/node-t/update/req" and payload[:2] == b"G ":
            seen["requests"] += 1
            if seen["requests"] == 6:  # ask the gateway for the next chunk instead
                tampered.append("reordered")
                v, i, off = payload[2:].split()
                return b"G %s %s %d" % (v, i, int(off) + 256)
        return payload

    proxy = RewritingProxy(site.gw.ingress_port, rewrite)
    try:
        board = site.board("node-t", port=proxy.port).run()
        assert wait_until(lambda: site.software("node-t"), 30)
        lib = make_lib(site.tmp, "through-a-tamperer")
        done = site.update("--node", "node-t", "--files", str(lib), "--format", "py",
                           "--chunk", "256", "--timeout", "60")  # fmt: skip
    finally:
        proxy.close()
    assert done.returncode == 0, done.stdout + done.stderr
    assert tampered == ["truncated", "reordered", "forged"], tampered
    refused = site.software("node-t")["refused"]
    assert refused.get("chunk_truncated") == 1, refused
    assert refused.get("chunk_order") == 1, refused
    assert refused.get("chunk_mac") == 1, refused
    log = board.output()
    assert "(truncated)" in log and "out of order" in log and "MAC does not verify" in log
    assert runs(board) == "1" and same_files(board.flash / "sets" / "1", lib)


def test_a_battery_node_takes_an_update_a_few_chunks_a_wake(site_factory: Any) -> None:
    """Deep sleep: each wake sends what is owed, then spends the rest of its window
    (gateway.timeout_s) on chunks; the download goes on across wakes from flash, and the
    trial wake commits the set once its reading is acknowledged."""
    site = site_factory(["node-s"])
    board = site.board(
        "node-s",
        deep_sleep=True,
        interval_s=0.2,
        spill={"mode": "overflow"},
        gateway={"timeout_s": 1},
    ).run()
    assert wait_until(lambda: site.software("node-s"), 30)
    lib = make_lib(site.tmp, "asleep")
    done = site.update("--node", "node-s", "--files", str(lib), "--format", "py",
                       "--chunk", "512", "--timeout", "90")  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    log = board.output()
    assert log.count("update: resuming version 1") >= 1, log[-3000:]  # over more than one wake
    assert "update: version 1 committed" in log and runs(board) == "1"
    assert same_files(board.flash / "sets" / "1", lib)


def _greedy(port: int, node: str, password: str, version: int, until: float, sent: list[int]):
    """A node that asks for chunk after chunk and reads none of them."""
    body = b"\x00\x01" + _s(f"nodes/{node}/update".encode()) + b"\x00"
    subscribe = b"\x82" + bytes([len(body)]) + body
    ask = _qos0(f"nodes/{node}/update/req", f"G {version} 0 0".encode())
    while time.monotonic() < until:
        s = raw_socket(port, "127.0.0.3", rcvbuf=4096)
        try:
            s.sendall(connect_packet(node.encode(), password.encode(), node.encode()))
            if read_connack(s) != 0:
                return
            s.sendall(subscribe)
            s.settimeout(0.5)
            while time.monotonic() < until:
                s.sendall(ask * 64)  # blocks (times out) once the gateway stops reading
                sent[0] += 64
        except OSError:  # closed, or not read: log in again
            pass
        finally:
            s.close()


def _s(b: bytes) -> bytes:
    return len(b).to_bytes(2, "big") + b


def _qos0(topic: str, payload: bytes) -> bytes:
    body = _s(topic.encode()) + payload
    return b"\x30" + bytes([len(body)]) + body


def test_a_node_that_asks_for_chunks_and_reads_none_costs_only_itself(
    tmp_path: Path, mosquitto: Mosquitto
) -> None:
    """Issue 25's limits hold for the offer: the requests go at the node's message rate and
    their answers wait among its unanswered packets (a peer that reads none of them is
    closed once WRITE_HIGH waits for write_timeout_s: with the kernel's buffers, after
    more than this test's 4 s); good nodes keep their PUBACKs under a second."""
    password = "pw-greedy-0123456789"
    siege = Siege(tmp_path, mosquitto, nodes={"greedy": password})
    state = siege.gw.db.parent / "node-updates"
    s = save_set(state, compile_dir(LIB, "mpy"), "firmware", "mpy")
    write_offer(state, "greedy", make_offer(update_key(password, "greedy"), "greedy", s))
    sent = [0]
    with siege.watch():
        until = time.monotonic() + 4.0
        t = threading.Thread(
            target=_greedy, args=(siege.gw.ingress_port, "greedy", password, s.version, until, sent)
        )
        t.start()
        t.join(40)
    metrics = siege.metrics()
    paced = siege.gw.status()["nodes"]["greedy"]["software"]["paced"]
    figures = siege.finish(rss_mb=30, fds=40, log_kb=16)
    stalled = metrics[("pubcomp_ingress_closed_connections_total", (("reason", "write_stalled"),))]
    print(f"greedy: {sent[0]:,} requests offered, {paced} paced; write_stalled {stalled}")
    assert sent[0] > 64 * 10, sent  # it asked for far more than it was given
    # Paced at its message rate (50 a second): the rest waited in its own connection.
    assert 50 < paced < 50 * 6, paced
    assert figures["worst_puback_s"] < 1.0


def _image(tmp: Path, name: str, size: int, magic: int = 0xE9) -> Path:
    """A stand-in MicroPython app image: the magic byte, then bytes that differ per image."""
    body = hashlib.sha256(name.encode()).digest() * (size // 32)
    p = tmp / f"{name}.bin"
    p.write_bytes(bytes([magic]) + body[1:])
    return p


def _otadata(board: Board) -> dict[str, Any]:
    return json.loads((Path(board.env["PUBCOMP_ESP32_DIR"]) / "otadata.json").read_text())


def test_an_esp32_takes_a_whole_image_and_one_that_cannot_deliver_is_rolled_back(
    site_factory: Any,
) -> None:
    """The ESP32 path through the esp32.Partition stand-in: the image goes to the next OTA
    partition, boots once pending verification, and is marked valid only once a reading
    is acknowledged; an image whose trial delivers nothing (its link is down) is rolled
    back by the bootloader at the next boot. A board without OTA partitions refuses."""
    site = site_factory(["node-e", "node-p"])
    link = LinkProxy(site.gw.ingress_port)
    esp = site.board("node-e", port=link.port)
    parts = esp.esp32()
    pico = site.board("node-p")  # no esp32 module: a Pico W
    try:
        for b in (esp, pico):
            b.run()
        assert wait_until(lambda: site.software("node-e") and site.software("node-p"), 30)
        good = _image(site.tmp, "fw-good", 200_000)
        done = site.update("--node", "node-e", "--node", "node-p", "--waves", "1",
                           "--format", "image", "--files", str(good), "--timeout", "60",
                           "--max-failures", "1")  # fmt: skip
        out = done.stdout
        assert re.search(r"^node-e\s+done\s+1\s+runs image 1$", out, re.M), out + done.stderr
        assert re.search(r"^node-p\s+refused\s+0\s+offer of image 1: this board has no OTA",
                         out, re.M), out  # fmt: skip
        assert done.returncode == 1  # node-p cannot take images: a failure in its wave
        assert (parts / "ota_1.bin").read_bytes()[: len(good.read_bytes())] == good.read_bytes()
        assert _otadata(esp) == {"boot": "ota_1", "state": {"ota_0": "valid", "ota_1": "valid"}}
        log = esp.output()
        assert "update: trying image 1" in log and "update: image 1 committed" in log, log[-3000:]
        assert site.software("node-p")["refused"]["no_ota"] == 1
        assert not (pico.flash / "fw").exists() and not (pico.flash / "upd").exists()

        # Image 2 goes to ota_0; while it is on trial the link is down: no reading.
        second = _image(site.tmp, "fw-second", 120_000)
        cli = subprocess.Popen(
            [sys.executable, "-m", "pubcomp.cli", "node", "update", "--config",
             str(site.gw.fleet), "--gateway", site.gw.gid, "--node", "node-e", "--format",
             "image", "--files", str(second), "--timeout", "60"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        try:
            assert wait_until(lambda: "image 2 written and set to boot" in esp.output(), 60, 0.01)
            link.down()
            assert wait_until(lambda: "the bootloader went back" in esp.output(), 30)
            link.up()
            out2, _ = cli.communicate(timeout=90)
        finally:
            if cli.poll() is None:
                cli.kill()
    finally:
        link.close()
    assert cli.returncode == EXIT_ROLLOUT_HALTED, out2  # halted; nothing to revert
    assert re.search(r"^node-e\s+rolled_back\s+1\s+image 2 did not commit", out2, re.M), out2
    log = esp.output()
    assert "update: image 2 delivered no reading in 4 s" in log, log[-3000:]
    assert _otadata(esp) == {"boot": "ota_1", "state": {"ota_0": "aborted", "ota_1": "valid"}}
    sw = site.software("node-e")
    assert (sw["image"], sw["image_bad"]) == (1, 2), sw
    print(out, out2)
