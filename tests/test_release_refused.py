"""Bad releases, end to end on a real gateway (issue 28, part 6): each is refused with a
clear message, counted (``/metrics``), shown in the status, told to the cloud once (a
``refused`` audit reading), and nothing is applied: the same process runs the same
configuration, ``current`` is untouched; and the gateway still takes a good release."""

from __future__ import annotations

import json
import urllib.request
from datetime import timedelta
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from devkit.broker import Mosquitto
from devkit.node_helpers import wait_until
from pubcomp.sync import release

from .release_helpers import (
    PREFIX,
    Audit,
    ReleaseGateway,
    Signer,
    publish,
    publish_release,
)

GID = "gw-bad"
COUNTER = {"id": "counter", "type": "simulated", "signal": "counter", "interval_s": 0.2}
SINE = {"id": "sine", "type": "simulated", "signal": "sine", "interval_s": 0.2}


def _metrics(gw: ReleaseGateway) -> dict[str, float]:
    with urllib.request.urlopen(gw.url("/metrics"), timeout=5) as r:
        text = r.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        if fam.name.startswith("pubcomp_release"):
            for s in fam.samples:
                out[s.name + json.dumps(s.labels, sort_keys=True)] = s.value
    return out


def _refused(gw: ReleaseGateway, reason: str) -> float:
    return _metrics(gw).get(f'pubcomp_release_refused_total{{"reason": "{reason}"}}', 0.0)


def _all_refused(gw: ReleaseGateway) -> float:
    return sum(v for k, v in _metrics(gw).items() if k.startswith("pubcomp_release_refused_total"))


def _tree(root: Path) -> dict[str, bytes]:
    """Every file under the release directory, with its bytes: what "unchanged" means."""
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


class Case:
    def __init__(self, gw: ReleaseGateway, audit: Audit, port: int) -> None:
        self.gw, self.audit, self.port = gw, audit, port
        self.pid = gw.proc.pid if gw.proc else None

    def refused(self, payload: bytes, reason: str, *words: str, chunk: int | None = None) -> str:
        """Publish ``payload``; it must be refused for ``reason`` and change nothing."""
        before = self.gw.rel()
        current = (self.gw.release_dir / "current").read_bytes() if before["version"] else None
        tree = _tree(self.gw.release_dir)
        sensors = set(self.gw.status()["sensors"])
        n = _refused(self.gw, reason)
        if chunk is None:
            publish(self.port, release.release_topic(PREFIX, GID), payload)
        else:
            publish_release(self.port, GID, payload, chunk)
        assert wait_until(lambda: _refused(self.gw, reason) == n + 1, 20), (
            reason,
            self.gw.rel(),
            self.gw.tail(),
        )
        rel = self.gw.rel()
        assert rel["state"] == "refused" and rel["refused"][reason] >= 1, rel
        for w in words:
            assert w in rel["last_error"], (w, rel["last_error"])
        # Nothing applied: the same process, the same release and sensors, current as it was.
        assert self.gw.proc is not None and self.gw.proc.pid == self.pid
        assert self.gw.proc.poll() is None
        assert (rel["version"], rel["sha256"]) == (before["version"], before["sha256"])
        assert set(self.gw.status()["sensors"]) == sensors
        if current is not None:
            assert (self.gw.release_dir / "current").read_bytes() == current
        else:
            assert not (self.gw.release_dir / "current").exists()
        assert _tree(self.gw.release_dir) == tree  # nothing staged, nothing renamed
        # The cloud hears of it once, with the reason.
        assert wait_until(
            lambda: any(f"reason:{reason}" in f for f in self.audit.flags_of("refused")), 20
        ), self.audit.events()
        assert sum(f"reason:{reason}" in f for f in self.audit.flags_of("refused")) == 1
        return str(rel["last_error"])


def _tampered(envelope: bytes, **change: Any) -> bytes:
    env = json.loads(envelope)
    env["signed"].update(change)
    return release.encode(env)


def test_bad_releases_are_refused_and_nothing_is_applied(
    tmp_path: Path, mosquitto: Mosquitto
) -> None:
    audit = Audit(mosquitto.port)
    signer = Signer(tmp_path)
    gw = ReleaseGateway(tmp_path, mosquitto.port, signer, gid=GID, sensors=[COUNTER], trial_s=5)
    publish(mosquitto.port, release.keys_topic(PREFIX), signer.keys())
    gw.start()
    case = Case(gw, audit, mosquitto.port)
    good = gw.fleet_text(sensors=[COUNTER, SINE])
    try:
        unsigned = json.loads(signer.release(GID, 1, good))
        unsigned["signatures"] = []
        case.refused(release.encode(unsigned), "unsigned", "no signature")

        stranger = release.new_key()  # a key no keys document lists
        case.refused(signer.release(GID, 1, good, signers=[stranger]), "unknown-key")

        altered = _tampered(signer.release(GID, 1, good), config=good + "# more\n")
        case.refused(altered, "bad-signature", "does not verify")

        other = signer.release("gw-other", 1, good.replace(GID, "gw-other"))
        case.refused(other, "wrong-gateway", "gw-other")

        typo = good.replace("interval_s: 0.2", "intervall_s: 0.2", 1)
        line = (
            typo.splitlines().index(next(ln for ln in typo.splitlines() if "intervall_s" in ln)) + 1
        )
        err = case.refused(signer.release(GID, 1, typo), "invalid-config", "intervall_s")
        # file, line and key, as `pubcomp config check` says them
        assert f"releases/1/fleet.yaml:{line}: gateways.{GID}.sensors[0].intervall_s" in err, err
        assert "did you mean 'interval_s'" in err, err

        pulse = {"id": "rain", "type": "pulse", "pin": 17}
        no_gpio = gw.fleet_text(sensors=[COUNTER, pulse], gpio="rpigpio")
        err = case.refused(signer.release(GID, 1, no_gpio), "driver-check", "rpigpio")
        assert "fleet.yaml:" in err and f"gateways.{GID}.gpio" in err, err

        old = signer.release(GID, 1, good, expires_in=timedelta(seconds=-60))
        case.refused(old, "expired", "expired")

        # Still takes a good one...
        publish(mosquitto.port, release.release_topic(PREFIX, GID), signer.release(GID, 2, good))
        gw.wait_release(state="committed", version=2, timeout=60)
        case.pid = gw.proc.pid if gw.proc else None  # (re-executed: the same pid)
        # ... and then refuses an older version replayed (never applied, validly signed).
        replay = gw.fleet_text(sensors=[SINE])
        case.refused(signer.release(GID, 1, replay), "old-version", "older than version 2")
        assert gw.rel()["version"] == 2
        tree = _tree(gw.release_dir)
        refusals = _all_refused(gw)

        def quiet(payload: bytes) -> None:
            """Published on the release topic: ignored, counted as such, never refused."""
            ignored = gw.rel()["ignored"]
            publish(mosquitto.port, release.release_topic(PREFIX, GID), payload)
            assert wait_until(lambda: gw.rel()["ignored"] > ignored, 20), gw.rel()
            assert _all_refused(gw) == refusals, _metrics(gw)
            assert gw.rel()["version"] == 2 and _tree(gw.release_dir) == tree

        # Version 2 again, another copy with another config: `same-version`, no news.
        quiet(signer.release(GID, 2, replay))
        # The running release again (retained messages come at every reconnection).
        quiet(signer.release(GID, 2, good))
        # An empty retained message: the release withdrawn (docs/wire-format.md), nothing
        # to take and nothing to refuse.
        publish(mosquitto.port, release.release_topic(PREFIX, GID), b"")
        quiet(signer.release(GID, 2, good))
        assert gw.proc is not None and gw.proc.pid == case.pid and gw.proc.poll() is None
    finally:
        audit.stop()
    assert gw.terminate() == 0


def test_chunked_releases_truncated_or_reordered_chunks_are_refused(
    tmp_path: Path, mosquitto: Mosquitto
) -> None:
    """A release in chunks (as ``pubcomp fleet release`` publishes one over 64 kB; small
    chunks here) is put together and applied; a truncated chunk or two chunks swapped
    are refused, and nothing is applied."""
    audit = Audit(mosquitto.port)
    signer = Signer(tmp_path)
    gw = ReleaseGateway(tmp_path, mosquitto.port, signer, gid=GID, sensors=[COUNTER], trial_s=5)
    publish(mosquitto.port, release.keys_topic(PREFIX), signer.keys())
    gw.start()
    case = Case(gw, audit, mosquitto.port)
    try:
        env = signer.release(GID, 1, gw.fleet_text(sensors=[COUNTER, SINE]))
        publish_release(mosquitto.port, GID, env, chunk=400)
        gw.wait_release(state="committed", version=1, timeout=60)
        case.pid = gw.proc.pid if gw.proc else None

        env2 = signer.release(GID, 2, gw.fleet_text(sensors=[SINE]))
        manifest, chunks = release.split(env2, 400)
        assert len(chunks) >= 3
        for i, c in enumerate(chunks):  # chunk 1 cut short (its tag intact)
            publish(mosquitto.port, release.chunk_topic(PREFIX, GID, i), c[:-40] if i == 1 else c)
        n = _refused(gw, "chunk")
        publish(mosquitto.port, release.release_topic(PREFIX, GID), manifest)
        assert wait_until(lambda: _refused(gw, "chunk") == n + 1, 20), gw.rel()
        assert "truncated" in gw.rel()["last_error"], gw.rel()
        assert gw.rel()["version"] == 1 and set(gw.status()["sensors"]) == {"counter", "sine"}

        env3 = signer.release(GID, 3, gw.fleet_text(sensors=[SINE]))
        manifest, chunks = release.split(env3, 400)
        chunks[0], chunks[1] = chunks[1], chunks[0]  # each on the other's topic
        for i, c in enumerate(chunks):
            publish(mosquitto.port, release.chunk_topic(PREFIX, GID, i), c)
        assert wait_until(lambda: _refused(gw, "chunk") >= n + 2, 20), gw.rel()
        assert "reordered" in gw.rel()["last_error"], gw.rel()
        publish(mosquitto.port, release.release_topic(PREFIX, GID), manifest)
        assert gw.rel()["version"] == 1 and gw.proc is not None and gw.proc.pid == case.pid
        assert (gw.release_dir / "current").read_text() == "1\n"
        assert set(gw.status()["sensors"]) == {"counter", "sine"}
    finally:
        audit.stop()
    assert gw.terminate() == 0
