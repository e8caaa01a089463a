"""asyncio MQTT connections: ``mqtt://`` and ``mqtts://``, CONNECT/CONNACK, keepalive.

A ``Connection`` moves packets, nothing more: it does not know about QoS
flows or the store. ``recv()`` returns every packet that arrived in one read,
so the caller can commit a whole group of acknowledgements with one fsync.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from .backoff import Backoff as Backoff  # still importable from here (pipeline/, fleetstatus)
from .codec import Decoder, encode
from .errors import ConnectionClosed as ConnectionClosed
from .errors import ConnectRefused as ConnectRefused
from .errors import ProtocolError
from .packets import (
    MQTT_5,
    MQTT_311,
    Connack,
    Connect,
    Disconnect,
    Packet,
    Pingreq,
    Pingresp,
    Properties,
    Reason,
)

log = logging.getLogger(__name__)

CONNACK_311 = {
    1: "unacceptable protocol version",
    2: "client identifier rejected",
    3: "server unavailable",
    4: "bad user name or password",
    5: "not authorized",
}


@dataclass(frozen=True)
class BrokerURL:
    host: str
    port: int
    tls: bool

    @classmethod
    def parse(cls, url: str) -> BrokerURL:
        parts = urlsplit(url if "://" in url else f"mqtt://{url}")
        if parts.scheme not in ("mqtt", "mqtts", "tcp", "ssl"):
            raise ValueError(f"broker URL {url!r}: scheme must be mqtt:// or mqtts://")
        if parts.username or parts.password:
            raise ValueError(
                f"broker URL {url!r}: put no credentials in the URL; use --username "
                "and --password-file"
            )
        tls = parts.scheme in ("mqtts", "ssl")
        if not parts.hostname:
            raise ValueError(f"broker URL {url!r} has no host")
        return cls(parts.hostname, parts.port or (8883 if tls else 1883), tls)

    def __str__(self) -> str:
        return f"{'mqtts' if self.tls else 'mqtt'}://{self.host}:{self.port}"


@dataclass
class TLSOptions:
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    insecure: bool = False  # skip host name checks (test brokers only)

    def context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=self.ca_file)
        if self.cert_file:
            ctx.load_cert_chain(self.cert_file, self.key_file)
        if self.insecure:
            ctx.check_hostname = False
        return ctx


@dataclass
class ConnectOptions:
    client_id: str
    version: int = MQTT_5
    keepalive: int = 30
    username: str | None = None
    password_file: str | None = None
    tls: TLSOptions = field(default_factory=TLSOptions)
    session_expiry: int = 7 * 24 * 3600  # MQTT 5: how long the broker keeps our session
    receive_maximum: int = 100  # MQTT 5: QoS>0 PUBLISHes we accept at once
    maximum_packet_size: int = 1 << 20
    connect_timeout: float = 10.0
    password_text: str | None = field(default=None, repr=False)  # from the fleet file's !secret

    def password(self) -> bytes | None:
        if self.password_text is not None:
            return self.password_text.encode()
        if self.password_file is None:
            return None
        return Path(self.password_file).read_bytes().rstrip(b"\r\n")


class Connection:
    """One MQTT network connection, after a successful CONNACK."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        version: int,
        keepalive: int,
        max_packet_size: int,
    ) -> None:
        self._reader = reader
        self._writer = writer
        self.version = version
        self.keepalive = keepalive
        self._decoder = Decoder(version, max_packet_size)
        self._last_sent = time.monotonic()
        self._last_received = time.monotonic()
        self._ready: list[Packet] = []
        self.closed = False
        self.broker_max_packet_size: int | None = None

    async def send(self, *packets: Packet) -> None:
        """Write packets and wait until the kernel has taken them."""
        if self.closed:
            raise ConnectionClosed("connection is closed")
        data = b"".join(encode(p, self.version) for p in packets)
        try:
            self._writer.write(data)
            await self._writer.drain()
        except (ConnectionError, OSError) as exc:
            self.closed = True
            raise ConnectionClosed(str(exc)) from exc
        self._last_sent = time.monotonic()

    async def recv_until(
        self, stop: asyncio.Event, timeout: float = 1.0, *also: asyncio.Event
    ) -> list[Packet]:
        """``recv(timeout)``, or [] as soon as ``stop`` (or one of ``also``: work to do
        meanwhile) is set (receivers that stop cleanly)."""
        recv = asyncio.ensure_future(self.recv(timeout))
        events = [asyncio.ensure_future(e.wait()) for e in (stop, *also)]
        done, _ = await asyncio.wait({recv, *events}, return_when=asyncio.FIRST_COMPLETED)
        for e in events:
            e.cancel()
        if recv in done:
            return recv.result()
        recv.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await recv
        return []

    async def recv(self, timeout: float | None = None) -> list[Packet]:
        """Packets that arrived, at least one unless ``timeout`` passed (then [])."""
        if self._ready:
            out, self._ready = self._ready, []
            return out
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            wait = self._next_wakeup(deadline)
            try:
                # Not asyncio.wait_for: on Python 3.11 it runs the read as a separate
                # task, and a cancellation (the uplink cancels recv whenever new
                # readings arrive) landing just as the read completes drops the bytes
                # read: PUBRECs lost and messages stuck in flight. Under a timeout
                # scope the read runs in this task, and a cancellation leaves unread
                # data in the stream's buffer.
                async with asyncio.timeout(wait):
                    data = await self._reader.read(65536)
            except TimeoutError:
                data = None
            except (ConnectionError, OSError) as exc:
                self.closed = True
                raise ConnectionClosed(str(exc)) from exc
            now = time.monotonic()
            if data is None:
                await self._keepalive(now)
                if deadline is not None and now >= deadline:
                    return []
                continue
            if not data:
                self.closed = True
                raise ConnectionClosed("broker closed the connection")
            self._last_received = now
            try:
                pkts = self._decoder.feed(data)
            except ProtocolError:
                await self.close()  # MQTT-4.8.0-1
                raise
            for p in pkts:
                if isinstance(p, Disconnect):
                    self.closed = True
                    raise ConnectionClosed(f"broker sent DISCONNECT (reason {p.reason_code:#04x})")
            # Kept before the next await: a cancelled caller must not lose packets.
            self._ready.extend(p for p in pkts if not isinstance(p, Pingresp))
            await self._keepalive(now)
            if self._ready:
                out, self._ready = self._ready, []
                return out

    def _next_wakeup(self, deadline: float | None) -> float | None:
        waits = []
        if self.keepalive:
            waits.append(self._last_sent + self.keepalive * 0.75 - time.monotonic())
        if deadline is not None:
            waits.append(deadline - time.monotonic())
        return max(0.0, min(waits)) if waits else None

    async def _keepalive(self, now: float) -> None:
        if not self.keepalive:
            return
        if now - self._last_received > self.keepalive * 1.5:
            await self.close()
            raise ConnectionClosed("keepalive timeout: no packet from the broker")
        if now - self._last_sent >= self.keepalive * 0.75:
            await self.send(Pingreq())

    async def close(self, disconnect: Disconnect | None = None) -> None:
        if self.closed and disconnect is None:
            with contextlib.suppress(Exception):
                self._writer.close()
            return
        if disconnect is not None and not self.closed:
            with contextlib.suppress(ConnectionClosed):
                await self.send(disconnect)
        self.closed = True
        with contextlib.suppress(Exception):
            self._writer.close()
            await asyncio.wait_for(self._writer.wait_closed(), 2)


async def connect(
    url: BrokerURL, opts: ConnectOptions, *, clean_start: bool, session_expiry: int | None = None
) -> tuple[Connection, Connack]:
    """Open a connection and complete CONNECT/CONNACK; raise ConnectRefused on a refusal.

    ``session_expiry`` (MQTT 5) overrides the options' value, e.g. 0 for a
    connection that only clears a stale session.
    """
    ctx = opts.tls.context() if url.tls else None
    reader, writer = await asyncio.wait_for(
        asyncio.open_connection(url.host, url.port, ssl=ctx, limit=1 << 20), opts.connect_timeout
    )
    props: Properties = {}
    if opts.version == MQTT_5:
        props = {
            "session_expiry_interval": (
                opts.session_expiry if session_expiry is None else session_expiry
            ),
            "receive_maximum": opts.receive_maximum,
            "maximum_packet_size": opts.maximum_packet_size,
        }
    conn = Connection(reader, writer, opts.version, opts.keepalive, opts.maximum_packet_size)
    pkt = Connect(
        opts.client_id,
        opts.version,
        clean_start,
        opts.keepalive,
        opts.username,
        opts.password(),
        None,
        props,
    )
    try:
        await conn.send(pkt)
        first = await asyncio.wait_for(conn.recv(), opts.connect_timeout)
    except BaseException:
        await conn.close()
        raise
    connack = first[0]
    conn._ready = first[1:]
    if not isinstance(connack, Connack):
        await conn.close()
        raise ProtocolError(f"expected CONNACK, got {type(connack).__name__}")
    if connack.reason_code:
        await conn.close()
        if opts.version == MQTT_311:
            raise ConnectRefused(connack.reason_code, CONNACK_311.get(connack.reason_code, "?"))
        try:
            name = Reason(connack.reason_code).name.lower().replace("_", " ")
        except ValueError:
            name = "unknown reason"
        text = connack.properties.get("reason_string") or name
        raise ConnectRefused(connack.reason_code, text)
    if "server_keep_alive" in connack.properties:
        conn.keepalive = connack.properties["server_keep_alive"]
    conn.broker_max_packet_size = connack.properties.get("maximum_packet_size")
    return conn, connack
