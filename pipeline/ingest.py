"""``pubcomp ingest run``: the cloud broker's readings into the landing zone, durably.

A QoS 2 receiver on the sync/ client with a persistent session. For every
group of packets that arrives together:

1. new messages' readings are appended to the landing file and fsynced
   (rejected messages to ``_rejected`` with the reason);
2. the QoS 2 packet ids taken (and those released by PUBREL) are committed in
   one SQLite transaction (``_state/ingest-{client}.db``, the sync/ store's
   ``in_qos2`` table);
3. only then are the PUBRECs / PUBACKs / PUBCOMPs written.

A repeated PUBLISH with a known id is acknowledged and not written again
(MQTT-4.3.3-2). A crash between 1 and 2 means the broker sends the message
again and it lands twice: the pipeline deduplicates by reading id. Never the
other way round: nothing is acknowledged before it is on disk.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import contextlib
import json
import logging
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pubcomp.sync import wire
from pubcomp.sync.client import (
    Backoff,
    BrokerURL,
    ConnectionClosed,
    ConnectOptions,
    ConnectRefused,
    connect,
)
from pubcomp.sync.codec import ProtocolError
from pubcomp.sync.faults import crash_point
from pubcomp.sync.packets import (
    MQTT_5,
    Disconnect,
    Pingresp,
    Publish,
    Pubrel,
    Suback,
    Subscribe,
    Subscription,
)
from pubcomp.sync.session import Forget, Reack, ReceiverSession
from pubcomp.sync.store import Store

from .landing import LandingWriter

log = logging.getLogger(__name__)

SUBSCRIBE_ID = 1


@dataclass
class IngestStats:
    messages: int = 0
    readings: int = 0
    repeats: int = 0  # QoS 2 PUBLISH repeated with a known id: acknowledged, not written
    rejected: collections.Counter[str] = field(default_factory=collections.Counter)
    connections: int = 0
    last_error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "messages": self.messages,
            "readings": self.readings,
            "repeats": self.repeats,
            "rejected": dict(self.rejected),
            "connections": self.connections,
            "last_error": self.last_error,
        }


class Ingest:
    def __init__(
        self,
        broker: str,
        options: ConnectOptions,
        topic: str,
        landing: Path,
        *,
        shared_group: str | None = None,
        max_file_bytes: int = 64 << 20,
        max_file_age_s: float = 60.0,
    ) -> None:
        self.url = BrokerURL.parse(broker)
        self.opts = options
        self.topic = f"$share/{shared_group}/{topic}" if shared_group else topic
        if shared_group and options.version != MQTT_5:
            raise ValueError("shared subscriptions need MQTT 5 (--protocol 5)")
        self.landing = Path(landing)
        writer = options.client_id
        self.readings = LandingWriter(
            self.landing, writer, max_bytes=max_file_bytes, max_age_s=max_file_age_s
        )
        self.rejects = LandingWriter(
            self.landing, writer, sub="_rejected", max_bytes=max_file_bytes, max_age_s=60.0
        )
        state = self.landing / "_state"
        self.store = Store(state / f"ingest-{writer}.db", gateway_id=writer, reserve_bytes=0)
        self.session_key = f"{self.url}#{writer}"
        self.validator = wire.validator(wire.CLOUD_SCHEMA)
        self.stats = IngestStats()

    # ------------------------------------------------------------ running

    async def run(self, stop: asyncio.Event) -> None:
        backoff = Backoff()
        try:
            while not stop.is_set():
                try:
                    await self._connection(stop, backoff)
                except ConnectRefused as exc:
                    self._failed(str(exc))
                except (ConnectionClosed, OSError, TimeoutError, ProtocolError) as exc:
                    self._failed(f"{type(exc).__name__}: {exc}")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), backoff.next_delay())
        finally:
            self.readings.close()
            self.rejects.close()
            self.store.close()

    def _failed(self, why: str) -> None:
        self.stats.last_error = why
        log.warning("ingest from %s: %s", self.url, why)

    async def _connection(self, stop: asyncio.Event, backoff: Backoff) -> None:
        conn, connack = await connect(self.url, self.opts, clean_start=False)
        self.stats.connections += 1
        session = ReceiverSession(conn.version, self.store.qos2_pending(self.session_key))
        session.on_connack(connack.session_present)
        if not connack.session_present:
            self.store.qos2_reset(self.session_key)
        try:
            await conn.send(Subscribe(SUBSCRIBE_ID, [Subscription(self.topic, qos=2)]))
            backoff.reset()
            while not stop.is_set():
                pkts = await self._recv(conn, stop)
                await self._handle(conn, session, pkts)
                self.readings.maybe_roll()
                self.rejects.maybe_roll()
        finally:
            await conn.close(Disconnect() if stop.is_set() else None)

    async def _recv(self, conn: Any, stop: asyncio.Event) -> list[Any]:
        recv = asyncio.ensure_future(conn.recv(1.0))
        stopping = asyncio.ensure_future(stop.wait())
        done, _ = await asyncio.wait({recv, stopping}, return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        if recv in done:
            return recv.result()  # type: ignore[no-any-return]
        recv.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await recv
        return []

    async def _handle(self, conn: Any, session: ReceiverSession, pkts: list[Any]) -> None:
        lines: list[bytes] = []
        rejected: list[bytes] = []
        ops: list[tuple[str, int]] = []  # durable packet-id changes, in arrival order
        replies: list[Any] = []
        received = datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
        for pkt in pkts:
            if isinstance(pkt, Publish):
                out = session.on_publish(pkt)
                if isinstance(out, Reack):
                    self.stats.repeats += 1
                    replies.append(out.ack)
                    continue
                good, why = self._lines(pkt, received)
                if why is None:
                    lines += good
                    self.stats.messages += 1
                    self.stats.readings += len(good)
                else:
                    self.stats.rejected[why.split(":")[0]] += 1
                    rejected.append(_rejection(pkt, why, received))
                if pkt.qos == 2:
                    ops.append(("add", pkt.packet_id))  # type: ignore[arg-type]
                if out.ack is not None:
                    replies.append(out.ack)
            elif isinstance(pkt, Pubrel):
                rel = session.on_pubrel(pkt)
                if isinstance(rel, Forget):
                    ops.append(("del", rel.packet_id))
                    replies.append(rel.ack)
                else:
                    replies.append(rel.packet)
            elif isinstance(pkt, Suback):
                if any(code >= 0x80 for code in pkt.reason_codes):
                    raise ConnectionClosed(f"broker refused the subscription: {pkt.reason_codes}")
                if any(code < 2 for code in pkt.reason_codes):
                    log.warning(
                        "broker granted QoS %s, not 2: duplicates possible", pkt.reason_codes
                    )
                log.info("subscribed to %s", self.topic)
            elif not isinstance(pkt, Pingresp):
                log.debug("ingest: ignoring %s", type(pkt).__name__)
        if lines or rejected:
            await asyncio.to_thread(self._write, lines, rejected)
        crash_point("ingest_landed")
        if ops:
            await asyncio.to_thread(self._commit_ids, ops)
        crash_point("ingest_committed")
        if replies:
            await conn.send(*replies)

    def _write(self, lines: list[bytes], rejected: list[bytes]) -> None:
        self.readings.append(lines)
        self.rejects.append(rejected)

    def _commit_ids(self, ops: list[tuple[str, int]]) -> None:
        with self.store.transaction() as db:
            for op, pid in ops:
                if op == "add":
                    self.store.qos2_record(db, self.session_key, pid)
                else:
                    db.execute(
                        "DELETE FROM in_qos2 WHERE session = ? AND packet_id = ?",
                        (self.session_key, pid),
                    )

    def _lines(self, pkt: Publish, received: str) -> tuple[list[bytes], str | None]:
        try:
            msg = wire.loads(pkt.payload)
        except (ValueError, UnicodeDecodeError) as exc:
            return [], f"not_json: {exc}"
        err = next(iter(self.validator.iter_errors(msg)), None)
        if err is not None:
            where = "/".join(str(p) for p in err.absolute_path) or "(top)"
            return [], f"schema: {where}: {err.message}"
        gateway = msg["gateway"]
        out = []
        for r in msg["readings"]:
            r["gateway"] = gateway
            r["received"] = received
            out.append(json.dumps(r, separators=(",", ":"), ensure_ascii=False).encode() + b"\n")
        return out, None


def _rejection(pkt: Publish, why: str, received: str) -> bytes:
    try:
        payload: str = pkt.payload.decode("utf-8")
        encoding = "utf-8"
    except UnicodeDecodeError:
        payload, encoding = base64.b64encode(pkt.payload).decode(), "base64"
    rec = {
        "received": received,
        "topic": pkt.topic,
        "reason": why,
        "payload": payload[:65536],
        "encoding": encoding,
    }
    return json.dumps(rec, ensure_ascii=False).encode() + b"\n"


def run(ingest: Ingest) -> dict[str, Any]:
    """Run until SIGTERM/SIGINT; returns the run's figures."""
    import signal

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await ingest.run(stop)

    started = time.monotonic()
    asyncio.run(main())
    return {**ingest.stats.as_dict(), "seconds": round(time.monotonic() - started, 1)}
