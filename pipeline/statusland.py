"""The gateways' status messages into the landing zone, beside the readings: ``_status/``.

Run by ``pubcomp ingest run`` next to the readings' receiver, on a connection
of its own (client id ``{client-id}-status``, a persistent session, so the
statuses sent while the ingest was down wait at the broker), subscribed at
QoS 1 to ``{prefix}/+/status``. Nothing of the readings' exactly-once landing
is shared: not the connection, not the files, not the commit (a status is a
QoS 1, latest-value-wins message: a duplicate costs nothing, the pipeline
drops it by its ``id``).

Each message is one line, the message as sent plus ``received`` (the ingest's
UTC time), written and fsynced before its PUBACK, so a status acknowledged is
a status landed. After a power cut the file's unsynced tail may hold torn
lines or holes of zeros: the next start keeps its lines up to the first that
is not a JSON object and quarantines the rest (``landing.verified_length``),
none of which was acknowledged, so the broker delivers it again. A message
that is not a valid ``gateway-status.v1`` goes to ``_rejected/`` with the
reason. Layout (Spark skips the ``_`` folders when it reads the readings)::

    _status/date=YYYY-MM-DD/status-{writer}-{stamp}-{n}.jsonl
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pubcomp.sync import wire
from pubcomp.sync.client import (
    Backoff,
    BrokerURL,
    ConnectionClosed,
    ConnectOptions,
    connect,
)
from pubcomp.sync.packets import (
    Disconnect,
    Packet,
    Puback,
    Publish,
    Suback,
    Subscribe,
    Subscription,
)
from pubcomp.sync.running import reconnecting

from .landing import LandingWriter, rejection_line

log = logging.getLogger(__name__)

STATUS_SCHEMA = "gateway-status.v1.json"
STATUS_DIR = "_status"
DEFAULT_TOPIC = "telemetry/+/status"
SUBSCRIBE_ID = 1


@dataclass
class StatusStats:
    messages: int = 0
    rejected: int = 0
    connections: int = 0
    last_error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class StatusLanding:
    def __init__(
        self,
        broker: str,
        options: ConnectOptions,
        topic: str,
        landing: Path,
        *,
        max_file_bytes: int = 64 << 20,
        max_file_age_s: float = 60.0,
    ) -> None:
        self.url = BrokerURL.parse(broker)
        self.opts = dataclasses.replace(options, client_id=f"{options.client_id}-status")
        self.topic = topic
        # "status-{writer}": no glob of the readings' writer ("{writer}-*") matches it.
        writer = f"status-{options.client_id}"
        self.statuses = LandingWriter(
            Path(landing),
            writer,
            sub=STATUS_DIR,
            max_bytes=max_file_bytes,
            max_age_s=max_file_age_s,
        )
        self.rejects = LandingWriter(Path(landing), writer, sub="_rejected", max_age_s=60.0)
        self.validator = wire.validator(STATUS_SCHEMA)
        self.stats = StatusStats()

    async def run(self, stop: asyncio.Event) -> None:
        try:
            await reconnecting(stop, lambda b: self._connection(stop, b), self._failed)
        finally:
            self.statuses.close()
            self.rejects.close()

    def _failed(self, why: str, _: BaseException) -> None:
        self.stats.last_error = why
        log.warning("status ingest from %s: %s", self.url, why)

    async def _connection(self, stop: asyncio.Event, backoff: Backoff) -> None:
        conn, _ = await connect(self.url, self.opts, clean_start=False)
        self.stats.connections += 1
        try:
            await conn.send(Subscribe(SUBSCRIBE_ID, [Subscription(self.topic, qos=1)]))
            backoff.reset()
            while not stop.is_set():
                pkts = await conn.recv_until(stop)
                acks = await asyncio.to_thread(self._land, pkts)
                if acks:
                    await conn.send(*acks)
                if self.statuses.roll_due() or self.rejects.roll_due():
                    await asyncio.to_thread(self._roll)
        finally:
            await conn.close(Disconnect() if stop.is_set() else None)

    def _roll(self) -> None:
        self.statuses.maybe_roll()
        self.rejects.maybe_roll()

    def _land(self, pkts: list[Any]) -> list[Packet]:
        """Write and fsync what arrived; return the PUBACKs, which may go out now."""
        received = wire.wire_time()
        lines: list[bytes] = []
        bad: list[bytes] = []
        acks: list[Packet] = []
        for pkt in pkts:
            if isinstance(pkt, Publish):
                line, why = self._line(pkt, received)
                if why is None:
                    lines.append(line)
                    self.stats.messages += 1
                else:
                    bad.append(rejection_line(pkt.topic, pkt.payload, why, received))
                    self.stats.rejected += 1
                if pkt.qos >= 1 and pkt.packet_id is not None:
                    acks.append(Puback(pkt.packet_id))
            elif isinstance(pkt, Suback):
                if any(code >= 0x80 for code in pkt.reason_codes):
                    raise ConnectionClosed(f"broker refused the subscription: {pkt.reason_codes}")
                log.info("listening for gateway status on %s", self.topic)
        self.statuses.append(lines)
        self.rejects.append(bad)
        return acks

    def _line(self, pkt: Publish, received: str) -> tuple[bytes, str | None]:
        try:
            msg = wire.loads(pkt.payload)
        except (ValueError, UnicodeDecodeError) as exc:
            return b"", f"not_json: {exc}"
        err = next(iter(self.validator.iter_errors(msg)), None)
        if err is not None:
            where = "/".join(str(p) for p in err.absolute_path) or "(top)"
            return b"", f"schema: {where}: {err.message}"
        msg["received"] = received
        return json.dumps(msg, ensure_ascii=False, separators=(",", ":")).encode() + b"\n", None
