"""``pubcomp fleet keys|release|plan|rollout`` against a real Mosquitto and three real
gateways (``pubcomp gateway run --release-dir``, each with its own store, release
directory and local secret file): what the rollout publishes is verified, staged,
switched to, tried and committed or rolled back by the gateway's own apply
(gateway/release_apply.py). Checked by paho subscribers of our own (the ``$release``
audit readings each gateway delivers through its uplink, what the broker retains),
not by the rollout's output.
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
from pubcomp.sync import release as rel
from pubcomp.sync.exitcodes import EXIT_ROLLOUT_HALTED

from .release_helpers import Audit, ReleaseGateway

ROOT = Path(__file__).resolve().parent.parent
PUBCOMP = [sys.executable, "-m", "pubcomp"]
GATEWAYS = ("gw-a", "gw-b", "gw-c")
TRIAL_S = 8  # release.trial_s: how long a failing release runs before it is rolled back
# Gates for real gateways on a busy machine: a wave takes a switch (the gateway starts
# again) and a trial; the readings are measured 2 s after the commit.
FAST = [
    "--gate-timeout", "90", "--settle", "2", "--revert-timeout", "90", "--wait", "3",
]  # fmt: skip
NO_PORT = "/dev/pubcomp-test-no-such-port"  # a serial sensor there never reads


def wait_until(cond: Callable[[], Any], timeout: float = 60.0, what: str = "") -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what or cond}")


def _sensor(sid: str, interval_s: float = 0.5) -> str:
    return f"{{id: {sid}, type: simulated, signal: sine, unit: m, interval_s: {interval_s}}}"


class Fleet:
    """The operator's fleet file and keys folder, the broker, three real gateways."""

    def __init__(self, tmp: Path, broker: Mosquitto) -> None:
        self.tmp = tmp
        self.broker = broker
        self.file = tmp / "fleet.yaml"
        self.keys = tmp / "keys"
        out = self.pubcomp("fleet", "keys", "init", "--keys", str(self.keys))
        assert out.returncode == 0, out.stderr
        self.signing_key = str(next(self.keys.glob("release-*.key")))
        self.gws: dict[str, ReleaseGateway] = {}
        for g in GATEWAYS:
            (tmp / g).mkdir()
            # The gateway's own secret file, beside its --config (a release names it only).
            (tmp / g / "secrets").mkdir()
            (tmp / g / "secrets" / "uplink-password").write_text("not-sent-anywhere\n")
            self.gws[g] = ReleaseGateway(
                tmp / g,
                broker.port,
                root_pub=self.keys / "root.pub",
                fleet_name="coast",
                gid=g,
                sensors=[],
                trial_s=TRIAL_S,
                extra={"status": {"heartbeat_s": 5}},
            )
        self.write()
        self.audit = Audit(broker.port, client_id="rollout-audit")

    def yaml(
        self,
        extra_sensor: str | None = None,
        marker_on: str | None = None,
        many: int = 0,
        broken_on: str | None = None,
        chatty_on: str | None = None,
    ) -> str:
        """Every gateway with a tide sensor; ``extra_sensor`` (an id) added to ``marker_on``
        (or to all); ``broken_on``: a serial sensor on a port that does not exist (it never
        reads: the trial's sensors gate fails); ``chatty_on``: a sensor reading ten times a
        second; ``many`` more sensors on gw-a (a release over the 64 kB a message carries
        whole)."""
        lines = [
            "fleet: coast",
            "defaults:",
            "  uplink:",
            f"    broker: mqtt://127.0.0.1:{self.broker.port}",
            "    keepalive: 5",
            "    username: gateway",
            "    password: !secret secrets/uplink-password",
            "  status: {min_interval_s: 1, heartbeat_s: 5}",
            f"  release: {{root_key: {self.keys / 'root.pub'}, trial_s: {TRIAL_S}}}",
            "  gpio: simulated",
            "gateways:",
        ]
        for g, gw in self.gws.items():
            lines += [
                f"  {g}:",
                f"    store: {{path: {gw.db}}}",
                f"    ingress: {{host: 127.0.0.1, port: {gw.ingress_port}}}",
                f"    health: {{port: {gw.health_port}}}",
                "    sensors:",
                f"      - {_sensor(f'tide-{g}')}",
            ]
            if g == "gw-a":
                lines += [f"      - {_sensor(f'many-{i:04d}', 60)}" for i in range(many)]
            if chatty_on == g:
                lines.append(f"      - {_sensor('chatty', 0.1)}")
            if extra_sensor and (marker_on is None or marker_on == g):
                lines.append(f"      - {_sensor(extra_sensor)}")
            if broken_on == g:
                lines.append(f"      - {{id: pm-{g}, type: sds011, port: {NO_PORT}}}")
        return "\n".join(lines) + "\n"

    def write(self, **kw: Any) -> None:
        self.file.write_text(self.yaml(**kw))

    def pubcomp(self, *args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
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

    def start(self, gw: str) -> None:
        """The gateway runs its own --config, a copy of the fleet file as it is now (the
        one it was installed with), until a release is committed."""
        g = self.gws[gw]
        g.fleet.write_text(self.file.read_text())
        g.start()

    def stop(self, gw: str) -> None:
        self.gws[gw].kill()  # the broker sends its Will: offline

    def versions(self, gw: str, event: str) -> list[int | None]:
        """What the gateway told the cloud it did (its ``$release`` audit readings)."""
        return self.audit.versions(gw, event)

    def committed(self, gw: str, *versions: int) -> None:
        wait_until(
            lambda: self.versions(gw, "committed") == list(versions),
            90,
            f"{gw} commits {versions}: {self.audit.events(gw)}\n{self.gws[gw].tail()}",
        )

    def tails(self) -> str:
        """Each gateway's log, its end: what a failed rollout's output cannot say."""
        return "".join(f"\n--- {g} log\n{gw.tail()}" for g, gw in self.gws.items())

    def close(self) -> None:
        self.audit.stop()
        for g in self.gws.values():
            if g.proc is not None and g.proc.poll() is None:
                g.terminate()


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
    f.close()


@pytest.fixture
def retained(mosquitto: Mosquitto) -> Iterator[Retained]:
    r = Retained(mosquitto.port)
    yield r
    r.close()


def _first_rollout(fleet: Fleet, *gateways: str) -> None:
    """Every gateway on release 1 (the baseline a revert returns to)."""
    fleet.release()
    out = fleet.rollout("--waves", "100%")
    assert out.returncode == 0, out.stdout + out.stderr + fleet.tails()
    for g in gateways or GATEWAYS:
        fleet.committed(g, 1)


def test_a_rollout_completes_through_canary_and_waves(fleet: Fleet, retained: Retained) -> None:
    for g in GATEWAYS:
        fleet.start(g)
    fleet.release()
    out = fleet.rollout("--canary", "gw-b", "--waves", "50%,100%")
    print(out.stdout)
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout
    assert "canary: 1 gateway(s): gw-b" in text
    assert "wave 2: 1 gateway(s): gw-a" in text and "wave 3: 1 gateway(s): gw-c" in text
    assert text.index("canary: passed") < text.index("wave 2: 1 gateway(s)")
    assert "rollout complete" in text
    for g in GATEWAYS:
        fleet.committed(g, 1)
        assert fleet.versions(g, "fetched") == [1]
        wait_until(lambda g=g: retained.release_version(g) == 1, what=f"{g} retained 1")
        status = fleet.gws[g].rel()
        assert (status["version"], status["state"], status["bad"]) == (1, "committed", [])
        assert (fleet.gws[g].release_dir / "current").read_text() == "1\n"
    # The canary committed before any other gateway fetched the release (the gateways'
    # own stamps, one machine's clock).
    b_commit = fleet.audit.first_ts("gw-b", "committed", 1)
    assert all(fleet.audit.first_ts(g, "fetched", 1) > b_commit for g in ("gw-a", "gw-c"))


def test_a_failing_canary_halts_the_rollout_and_every_updated_gateway_is_reverted(
    fleet: Fleet, retained: Retained
) -> None:
    for g in GATEWAYS:
        fleet.start(g)
    _first_rollout(fleet)
    sha1 = {g: fleet.gws[g].rel()["sha256"] for g in GATEWAYS}
    # Release 2: a new sensor everywhere, and on gw-b one that never reads (its serial
    # port does not exist): gw-b's trial fails its sensors gate.
    fleet.write(extra_sensor="salinity", broken_on="gw-b")
    fleet.release()
    out = fleet.rollout("--canary", "gw-a,gw-b", "--waves", "100%")
    print(out.stdout, out.stderr)
    assert out.returncode == EXIT_ROLLOUT_HALTED, out.stdout + out.stderr
    assert "canary: FAILED" in out.stdout and "rollout HALTED" in out.stdout
    assert "gw-b" in out.stdout and "pm-gw-b" in out.stdout  # why, as the gateway said it
    # gw-b rolled back by itself (2 is bad there); gw-a had committed 2: both get release
    # 3, the configuration of release 1, and commit it; gw-c never saw release 2.
    assert fleet.versions("gw-b", "rolled_back") == [2]
    fleet.committed("gw-a", 1, 2, 3)
    fleet.committed("gw-b", 1, 3)
    for g in ("gw-a", "gw-b"):
        st = fleet.gws[g].rel()
        assert (st["version"], st["sha256"], st["state"]) == (3, sha1[g], "committed")
        wait_until(lambda g=g: retained.release_version(g) == 3, what=f"{g} retained 3")
        wait_until(lambda g=g: retained.status(g)["release"]["version"] == 3, what=f"{g} says 3")
        assert set(fleet.gws[g].status()["sensors"]) == {f"tide-{g}"}
    assert fleet.versions("gw-c", "fetched") == [1]
    assert retained.release_version("gw-c") == 1
    assert retained.status("gw-b")["release"]["bad"] == [2]
    assert fleet.gws["gw-c"].rel()["version"] == 1


def test_a_gateway_that_delivers_less_after_commit_fails_the_readings_gate(
    fleet: Fleet,
) -> None:
    fleet.write(chatty_on="gw-a")
    for g in GATEWAYS:
        fleet.start(g)
    _first_rollout(fleet)
    # Release 2 takes gw-a's busiest sensor away: its trial passes (a sensor removed is
    # not the release's to mend), but it delivers a tenth of what it did.
    fleet.write()
    fleet.release()
    out = fleet.rollout("--canary", "gw-a", "--waves", "100%")
    print(out.stdout, out.stderr)
    assert out.returncode == EXIT_ROLLOUT_HALTED, out.stdout + out.stderr
    assert "gw-a" in out.stdout and "dropped" in out.stdout
    fleet.committed("gw-a", 1, 2, 3)
    assert "chatty" in fleet.gws["gw-a"].status()["sensors"]
    assert fleet.versions("gw-b", "fetched") == [1]


def test_an_offline_gateway_catches_up_on_the_newest_release_skipping_the_others(
    fleet: Fleet, retained: Retained
) -> None:
    for g in GATEWAYS:
        fleet.start(g)
    _first_rollout(fleet)
    fleet.stop("gw-c")
    wait_until(lambda: retained.status("gw-c").get("online") is False, what="gw-c's Will")
    fleet.write(extra_sensor="x-second")
    fleet.release("--publish")
    for g in ("gw-a", "gw-b"):
        fleet.committed(g, 1, 2)
    fleet.write(extra_sensor="x-third")
    fleet.release("--publish")
    for g in ("gw-a", "gw-b"):
        fleet.committed(g, 1, 2, 3)
    assert fleet.versions("gw-c", "fetched") == [1]
    fleet.gws["gw-c"].start()  # as it was: its --config, and release 1 in its directory
    fleet.committed("gw-c", 1, 3)
    assert fleet.versions("gw-c", "fetched") == [1, 3]
    assert set(fleet.gws["gw-c"].status()["sensors"]) == {"tide-gw-c", "x-third"}


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
    fleet.start("gw-a")
    fleet.write(many=700)
    out = fleet.release("--publish", "--gateway", "gw-a")
    assert "published to every gateway at once" in out.stdout
    fleet.committed("gw-a", 1)
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
    # ... and what the gateway staged is its config, byte for byte.
    staged = (fleet.gws["gw-a"].release_dir / "releases" / "1" / "fleet.yaml").read_bytes()
    assert staged == rel.read_release(kept).config.encode()
    assert len(fleet.gws["gw-a"].status()["sensors"]) == 701
