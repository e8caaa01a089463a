"""Signed releases for a real ``pubcomp gateway run --release-dir``: keys, envelopes made
with sync/release.py, published retained to a real Mosquitto with paho (nothing of the
gateway's own MQTT code), and the ``$release`` audit readings read back at the cloud."""

from __future__ import annotations

import json
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import yaml

from devkit.gateway_helpers import GatewayProc
from devkit.node_helpers import wait_until
from pubcomp.gateway.credentials import hash_password
from pubcomp.sync import release

PREFIX = "telemetry"


class Signer:
    """The operator's keys: a root (provisioned on the gateway as a .pub file) and a
    release key listed in a keys document the root signs."""

    def __init__(self, tmp: Path) -> None:
        self.root = release.new_key()
        self.key = release.new_key()
        self.root_pub = tmp / "release-root.pub"
        self.root_pub.write_text(release.public_text(self.root) + "\n")

    def keys(self, version: int = 1, days: int = 30) -> bytes:
        doc = release.keys_document(version, [self.key], datetime.now(UTC) + timedelta(days=days))
        return release.encode(release.sign(doc, [self.root]))

    def release(
        self,
        gid: str,
        version: int,
        config: str,
        *,
        fleet: str = "e2e",
        signers: list[Any] | None = None,
        expires_in: timedelta = timedelta(days=7),
    ) -> bytes:
        now = datetime.now(UTC)
        doc = release.release_document(
            fleet=fleet,
            gateway=gid,
            version=version,
            config=config,
            created=now,
            expires=now + expires_in,
        )
        return release.encode(release.sign(doc, [self.key] if signers is None else signers))


class ReleaseGateway(GatewayProc):
    """A gateway run with ``--release-dir``, and the fleet-file text of its releases."""

    def __init__(
        self,
        tmp: Path,
        cloud_port: int,
        signer: Signer | None = None,
        *,
        root_pub: Path | None = None,
        fleet_name: str = "e2e",
        **kwargs: Any,
    ) -> None:
        """``root_pub``: the root key's file when no ``Signer`` makes the keys (the
        operator's ``pubcomp fleet keys init`` does, in the rollout tests)."""
        self.release_dir = tmp / "state" / "release"
        self.signer = signer
        pub = root_pub or (signer.root_pub if signer is not None else None)
        assert pub is not None, "a Signer or a root_pub"
        self.root_pub: Path = pub
        self.fleet_name = fleet_name
        self.trial_s = kwargs.pop("trial_s", 8.0)
        super().__init__(tmp, cloud_port, **kwargs)

    def section(
        self,
        sensors: list[dict[str, Any]] | None = None,
        broker_port: int | None = None,
        **extra: Any,
    ) -> dict[str, Any]:
        """This gateway's section of a fleet file (the --config one, or a release's)."""
        gw: dict[str, Any] = {
            "uplink": {
                "broker": f"mqtt://127.0.0.1:{broker_port or self.cloud_port}",
                "keepalive": 5,
            },
            "store": {"path": str(self.db)},
            "ingress": {"host": "127.0.0.1", "port": self.ingress_port},
            "health": {"port": self.health_port},
            "status": {"min_interval_s": 1},
            "release": {"root_key": str(self.root_pub), "trial_s": self.trial_s},
            "gpio": "simulated",
            "sensors": self.sensors if sensors is None else sensors,
            "nodes": [
                {"id": n, "password_hash": self._hashes.setdefault(n, hash_password(p))}
                for n, p in self.nodes.items()
            ],
        }
        for k, v in {**self.extra, **extra}.items():
            gw[k] = gw.get(k, {}) | v if isinstance(v, dict) else v
        return gw

    def write(self) -> None:
        if not hasattr(self, "_hashes"):
            self._hashes: dict[str, str] = {}
        self.fleet.write_text(self.fleet_text())

    def fleet_text(self, **kwargs: Any) -> str:
        if not hasattr(self, "_hashes"):
            self._hashes = {}
        doc = {"fleet": self.fleet_name, "gateways": {self.gid: self.section(**kwargs)}}
        return yaml.safe_dump(doc, sort_keys=False)

    def run_args(self) -> list[str]:
        return [*super().run_args(), "--release-dir", str(self.release_dir)]

    def rel(self) -> dict[str, Any]:
        """The ``release`` part of its status (None while it does not answer)."""
        try:
            return dict(self.status()["release"])
        except (OSError, ValueError):
            return {}

    def wait_release(self, timeout: float = 60.0, **want: Any) -> dict[str, Any]:
        """Wait until its status's release part says ``want`` (e.g. state="committed")."""
        got: dict[str, Any] = {}

        def there() -> bool:
            nonlocal got
            got = self.rel()
            return all(got.get(k) == v for k, v in want.items())

        assert wait_until(there, timeout), f"wanted {want}, last {got}\n" + self.tail()
        return got

    def tail(self, n: int = 4000) -> str:
        return self.log.read_text()[-n:] if self.log.exists() else ""


def publish(port: int, topic: str, payload: bytes, retain: bool = True) -> None:
    """One retained QoS 1 message, published and acknowledged (paho)."""
    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"operator-{time.monotonic_ns()}")
    c.connect("127.0.0.1", port)
    c.loop_start()
    try:
        info = c.publish(topic, payload, qos=1, retain=retain)
        info.wait_for_publish(10)
        assert info.is_published()
    finally:
        c.loop_stop()
        c.disconnect()


def publish_release(port: int, gid: str, envelope: bytes, chunk: int | None = None) -> None:
    """As ``pubcomp fleet release`` publishes: chunks first, the manifest last."""
    head, chunks = release.split(envelope, chunk or release.CHUNK_BYTES)
    for i, c in enumerate(chunks):
        publish(port, release.chunk_topic(PREFIX, gid, i), c)
    publish(port, release.release_topic(PREFIX, gid), head)


class Audit:
    """The ``$release`` readings that reach the cloud broker (paho, QoS 2)."""

    def __init__(self, port: int, client_id: str = "audit") -> None:
        self._got: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id)
        self.client.on_message = lambda _c, _u, m: self._add(m.payload)
        done = threading.Event()
        self.client.on_subscribe = lambda *_: done.set()
        self.client.on_connect = lambda c, *_: c.subscribe(f"{PREFIX}/+/readings", qos=2)
        self.client.connect("127.0.0.1", port)
        self.client.loop_start()
        assert done.wait(10), "audit subscriber did not subscribe"

    def _add(self, payload: bytes) -> None:
        try:
            msg = json.loads(payload)
            readings, gw = msg["readings"], msg["gateway"]
        except (ValueError, KeyError):
            return
        with self._lock:
            self._got += [r | {"gateway": gw} for r in readings if r["sensor"] == "$release"]

    def records(self, gateway: str | None = None) -> list[dict[str, Any]]:
        with self._lock:
            return [r for r in self._got if gateway is None or r["gateway"] == gateway]

    def events(self, gateway: str | None = None) -> list[tuple[str, int | None]]:
        """(event, version) of each distinct audit reading id, in arrival order."""
        seen: dict[tuple[str, str], tuple[str, int | None]] = {}
        for r in self.records(gateway):
            flags = dict(f.split(":", 1) for f in r["flags"] if ":" in f)
            v = flags.get("version")
            seen.setdefault((r["gateway"], r["id"]), (flags["event"], int(v) if v else None))
        return list(seen.values())

    def versions(self, gateway: str, event: str) -> list[int | None]:
        """The versions of ``gateway``'s ``event`` audit readings, in arrival order."""
        return [v for e, v in self.events(gateway) if e == event]

    def first_ts(self, gateway: str, event: str, version: int) -> str:
        """When the gateway stamped its first such reading (ISO 8601, its clock)."""
        for r in self.records(gateway):
            if {f"event:{event}", f"version:{version}"} <= set(r["flags"]):
                return str(r["ts"])
        raise AssertionError(f"{gateway}: no {event} of {version}: {self.events(gateway)}")

    def flags_of(self, event: str) -> list[list[str]]:
        return [r["flags"] for r in self.records() if f"event:{event}" in r["flags"]]

    def wait(self, *want: tuple[str, int | None], timeout: float = 30.0) -> list[Any]:
        assert wait_until(lambda: set(want) <= set(self.events()), timeout), self.events()
        return self.events()

    def stop(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()


def exactly_once(events: list[tuple[str, int | None]]) -> dict[tuple[str, int | None], int]:
    """How many distinct audit readings each (event, version) had (1 each is exactly once)."""
    out: dict[tuple[str, int | None], int] = {}
    for e in events:
        out[e] = out.get(e, 0) + 1
    return out
