"""The operator's side of releases on the cloud broker (issue 28): publishing releases
and the keys document (retained, QoS 1; chunked when large), and what the gateways'
retained status messages say of their releases. Shared by ``pubcomp fleet release``
(gateway/) and ``pubcomp fleet plan|rollout|keys`` (pipeline/), hence in sync/.

aiomqtt, as ``pubcomp fleet watch``: one short-lived connection, clean session,
nothing to persist (a publish that fails is repeated by running the command again;
the same release is byte-identical, sync/release.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import release as rel
from .client import BrokerURL, TLSOptions


def client(args: argparse.Namespace, role: str) -> Any:
    """An aiomqtt client from the connection arguments (sync/cli.py)."""
    import aiomqtt

    url = BrokerURL.parse(args.broker)
    password = None
    if args.password_file:
        password = Path(args.password_file).read_text().rstrip("\r\n")
    v5 = args.protocol == "5"
    return aiomqtt.Client(
        url.host,
        url.port,
        identifier=f"pubcomp-{role}-{secrets.token_hex(4)}",
        username=args.username,
        password=password,
        protocol=aiomqtt.ProtocolVersion.V5 if v5 else aiomqtt.ProtocolVersion.V311,
        clean_session=None if v5 else True,
        tls_context=TLSOptions(args.ca_file, args.cert_file, args.key_file).context()
        if url.tls
        else None,
        timeout=10.0,
    )


async def publish_release(c: Any, prefix: str, gateway: str, payload: bytes) -> int:
    """One gateway's release, retained: chunks first, then what goes on the release
    topic (the envelope, or the manifest), so the manifest never names missing chunks.
    Returns the number of messages."""
    head, chunks = rel.split(payload)
    for i, chunk in enumerate(chunks):
        await c.publish(rel.chunk_topic(prefix, gateway, i), chunk, qos=1, retain=True)
    await c.publish(rel.release_topic(prefix, gateway), head, qos=1, retain=True)
    return len(chunks) + 1


async def publish_keys(c: Any, prefix: str, payload: bytes) -> None:
    await c.publish(rel.keys_topic(prefix), payload, qos=1, retain=True)


# ------------------------------------------------------------------ what the fleet says


@dataclass
class Seen:
    """One gateway as its status messages show it (the newest first)."""

    gateway: str
    online: bool = False
    release: dict[str, Any] | None = None  # the status's `release` field, if any
    delivered: int | None = None  # uplink.delivered (since the gateway's start)
    drain_rate: float | None = None
    ts: str | None = None  # the status's own time (the gateway's clock)
    at: float = 0.0  # when it arrived here (monotonic); 0: retained, before we looked
    messages: int = 0
    history: list[tuple[float, int | None, float | None]] = field(default_factory=list)

    @property
    def version(self) -> int | None:
        v = (self.release or {}).get("version")
        return v if isinstance(v, int) else None

    @property
    def sha256(self) -> str | None:
        v = (self.release or {}).get("sha256")
        return v if isinstance(v, str) else None

    @property
    def state(self) -> str | None:
        v = (self.release or {}).get("state")
        return v if isinstance(v, str) else None

    @property
    def bad(self) -> list[int]:
        v = (self.release or {}).get("bad") or []
        return [x for x in v if isinstance(x, int)]

    @property
    def last_error(self) -> str | None:
        v = (self.release or {}).get("last_error")
        return v if isinstance(v, str) else None


@dataclass
class FleetSeen:
    """The gateways' statuses and the releases retained for them, as messages arrive."""

    status_topics: dict[str, str]  # topic -> gateway
    gateways: dict[str, Seen] = field(default_factory=dict)
    retained_versions: dict[str, int] = field(default_factory=dict)  # gateway -> on its topic
    invalid: int = 0

    def add(self, topic: str, payload: bytes, retained: bool, now: float) -> str | None:
        """Take a message; the gateway it was about, if any."""
        gw = self.status_topics.get(topic)
        if gw is not None:
            return self._status(gw, payload, retained, now)
        if topic.endswith("/release"):
            gw = topic.rsplit("/", 2)[-2]
            if payload and not rel.is_manifest(payload):
                try:
                    self.retained_versions[gw] = rel.read_release(payload).version
                except (rel.ReleaseRefused, KeyError, TypeError):
                    self.invalid += 1
            return gw
        return None

    def _status(self, gw: str, payload: bytes, retained: bool, now: float) -> str | None:
        try:
            msg = json.loads(payload)
            if not isinstance(msg, dict):
                raise ValueError("not an object")
        except (ValueError, UnicodeDecodeError):
            self.invalid += 1
            return None
        seen = self.gateways.setdefault(gw, Seen(gw))
        seen.online = bool(msg.get("online"))
        seen.ts = msg.get("ts") if isinstance(msg.get("ts"), str) else None
        seen.at = 0.0 if retained else now
        seen.messages += 1
        if isinstance(msg.get("release"), dict):
            seen.release = msg["release"]
        uplink = msg.get("uplink") if isinstance(msg.get("uplink"), dict) else None
        if uplink is not None:
            d, r = uplink.get("delivered"), uplink.get("drain_rate")
            seen.delivered = d if isinstance(d, int) else None
            seen.drain_rate = float(r) if isinstance(r, int | float) else None
            seen.history.append((now, seen.delivered, seen.drain_rate))
            del seen.history[:-200]
        return gw

    def newest_version(self) -> int:
        """The highest version any gateway or retained message shows (a new release
        must be above it, or gateways would refuse it as a replay)."""
        out = max(self.retained_versions.values(), default=0)
        for s in self.gateways.values():
            out = max([out, s.version or 0, *s.bad])
        return out


async def gather(
    c: Any, seen: FleetSeen, prefixes: set[str], wait: float, quiet: float = 1.0
) -> None:
    """Subscribe to the statuses and release topics; take what is retained (until no
    message came for ``quiet`` s, at most ``wait`` s)."""
    for topic in sorted(set(seen.status_topics)):
        await c.subscribe(topic, qos=1)
    for p in sorted(prefixes):
        await c.subscribe(f"{p}/+/release", qos=1)
    deadline = time.monotonic() + wait
    it = c.messages.__aiter__()
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return
        try:
            m = await asyncio.wait_for(it.__anext__(), min(left, quiet))
        except TimeoutError:
            return
        seen.add(str(m.topic), bytes(m.payload), bool(m.retain), time.monotonic())
