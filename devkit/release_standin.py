"""A gateway stand-in for release rollouts (issue 28), until the real apply lands.

It follows docs/notes' releases contract from the gateway's side, and nothing more:
a paho-mqtt client that subscribes to its release topic (and the chunks) and the
keys document, verifies what comes with sync/release.py exactly as a gateway does
(root key, keys document, signature, gateway, version, expiry, hash), and publishes
a retained status message with the ``release`` fields the real gateway will carry
(``version``, ``sha256``, ``state``, ``previous``, ``bad``, ``last_error``) and an
uplink that delivers ``--rate`` readings a second. Its Will says it is offline.

It applies nothing: a release whose config contains ``--fail-marker`` fails its
trial here (rolled back, the version marked bad), one containing ``--drop-marker``
commits and then delivers nothing (the readings gate's case); any other commits
after ``--trial-s``. Every release it receives and what it did is a JSON line in
``--log``, for the tests (which versions it saw: an offline one catches up on the
newest only).

The lead swaps these for real gateways after merging: the rollout does not know
the difference (it reads only the status messages).

    python -m devkit.release_standin --port 1883 --gateway gw-1 --fleet coast \\
        --root-pub keys/root.pub --log gw-1.jsonl
"""

from __future__ import annotations

import argparse
import json
import secrets
import signal
import sys
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt

from pubcomp.sync import release as rel


def _now_text() -> str:
    return rel.time_text(datetime.now(UTC))


class StandIn:
    def __init__(self, args: argparse.Namespace) -> None:
        self.a = args
        self.prefix = args.prefix
        self.gw = args.gateway
        self.trust = rel.Trust(rel.load_public(Path(args.root_pub).read_text()))
        self.chunks = rel.Reassembly()
        self.lock = threading.Lock()
        self.run_id = secrets.token_hex(4)
        self.n = 0
        self.started = _now_text()
        self.t0 = time.monotonic()
        self.delivered = 0
        self.rate = args.rate
        self.release: dict[str, Any] = {
            "version": None,
            "sha256": None,
            "state": "idle",
            "previous": None,
            "bad": [],
            "last_error": None,
        }
        self.newest = 0
        self.status_topic = f"{self.prefix}/{self.gw}/status"
        self.client = mqtt.Client(
            mqtt.CallbackAPIVersion.VERSION2,
            client_id=f"{self.gw}-standin",
            protocol=mqtt.MQTTv5,
        )
        self.client.will_set(self.status_topic, self._status(online=False), qos=1, retain=True)
        self.client.on_connect = self._on_connect
        self.client.on_message = self._on_message
        self.client.reconnect_delay_set(0.05, 0.5)

    # -- what it says

    def _status(self, online: bool) -> bytes:
        self.n += 1
        msg: dict[str, Any] = {
            "v": 1,
            "gateway": self.gw,
            "fleet": self.a.fleet,
            "id": f"{self.run_id}/{'will-' if not online else ''}{self.n}",
            "online": online,
            "reason": ("heartbeat" if online else "will"),
            "ts": _now_text(),
            "version": "standin",
            "started": self.started,
        }
        if online:
            msg |= {
                "uptime_s": round(time.monotonic() - self.t0, 3),
                "verdict": {"level": "ok", "headline": "stand-in", "exit": 0},
                "problems": [],
                "uplink": {
                    "state": "connected",
                    "broker": f"mqtt://127.0.0.1:{self.a.port}",
                    "qos": 2,
                    "connected_since": self.started,
                    "down_since": None,
                    "backlog": 0,
                    "inflight_messages": 0,
                    "oldest_age_s": None,
                    "drain_rate": float(self.rate),
                    "eta_s": None,
                    "delivered": self.delivered,
                    "last_error": None,
                    "last_error_at": None,
                },
                "store": {"bytes": 0, "quota_bytes": None, "disk_free_bytes": 1 << 30},
                "flash": {"bytes_per_day": None, "life_years": None},
                "clock": {"source": "kernel", "synced": True, "corrections": 0},
                "sensors": {},
                "nodes": {},
                "release": dict(self.release),
            }
        return json.dumps(msg, separators=(",", ":")).encode()

    def publish_status(self) -> None:
        with self.lock:
            payload = self._status(online=True)
        self.client.publish(self.status_topic, payload, qos=1, retain=True)

    def _log(self, **fields: Any) -> None:
        with open(self.a.log, "a") as fh:
            fh.write(json.dumps({"t": time.time(), **fields}) + "\n")

    # -- what it receives

    def _on_connect(self, client: Any, userdata: Any, flags: Any, reason: Any, props: Any) -> None:
        client.subscribe(
            [
                (rel.keys_topic(self.prefix), 1),
                (rel.release_topic(self.prefix, self.gw), 1),
                (rel.release_topic(self.prefix, self.gw) + "/chunk/+", 1),
            ]
        )
        self._log(event="connected")
        self.publish_status()

    def _on_message(self, client: Any, userdata: Any, m: Any) -> None:
        payload = bytes(m.payload)
        now = datetime.now(UTC)
        try:
            if m.topic == rel.keys_topic(self.prefix):
                if payload:
                    self.trust.accept_keys(payload, now)
                return
            if not payload:
                return  # a withdrawn release (an empty retained message)
            if "/chunk/" in m.topic:
                whole = self.chunks.on_chunk(int(m.topic.rsplit("/", 1)[1]), payload)
            else:
                whole = self.chunks.on_release(payload)
            if whole is None:
                return
            r = self.trust.verify(
                whole, fleet=self.a.fleet, gateway=self.gw, newest=self.newest or None, now=now
            )
        except rel.ReleaseRefused as exc:
            if exc.reason == "same-version":
                return
            self._log(event="refused", reason=exc.reason, message=str(exc))
            with self.lock:
                self.release["state"] = "refused"
                self.release["last_error"] = str(exc)
            self.publish_status()
            return
        threading.Thread(target=self._apply, args=(r,), daemon=True).start()

    def _apply(self, r: rel.Release) -> None:
        self._log(event="received", version=r.version, sha256=r.config_sha256)
        with self.lock:
            self.newest = max(self.newest, r.version)
            self.release["state"] = "trial"
        self.publish_status()
        time.sleep(self.a.trial_s)
        with self.lock:
            if self.a.fail_marker and self.a.fail_marker in r.config:
                self.release["bad"] = sorted({*self.release["bad"], r.version})
                self.release["state"] = "rolled_back"
                self.release["last_error"] = f"release {r.version}: health gate failed in trial"
                event = "rolled_back"
            else:
                self.release["previous"] = self.release["version"]
                self.release["version"] = r.version
                self.release["sha256"] = r.config_sha256
                self.release["state"] = "committed"
                self.release["last_error"] = None
                event = "committed"
                dropping = bool(self.a.drop_marker and self.a.drop_marker in r.config)
                self.rate = 0.0 if dropping else self.a.rate
        self._log(event=event, version=r.version)
        self.publish_status()

    # -- running

    def run(self, stop: threading.Event) -> None:
        self.client.connect("127.0.0.1", self.a.port, keepalive=5)
        self.client.loop_start()
        last = time.monotonic()
        while not stop.wait(self.a.interval):
            now = time.monotonic()
            with self.lock:
                self.delivered += int(self.rate * (now - last))
            last = now
            self.publish_status()
        self.client.loop_stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--gateway", required=True)
    p.add_argument("--fleet", required=True)
    p.add_argument("--prefix", default="telemetry")
    p.add_argument("--root-pub", required=True)
    p.add_argument("--log", required=True)
    p.add_argument("--rate", type=float, default=10.0, help="readings a second it delivers")
    p.add_argument("--interval", type=float, default=0.2, help="seconds between statuses")
    p.add_argument("--trial-s", type=float, default=0.3)
    p.add_argument("--fail-marker", help="a release whose config holds this fails its trial")
    p.add_argument("--drop-marker", help="... commits, then delivers nothing")
    args = p.parse_args(argv)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    StandIn(args).run(stop)
    return 0


if __name__ == "__main__":
    sys.exit(main())
