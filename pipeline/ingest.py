"""``pubcomp ingest run``: the cloud broker's readings into the landing zone, durably.

A QoS 2 receiver on the sync/ client with a persistent session, over one or
more connections (``connections``; more than one needs a shared group). The
landing file is the only durable record of a received message: the last line
of every message carries its receive record (session, packet id, QoS, digest
of topic and payload; see ``landing.py``). The order of commits:

1. each connection's reader decodes what arrives; a new message's lines go to
   the group being gathered (rejected messages to ``_rejected``, with the
   reason and the same record), and its PUBREC / PUBACK joins that
   connection's queue of held acknowledgements, tagged with the group;
2. the committer writes the group, every connection's messages together, and
   fsyncs it once: the message and its receive state in one fsync;
3. then it writes each connection's held acknowledgements up to those the
   group covers, in the order their packets arrived (MQTT-4.6.0-2/-3), while
   the readers already gather the next group.

A repeated PUBLISH with an id still held is acknowledged and not written
again (MQTT-4.3.3-2, 5.0 4.3.3-10). PUBREL needs nothing durable: at the next
start the state is rebuilt from the last receive records, and an id found
there is matched by its digest: the broker's resend of a message already
landed is acknowledged without writing it again (a kill between the fsync and
the PUBREC lands nothing twice), while a new message that reuses a released
id differs and is delivered. Nothing is acknowledged before it is on disk.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import json
import logging
import re
import time
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from pubcomp.sync import faults, wire
from pubcomp.sync.backoff import Backoff
from pubcomp.sync.client import BrokerURL, Connection, ConnectOptions, connect
from pubcomp.sync.errors import ConnectionClosed, StoreError
from pubcomp.sync.faults import crash_point
from pubcomp.sync.packets import (
    MQTT_5,
    Disconnect,
    Packet,
    Pingresp,
    Publish,
    Suback,
    Subscribe,
    Subscription,
)
from pubcomp.sync.running import cancel_all, reconnecting, run_until_stopped
from pubcomp.sync.session import Deliver, Forget, Reack, ReceiverSession, Reply, message_digest
from pubcomp.sync.store import held_receive_ids

from .errors import IngestOptionsError
from .landed import AckPublisher, Ledger, Span, span_of
from .landing import RECEIVE_KEY, LandingWriter, rejection_line

log = logging.getLogger(__name__)

# Crash points (sync/faults.py) of the receiving side: ingest_landed (a group holding
# PUBLISHes written and fsynced with their receive records, PUBRECs not yet sent),
# ingest_pubrel_received (PUBREL decoded for a landed message, PUBCOMP not yet sent).
faults.register("ingest_landed", "ingest_pubrel_received")

SUBSCRIBE_ID = 1
# Receive records read back per session at a start. The messages whose release is
# unknown are among the last ones landed, at most the broker's in-flight window
# (our Receive Maximum in 5.0; Mosquitto's max_inflight_messages in 3.1.1): a
# resend found there is recognised. Reading more costs only start-up time.
RECOVER_MESSAGES = 4096


@dataclass
class IngestStats:
    messages: int = 0
    readings: int = 0
    repeats: int = 0  # QoS 2 PUBLISH repeated with a known id: acknowledged, not written
    rejected: collections.Counter[str] = field(default_factory=collections.Counter)
    connections: int = 0
    commits: int = 0  # fsynced groups
    shared_commits: int = 0  # groups that held messages from more than one connection
    recovered_ids: int = 0  # QoS 2 ids rebuilt from the landing files at the start
    last_error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "messages": self.messages,
            "readings": self.readings,
            "repeats": self.repeats,
            "rejected": dict(self.rejected),
            "connections": self.connections,
            "commits": self.commits,
            "shared_commits": self.shared_commits,
            "recovered_ids": self.recovered_ids,
            "last_error": self.last_error,
        }


@dataclass
class _Group:
    """What the next fsync covers, from every connection."""

    lines: list[bytes] = field(default_factory=list)
    rejected: list[bytes] = field(default_factory=list)
    packet_ids: list[int | None] = field(default_factory=list)  # its messages, for the crash marker
    sessions: set[str] = field(default_factory=set)
    spans: list[Span] = field(default_factory=list)  # acknowledged once the group is durable


class _Link:
    """One connection's acknowledgements, held until the group they depend on is durable."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.held: collections.deque[tuple[int, Packet]] = collections.deque()


class Ingest:
    def __init__(
        self,
        broker: str,
        options: ConnectOptions,
        topic: str,
        landing: Path,
        *,
        shared_group: str | None = None,
        connections: int = 1,
        max_file_bytes: int = 64 << 20,
        max_file_age_s: float = 60.0,
        landed_acks: bool = True,
        landed_key: bytes | None = None,
        ack_interval: float = 1.0,
    ) -> None:
        self.url = BrokerURL.parse(broker)
        self.opts = options
        self.topic = f"$share/{shared_group}/{topic}" if shared_group else topic
        if shared_group and options.version != MQTT_5:
            raise IngestOptionsError("shared subscriptions need MQTT 5 (--protocol 5)")
        if connections > 1 and not shared_group:
            raise IngestOptionsError(
                "more than one connection needs a shared group (--shared-group)"
            )
        self.connections = connections
        self.landing = Path(landing)
        writer = options.client_id
        self.readings = LandingWriter(
            self.landing,
            writer,
            max_bytes=max_file_bytes,
            max_age_s=max_file_age_s,
            message_records=True,
        )
        self.rejects = LandingWriter(
            self.landing,
            writer,
            sub="_rejected",
            max_bytes=max_file_bytes,
            max_age_s=60.0,
            message_records=True,  # each rejection line carries its receive record: sealed
        )
        self.validator = wire.validator(wire.CLOUD_SCHEMA)
        self.stats = IngestStats()
        self._sessions: dict[str, ReceiverSession] = {}
        keys = {self._key(i) for i in range(connections)}
        self._recovered = self._recover(keys)
        self._legacy = self._legacy_pending(keys)
        self._group = _Group()
        self._ticket = 1  # the group being gathered
        self._durable = 0  # the last group written and fsynced
        self._links: set[_Link] = set()
        self._wake = asyncio.Event()
        self._stopping = False
        self._committed = asyncio.Event()
        # End to end (issue 24): what is landed is told to the gateways, after the fsync.
        self.ledger = Ledger(ingest_name(options.client_id), interval=ack_interval)
        self.acks = (
            AckPublisher(broker, options, self.ledger, self.topic, master_key=landed_key)
            if landed_acks
            else None
        )

    # ------------------------------------------------------------ state

    def _client_id(self, index: int) -> str:
        return self.opts.client_id if index == 0 else f"{self.opts.client_id}-{index}"

    def _key(self, index: int) -> str:
        return f"{self.url}#{self._client_id(index)}"

    def _recover(self, keys: set[str]) -> dict[str, dict[int, set[str]]]:
        """The QoS 2 ids (and digests) in the last ``RECOVER_MESSAGES`` records a session.

        An id may appear with several digests (reused after a release): a resend that
        matches any of them is a message already landed. Only records that verify are
        read (``LandingWriter.receive_records``: a sealed record whose CRC covers its
        message's lines; the writers' recovery has already cut and quarantined what
        did not verify), so a record whose lines never reached the disk cannot make a
        resend look landed (issue 24)."""
        found: dict[str, dict[int, set[str]]] = {k: {} for k in keys}
        limit = RECOVER_MESSAGES * len(keys)  # records of any session: the read is bounded
        for source in (self.readings, self.rejects):
            for n, rec in enumerate(source.receive_records()):
                if n >= limit:
                    break
                key, pid, digest = rec.get("session"), rec.get("packet_id"), rec.get("digest")
                if key in found and rec.get("qos") == 2 and isinstance(pid, int):
                    found[key].setdefault(pid, set()).add(str(digest))
        self.stats.recovered_ids = sum(len(v) for v in found.values())
        return found

    def _legacy_pending(self, keys: set[str]) -> dict[str, list[int]]:
        """QoS 2 ids a previous version committed to ``_state/ingest-{writer}.db``.

        That version committed an id only after its message had landed, so each is a
        message owned and not yet released. Read once, never written again."""
        db = self.landing / "_state" / f"ingest-{self.opts.client_id}.db"
        if not db.exists():
            return {}
        out: dict[str, list[int]] = {}
        try:
            held = held_receive_ids(db)
        except StoreError as exc:
            log.warning("%s: not read (%s)", db, exc)
            return out
        for key, pid in held:
            if key in keys:
                out.setdefault(key, []).append(pid)
        return out

    def _session(self, index: int, version: int) -> tuple[str, ReceiverSession]:
        key = self._key(index)
        session = self._sessions.get(key)
        if session is None:
            landed = self._recovered.pop(key, {})
            legacy = self._legacy.pop(key, [])
            session = self._sessions[key] = ReceiverSession(version, legacy, landed)
        session.version = version
        return key, session

    # ------------------------------------------------------------ running

    async def run(self, stop: asyncio.Event) -> None:
        committer = asyncio.create_task(self._committer())
        links = [
            asyncio.create_task(self._connection_loop(stop, i)) for i in range(self.connections)
        ]
        if self.acks is not None:
            links.append(asyncio.create_task(self.acks.run(stop)))
        try:
            # Until every link has ended (a stop): whichever task fails first, the
            # committer (a failed write or fsync: nothing held may go out) or a link,
            # raises here, and the rest are stopped below.
            pending = {committer, *links}
            while not all(t.done() for t in links):
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for t in done:
                    t.result()
        finally:
            await cancel_all(links)
            # Never cancelled mid-write: its worker thread would go on writing (or
            # rolling) while the files are closed below. It ends after its round.
            self._stopping = True
            self._wake.set()
            await asyncio.gather(committer, return_exceptions=True)
            self.readings.close()
            self.rejects.close()

    async def _connection_loop(self, stop: asyncio.Event, index: int) -> None:
        await reconnecting(stop, lambda b: self._connection(stop, b, index), self._failed)

    def _failed(self, why: str, _: BaseException) -> None:
        self.stats.last_error = why
        log.warning("ingest from %s: %s", self.url, why)

    async def _connection(self, stop: asyncio.Event, backoff: Backoff, index: int) -> None:
        opts = dataclasses.replace(self.opts, client_id=self._client_id(index))
        conn, connack = await connect(self.url, opts, clean_start=False)
        self.stats.connections += 1
        key, session = self._session(index, conn.version)
        session.on_connack(connack.session_present)
        link = _Link(conn)
        self._links.add(link)
        try:
            await conn.send(Subscribe(SUBSCRIBE_ID, [Subscription(self.topic, qos=2)]))
            backoff.reset()
            while not stop.is_set():
                pkts = await conn.recv_until(stop)
                now = self._handle(link, key, session, pkts)
                if now:
                    await conn.send(*now)
            # Stopping: let the group holding this connection's last messages commit and
            # their acknowledgements go out, then DISCONNECT (keeping the session).
            self._wake.set()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._flushed(link), 10)
        finally:
            self._links.discard(link)
            await conn.close(Disconnect() if stop.is_set() else None)

    async def _flushed(self, link: _Link) -> None:
        while link.held and not link.conn.closed:
            self._committed.clear()
            await self._committed.wait()

    # --------------------------------------------------- one connection's packets

    def _handle(
        self, link: _Link, key: str, session: ReceiverSession, pkts: list[Any]
    ) -> list[Packet]:
        """Gather what arrived into the group, hold the acknowledgements behind it, and
        return the PUBCOMPs, which wait for nothing. No awaits here."""
        now: list[Packet] = []
        received = wire.wire_time()
        group = self._group
        for pkt in pkts:
            if isinstance(pkt, Suback):
                if any(code >= 0x80 for code in pkt.reason_codes):
                    raise ConnectionClosed(f"broker refused the subscription: {pkt.reason_codes}")
                if any(code < 2 for code in pkt.reason_codes):
                    log.warning(
                        "broker granted QoS %s, not 2: duplicates possible", pkt.reason_codes
                    )
                log.info("subscribed to %s", self.topic)
                continue
            if isinstance(pkt, Pingresp):
                continue
            out = session.receive(pkt)
            if isinstance(out, Reack):
                self.stats.repeats += 1
                # Landed before (this run or, matched by its digest, the last): told
                # again once the group that follows is durable, which covers it.
                span = self._span(pkt) if self.acks is not None else None
                if span is not None:
                    group.spans.append(span)
                self._hold(link, out.ack)
            elif isinstance(out, Deliver):
                msg = out.publish
                digest = message_digest(pkt) if msg.qos == 2 else None
                record = {"session": key, "packet_id": msg.packet_id, "qos": msg.qos}
                record["digest"] = digest
                data, n, why, span = self._lines(msg, received, record)
                if span is not None:
                    group.spans.append(span)
                if why is None and span is not None and self.ledger.covers(span):
                    # Every seq already landed (a gateway re-sent it, not having heard):
                    # acknowledged, not written again.
                    self.ledger.stats.already_landed += 1
                elif why is None:
                    group.lines.append(data)
                    self.stats.messages += 1
                    self.stats.readings += n
                else:
                    reason, detail = why
                    self.stats.rejected[reason] += 1
                    group.rejected.append(
                        rejection_line(
                            msg.topic,
                            msg.payload,
                            f"{reason}: {detail}",
                            received,
                            **{RECEIVE_KEY: record},
                        )
                    )
                group.packet_ids.append(msg.packet_id)
                group.sessions.add(key)
                if out.ack is not None:
                    self._hold(link, out.ack)
            elif isinstance(out, Forget):
                # A PUBCOMP depends on no commit (nothing about a release is written),
                # and MQTT-4.6.0-2/-3 order PUBACKs and PUBRECs, not PUBCOMPs: it goes
                # out now rather than after the group being written.
                crash_point("ingest_pubrel_received", f"PUBREL {out.packet_id}")
                now.append(out.ack)
            elif isinstance(out, Reply):
                now.append(out.packet)
            else:
                log.debug("ingest: %s", out.why)
        return now

    def _hold(self, link: _Link, pkt: Packet) -> None:
        # Every PUBACK / PUBREC waits for the group being gathered, even one that needs
        # no write itself (a repeated PUBREC): they never overtake each other.
        link.held.append((self._ticket, pkt))
        self._wake.set()

    # --------------------------------------------------------- the committer

    async def _committer(self) -> None:
        while not self._stopping:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), 1.0)
            self._wake.clear()
            group, self._group = self._group, _Group()
            ticket, self._ticket = self._ticket, self._ticket + 1
            if group.lines or group.rejected:
                await asyncio.to_thread(self._write, group)
                self.stats.commits += 1
                self.stats.shared_commits += len(group.sessions) > 1
            if group.spans:
                self.ledger.add(group.spans, durable=True)
            if group.packet_ids:
                ids = ",".join(str(p) for p in group.packet_ids)
                crash_point("ingest_landed", f"PUBLISH x{len(group.packet_ids)} ids {ids}")
            self._durable = ticket
            for link in list(self._links):
                await self._flush(link)
            self._committed.set()
            if self.readings.roll_due() or self.rejects.roll_due():
                await asyncio.to_thread(self._maybe_roll)

    def _write(self, group: _Group) -> None:
        self.readings.append(group.lines)
        self.rejects.append(group.rejected)

    def _maybe_roll(self) -> None:
        self.readings.maybe_roll()
        self.rejects.maybe_roll()

    async def _flush(self, link: _Link) -> None:
        out = []
        while link.held and link.held[0][0] <= self._durable:
            out.append(link.held.popleft()[1])
        if out and not link.conn.closed:
            with contextlib.suppress(ConnectionClosed):  # its reader sees the close
                await link.conn.send(*out)

    # ------------------------------------------------------------ payloads

    def _span(self, pkt: Publish) -> Span | None:
        try:
            return span_of(pkt.topic, wire.loads(pkt.payload))
        except (ValueError, UnicodeDecodeError):
            return None

    def _lines(
        self, pkt: Publish, received: str, record: dict[str, Any]
    ) -> tuple[bytes, int, tuple[str, str] | None, Span | None]:
        """The message's landing lines (its receive record on the last), how many, or why
        not: a reason (counted) and what exactly (kept in the rejection line); and its
        span of the gateway's store, if it names one (rejected or not, it is landed:
        in ``_rejected``, where it stays for a person to look at)."""
        try:
            msg = wire.loads(pkt.payload)
        except (ValueError, UnicodeDecodeError) as exc:
            return b"", 0, ("not_json", str(exc)), None
        span = span_of(pkt.topic, msg)
        if span is not None:
            # What of the gateway's store the message carried, with the message: where the
            # completeness table finds which of the store's seqs landed (docs/pipeline.md).
            record["outbox"] = {"epoch": span.epoch, "first": span.first, "last": span.last}
        if self.acks is None:
            span = None
        if not _plainly_valid(msg):
            err = next(iter(self.validator.iter_errors(msg)), None)
            if err is not None:
                where = "/".join(str(p) for p in err.absolute_path) or "(top)"
                return b"", 0, ("schema", f"{where}: {err.message}"), span
        gateway = msg["gateway"]
        readings = msg["readings"]
        for r in readings:
            r["gateway"] = gateway
            r["received"] = received
        readings[-1][RECEIVE_KEY] = record
        return _json_lines(readings, received), len(readings), None, span


_dump = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


def _json_lines(readings: list[dict[str, Any]], received: str) -> bytes:
    """One JSON line a reading, from one encoder call for the whole list.

    Each reading ends with its ``received`` (added last, after the schema's seven
    keys), so in the encoded list the text ``"received":"R"},{`` occurs exactly at
    the boundaries between readings: an unescaped quote cannot occur inside a JSON
    string. Replacing the comma there by a newline gives the lines. If the count is
    not what it must be, the readings are encoded one by one."""
    body = _dump(readings)[1:-1]
    end = _dump(received)
    boundary = f'"received":{end}}},{{'
    if body.count(boundary) == len(readings) - 1:
        return body.replace(boundary, f'"received":{end}}}\n{{').encode() + b"\n"
    return "\n".join(map(_dump, readings)).encode() + b"\n"  # pragma: no cover


def _schema_patterns() -> tuple[re.Pattern[str], re.Pattern[str]]:
    """The schema's own patterns (jsonschema applies them with ``re.search``, as here)."""
    text = resources.files("pubcomp.sync").joinpath(f"schemas/{wire.CLOUD_SCHEMA}").read_text()
    props = json.loads(text)["properties"]["readings"]["items"]["properties"]
    return re.compile(props["id"]["pattern"]), re.compile(props["ts"]["pattern"])


_ID, _TS = _schema_patterns()
_TOP_KEYS = frozenset({"v", "gateway", "readings"})
_TOP_KEYS_E2E = _TOP_KEYS | {"outbox"}
_READING_KEYS = frozenset({"id", "origin", "sensor", "ts", "value", "unit", "flags"})
_KINDED_KEYS = _READING_KEYS | {"kind"}  # a counter's or a total's (a gauge's says nothing)


def _plainly_valid(msg: Any) -> bool:
    """True only for a message the cloud schema accepts, checked in plain Python.

    jsonschema takes 85 µs a reading; this takes about 2. It is never more lenient
    than the schema: anything it does not recognise goes to the validator, which
    gives the verdict and the reason.
    """
    if type(msg) is not dict or (msg.keys() != _TOP_KEYS and msg.keys() != _TOP_KEYS_E2E):
        return False
    if "outbox" in msg and not _plain_outbox(msg["outbox"]):
        return False
    v, gateway, readings = msg["v"], msg["gateway"], msg["readings"]
    if type(v) is not int or v != 1 or type(gateway) is not str or not gateway:
        return False
    if type(readings) is not list or not readings:
        return False
    id_ok, ts_ok, keys = _ID.search, _TS.search, _READING_KEYS
    for r in readings:
        if type(r) is not dict:
            return False
        if r.keys() != keys and (r.keys() != _KINDED_KEYS or r["kind"] not in wire.KINDS):
            return False
        rid, origin, sensor, ts = r["id"], r["origin"], r["sensor"], r["ts"]
        value, unit, flags = r["value"], r["unit"], r["flags"]
        if not (
            type(rid) is str
            and id_ok(rid)
            and type(origin) is str
            and origin
            and type(sensor) is str
            and sensor
            and (ts is None or (type(ts) is str and ts_ok(ts)))
            and (value is None or type(value) is float or type(value) is int)
            and (unit is None or type(unit) is str)
            and type(flags) is list
        ):
            return False
        if flags and (any(type(f) is not str for f in flags) or len(set(flags)) != len(flags)):
            return False
    return True


def _plain_outbox(box: Any) -> bool:
    if type(box) is not dict or box.keys() != {"epoch", "first", "last"}:
        return False
    epoch, first, last = box["epoch"], box["first"], box["last"]
    if type(epoch) is not str or not 0 < len(epoch) <= 64:
        return False
    return type(first) is int and type(last) is int and first >= 1 and last < 2**63


def ingest_name(client_id: str) -> str:
    """The ingest's name in its acknowledgements' topic: its client id, made a topic level."""
    return "".join("_" if c in "/+#\x00" else c for c in client_id)[:128] or "ingest"


def run(ingest: Ingest, status: Any = None) -> dict[str, Any]:
    """Run until SIGTERM/SIGINT; returns the run's figures.

    ``status``: the gateways' status messages' receiver (``statusland.StatusLanding``),
    run beside the readings' on its own connection and files."""

    async def work(stop: asyncio.Event) -> None:
        # One fails, all stop (and the process exits, for systemd to restart it): a
        # gather would let the status landing run on alone after the readings' writer
        # died, and the ingest would look alive while it landed nothing.
        try:
            async with asyncio.TaskGroup() as tasks:
                tasks.create_task(ingest.run(stop))
                if status is not None:
                    tasks.create_task(status.run(stop))
        except ExceptionGroup as group:
            raise group.exceptions[0] from None

    started = time.monotonic()
    run_until_stopped(work)
    extra = {"status": status.stats.as_dict()} if status else {}
    extra["landed"] = ingest.ledger.stats.as_dict()
    return {**ingest.stats.as_dict(), **extra, "seconds": round(time.monotonic() - started, 1)}
