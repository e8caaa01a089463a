"""``pubcomp fleet keys|release|plan|rollout`` against a real Mosquitto and three gateway
stand-ins (devkit/release_standin.py: separate processes that verify what they get
with sync/release.py and report it in their retained status, as the real gateway's
apply will). Checked by a paho subscriber of our own, not by the rollout's output.

The lead reruns these with real gateways once the apply is merged: only the
``Fleet.start`` helper changes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest

from devkit.broker import Mosquitto
from devkit.procs import stop, track
from pubcomp.sync import release as rel
from pubcomp.sync.exitcodes import EXIT_ROLLOUT_HALTED

ROOT = Path(__file__).resolve().parent.parent
PUBCOMP = [sys.executable, "-m", "pubcomp"]
GATEWAYS = ("gw-a", "gw-b", "gw-c")
# Quick gates for a test: the stand-ins commit in 0.3 s and report every 0.2 s.
FAST = [
    "--gate-timeout", "20", "--settle", "0.6", "--revert-timeout", "20", "--wait", "1.5",
]  # fmt: skip


def wait_until(cond: Callable[[], Any], timeout: float = 20.0, what: str = "") -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what or cond}")


def fleet_yaml(
    port: int, extra_sensor: str | None = None, marker_on: str | None = None, many: int = 0
) -> str:
    """Three gateways; ``extra_sensor`` (an id) added to ``marker_on`` (or to all);
    ``many`` more sensors on gw-a (a release over the 64 kB a message carries whole)."""
    lines = [
        "fleet: coast",
        "defaults:",
        "  uplink:",
        f"    broker: mqtt://127.0.0.1:{port}",
        "    password: !secret secrets/uplink-password",
        "  gpio: simulated",
        "gateways:",
    ]
    for g in GATEWAYS:
        lines += [
            f"  {g}:",
            "    sensors:",
            f"      - {{id: tide-{g}, type: simulated, signal: sine, unit: m, interval_s: 10}}",
        ]
        if g == "gw-a":
            lines += [
                f"      - {{id: many-{i:04d}, type: simulated, signal: sine, unit: m, "
                "interval_s: 60}"
                for i in range(many)
            ]
        if extra_sensor and (marker_on is None or marker_on == g):
            lines.append(
                f"      - {{id: {extra_sensor}, type: simulated, signal: sine, unit: m, "
                "interval_s: 5}"
            )
    return "\n".join(lines) + "\n"


class Fleet:
    """A fleet file, a keys folder, the broker and the stand-ins."""

    def __init__(self, tmp: Path, broker: Mosquitto) -> None:
        self.tmp = tmp
        self.broker = broker
        self.file = tmp / "fleet.yaml"
        self.keys = tmp / "keys"
        self.procs: dict[str, subprocess.Popen[str]] = {}
        (tmp / "secrets").mkdir()
        (tmp / "secrets" / "uplink-password").write_text("not-sent-anywhere\n")
        self.write()
        out = self.pubcomp("fleet", "keys", "init", "--keys", str(self.keys))
        assert out.returncode == 0, out.stderr
        self.signing_key = str(next(self.keys.glob("release-*.key")))

    def write(self, **kw: Any) -> None:
        self.file.write_text(fleet_yaml(self.broker.port, **kw))

    def pubcomp(self, *args: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        return subprocess.run(
            [*PUBCOMP, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env
        )

    def release(self, *extra: str) -> subprocess.CompletedProcess[str]:
        out = self.pubcomp(
            "fleet", "release", "--config", str(self.file), "--signing-key", self.signing_key,
            "--broker", self.broker.url, "--wait", "1.5", *extra,
        )  # fmt: skip
        assert out.returncode == 0, out.stdout + out.stderr
        return out

    def rollout(self, *extra: str) -> subprocess.CompletedProcess[str]:
        return self.pubcomp(
            "fleet", "rollout", "--config", str(self.file), "--signing-key", self.signing_key,
            "--broker", self.broker.url, *FAST, *extra,
        )  # fmt: skip

    def start(self, gw: str, **opts: str) -> None:
        cmd = [
            sys.executable, "-m", "devkit.release_standin", "--port", str(self.broker.port),
            "--gateway", gw, "--fleet", "coast", "--root-pub", str(self.keys / "root.pub"),
            "--log", str(self.log_path(gw)),
        ]  # fmt: skip
        for k, v in opts.items():
            cmd += [f"--{k.replace('_', '-')}", v]
        self.procs[gw] = track(subprocess.Popen(cmd, cwd=ROOT, text=True))
        wait_until(lambda: self.events(gw, "connected"), what=f"{gw} connected")

    def stop(self, gw: str) -> None:
        p = self.procs.pop(gw)
        p.kill()  # the broker sends its Will: offline
        p.wait()

    def log_path(self, gw: str) -> Path:
        return self.tmp / f"{gw}.jsonl"

    def events(self, gw: str, event: str | None = None) -> list[dict[str, Any]]:
        try:
            lines = self.log_path(gw).read_text().splitlines()
        except FileNotFoundError:
            return []
        evs = [json.loads(line) for line in lines if line.strip()]
        return [e for e in evs if event is None or e["event"] == event]

    def versions(self, gw: str, event: str) -> list[int]:
        return [e["version"] for e in self.events(gw, event)]


class Retained:
    """An independent paho subscriber: what the broker holds for each topic now."""

    def __init__(self, port: int) -> None:
        self.got: dict[str, bytes] = {}
        self.c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="retained-check")
        self.c.on_message = lambda c, u, m: self.got.__setitem__(m.topic, bytes(m.payload))
        self.c.connect("127.0.0.1", port)
        self.c.subscribe("telemetry/#", qos=1)
        self.c.loop_start()

    def release_version(self, gw: str) -> int | None:
        p = self.got.get(f"telemetry/{gw}/release")
        return rel.read_release(p).version if p and not rel.is_manifest(p) else None

    def status(self, gw: str) -> dict[str, Any]:
        return json.loads(self.got.get(f"telemetry/{gw}/status", b"{}"))

    def close(self) -> None:
        self.c.loop_stop()
        self.c.disconnect()


@pytest.fixture
def fleet(tmp_path: Path, mosquitto: Mosquitto) -> Iterator[Fleet]:
    f = Fleet(tmp_path, mosquitto)
    yield f
    for p in f.procs.values():
        stop(p, timeout=5)


@pytest.fixture
def retained(mosquitto: Mosquitto) -> Iterator[Retained]:
    r = Retained(mosquitto.port)
    yield r
    r.close()


def _first_rollout(fleet: Fleet) -> None:
    """Every gateway on release 1 (the baseline a revert returns to)."""
    fleet.release()
    out = fleet.rollout("--waves", "100%")
    assert out.returncode == 0, out.stdout + out.stderr
    for g in GATEWAYS:
        wait_until(lambda g=g: fleet.versions(g, "committed") == [1], what=f"{g} commits 1")


def test_a_rollout_completes_through_canary_and_waves(fleet: Fleet, retained: Retained) -> None:
    for g in GATEWAYS:
        fleet.start(g)
    fleet.release()
    out = fleet.rollout("--canary", "gw-b", "--waves", "50%,100%")
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout
    assert "canary: 1 gateway(s): gw-b" in text
    assert "wave 2: 1 gateway(s): gw-a" in text and "wave 3: 1 gateway(s): gw-c" in text
    assert text.index("canary: passed") < text.index("wave 2: 1 gateway(s)")
    assert "rollout complete" in text
    for g in GATEWAYS:
        assert fleet.versions(g, "committed") == [1]
        wait_until(lambda g=g: retained.release_version(g) == 1, what=f"{g} retained 1")
    # The canary committed before any other gateway received the release.
    b_commit = fleet.events("gw-b", "committed")[0]["t"]
    assert all(fleet.events(g, "received")[0]["t"] > b_commit for g in ("gw-a", "gw-c"))
    print(out.stdout)


def test_a_failing_canary_halts_the_rollout_and_every_updated_gateway_is_reverted(
    fleet: Fleet, retained: Retained
) -> None:
    fleet.start("gw-a")
    fleet.start("gw-b", fail_marker="needs-new-driver")
    fleet.start("gw-c")
    _first_rollout(fleet)
    sha1 = {g: fleet.events(g, "received")[0]["sha256"] for g in GATEWAYS}
    fleet.write(extra_sensor="needs-new-driver")  # fails its trial on gw-b only
    fleet.release()
    out = fleet.rollout("--canary", "gw-a,gw-b", "--waves", "100%")
    print(out.stdout, out.stderr)
    assert out.returncode == EXIT_ROLLOUT_HALTED, out.stdout + out.stderr
    assert "canary: FAILED" in out.stdout and "rollout HALTED" in out.stdout
    # gw-b rolled back by itself (2 is bad there); gw-a had committed 2: both get release
    # 3, the configuration of release 1, and commit it; gw-c never saw release 2.
    assert fleet.versions("gw-b", "rolled_back") == [2]
    for g in ("gw-a", "gw-b"):
        wait_until(lambda g=g: 3 in fleet.versions(g, "committed"), what=f"{g} commits 3")
        got3 = [e for e in fleet.events(g, "received") if e["version"] == 3]
        assert got3[0]["sha256"] == sha1[g]
        wait_until(lambda g=g: retained.release_version(g) == 3, what=f"{g} retained 3")
        assert retained.status(g)["release"]["version"] == 3
    assert fleet.versions("gw-a", "committed") == [1, 2, 3]
    assert fleet.versions("gw-c", "received") == [1]
    assert retained.release_version("gw-c") == 1
    assert retained.status("gw-b")["release"]["bad"] == [2]


def test_a_gateway_that_stops_delivering_after_commit_fails_the_readings_gate(
    fleet: Fleet,
) -> None:
    fleet.start("gw-a", drop_marker="chatty")
    fleet.start("gw-b")
    fleet.start("gw-c")
    _first_rollout(fleet)
    fleet.write(extra_sensor="chatty", marker_on="gw-a")
    fleet.release()
    out = fleet.rollout("--canary", "gw-a", "--waves", "100%")
    assert out.returncode == EXIT_ROLLOUT_HALTED, out.stdout + out.stderr
    assert "gw-a" in out.stdout and "dropped" in out.stdout
    wait_until(lambda: 3 in fleet.versions("gw-a", "committed"), what="gw-a reverted to 3")
    assert fleet.versions("gw-b", "received") == [1]


def test_an_offline_gateway_catches_up_on_the_newest_release_skipping_the_others(
    fleet: Fleet, retained: Retained
) -> None:
    for g in GATEWAYS:
        fleet.start(g)
    _first_rollout(fleet)
    fleet.stop("gw-c")
    wait_until(lambda: retained.status("gw-c").get("online") is False, what="gw-c's Will")
    for marker in ("x-second", "x-third"):
        fleet.write(extra_sensor=marker)
        fleet.release("--publish")
    for g in ("gw-a", "gw-b"):
        wait_until(lambda g=g: fleet.versions(g, "committed") == [1, 2, 3], what=f"{g} 2, 3")
    assert fleet.versions("gw-c", "received") == [1]
    fleet.start("gw-c")
    wait_until(lambda: fleet.versions("gw-c", "committed") == [1, 3], what="gw-c catches up")
    assert fleet.versions("gw-c", "received") == [1, 3]


def test_plan_shows_each_gateways_diff_secrets_as_references_and_the_waves(
    fleet: Fleet,
) -> None:
    fleet.start("gw-a")
    fleet.start("gw-b")
    fleet.release()
    out = fleet.pubcomp(
        "fleet", "plan", "--config", str(fleet.file), "--broker", fleet.broker.url,
        "--wait", "1.5", "--canary", "gw-a", "--waves", "100%",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    text = out.stdout
    print(text)
    assert "== gw-a online: runs no release yet (its local --config)" in text
    assert "== gw-c: no status seen" in text
    assert "+      password: !secret 'secrets/uplink-password'" in text
    assert "not-sent-anywhere" not in text
    assert "canary: gw-a" in text and "wave 2: gw-b, gw-c" in text
    kept = (fleet.tmp / "fleet.releases" / "1" / "gw-a.json").read_text()
    assert "secrets/uplink-password" in kept and "not-sent-anywhere" not in kept


def test_a_large_release_travels_in_chunks_and_is_reassembled(
    fleet: Fleet, retained: Retained
) -> None:
    fleet.write(many=700)
    fleet.start("gw-a")
    out = fleet.release("--publish", "--gateway", "gw-a")
    assert "published to every gateway at once" in out.stdout
    wait_until(lambda: fleet.versions("gw-a", "committed") == [1], what="gw-a commits 1")
    manifest = json.loads(retained.got["telemetry/gw-a/release"])
    kept = (fleet.tmp / "fleet.releases" / "1" / "gw-a.json").read_bytes()
    assert manifest == {
        "chunks": manifest["chunks"],
        "sha256": rel.sha256_hex(kept),
        "size": len(kept),
    }
    assert manifest["chunks"] >= 2
    r = rel.Reassembly()
    r.on_release(retained.got["telemetry/gw-a/release"])
    got = [
        r.on_chunk(i, retained.got[f"telemetry/gw-a/release/chunk/{i}"])
        for i in range(manifest["chunks"])
    ]
    assert got[-1] == kept  # what the broker holds is the release, byte for byte
