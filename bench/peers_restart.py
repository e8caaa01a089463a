"""Restarts at the QoS 2 break points: pubcomp's uplink against paho-mqtt and aiomqtt.

Issue 17 asked for a figure behind the README's claim that the libraries "lose
or duplicate data" across a restart. Each system publishes the same N readings,
one per message at QoS 2, to its own real Mosquitto (devkit/broker.py) through a
proxy that reads the MQTT packet types going by and SIGKILLs the publisher at a
break point of the handshake, always at a packet boundary:

- ``publish_sent``: the publisher's n-th PUBLISH is forwarded to the broker, then
  the publisher is killed (the broker holds the message, nobody has its PUBREC);
- ``pubrec_received``: the publisher has read a PUBREC and answers with PUBREL; it
  is killed as that PUBREL reaches the proxy, which drops it (the broker still
  waits for the release);
- ``pubcomp_due``: the broker answers the n-th PUBREL with PUBCOMP; the publisher
  is killed instead of receiving it (the broker has released the message to its
  subscribers, the publisher was never told).

Killing from the proxy, not at a random time, is what makes the run repeatable:
the same seed gives the same points and the same counts of packets before each
kill for every system. After each kill the publisher is started again, and once
the schedule is spent it runs unharmed until it says it is done.

The peers get the best persistence their libraries allow, since both keep QoS 2
state in memory only: a persistent session (MQTT 5: Clean Start 0 and a Session
Expiry; 3.1.1: CleanSession 0), a fixed client id, and an application outbox
file beside the process (the readings, and a log of the ids whose publish
completed: paho's ``on_publish``, aiomqtt's awaited ``publish``). A restarted
peer publishes again every reading not in that log. pubcomp's row is ``pubcomp
uplink run`` on a store filled with the same number of readings, one per message
(``--batch 1``), through the same proxy and schedule. The peers keep ``--window``
messages in flight (20, Mosquitto's Receive Maximum; 1 awaits each in turn).

A run is a stall when the checker gets no new message for ``--run-timeout``
seconds: the publisher is killed, the schedule ends, one unharmed run is tried.

An independent paho-mqtt subscriber (devkit/checker.py: QoS 2, persistent
session) counts every copy of every reading id. Printed per system: published,
delivered distinct, lost, duplicated, the share delivered exactly once and its
ratio to pubcomp's, kills made at each point, and Mosquitto's "Reused message
ID" warnings (a restarted client handing out a packet id the broker still holds).

    python bench/peers_restart.py [--readings 600 --kills 12 --seed 17 --protocol 5]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import queue
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # devkit/ runs from the checkout

import paho.mqtt.client as mqtt  # noqa: E402
from paho.mqtt.packettypes import PacketTypes  # noqa: E402
from paho.mqtt.properties import Properties  # noqa: E402

from devkit.broker import Mosquitto, mosquitto_binary  # noqa: E402
from devkit.checker import Checker  # noqa: E402
from devkit.link import Forwarder  # noqa: E402
from devkit.store_helpers import append  # noqa: E402

PUBLISH, PUBREC, PUBREL, PUBCOMP = 3, 5, 6, 7
UP, DOWN = "publisher -> broker", "broker -> publisher"
SYSTEMS = ("pubcomp", "paho", "aiomqtt")
SESSION_EXPIRY_S = 3600
RECONNECT_S = 0.05  # both peers reconnect at once after a drop (paho's delay from here, doubling)
WINDOW = 20  # messages in flight: paho's default, Mosquitto's Receive Maximum


@dataclass(frozen=True)
class BreakPoint:
    direction: str
    packet_type: int
    kill_first: bool  # True: the packet is never forwarded; False: forwarded, then the kill


POINTS = {
    "publish_sent": BreakPoint(UP, PUBLISH, kill_first=False),
    "pubrec_received": BreakPoint(UP, PUBREL, kill_first=True),
    "pubcomp_due": BreakPoint(DOWN, PUBCOMP, kill_first=True),
}


# ---------------------------------------------------------------- the killing proxy


def packet_length(buf: bytes | bytearray) -> int | None:
    """Length of the whole MQTT packet at the start of ``buf``, None while incomplete."""
    value, shift = 0, 0
    for i in range(1, min(len(buf), 5)):
        value |= (buf[i] & 0x7F) << shift
        if not buf[i] & 0x80:
            return 1 + i + value if len(buf) >= 1 + i + value else None
        shift += 7
    return None


class KillProxy(Forwarder):
    """A TCP forwarder between one publisher and its broker that moves whole MQTT
    packets and SIGKILLs the publisher at the n-th packet of one type."""

    def __init__(self, target_port: int) -> None:
        self._lock = threading.Lock()
        self._victim: subprocess.Popen[Any] | None = None
        self._point: BreakPoint | None = None
        self._left = 0
        self._generation = 0  # one per arm(): a connection only counts in its own
        self.fired = False
        self._conns: list[socket.socket] = []
        super().__init__(target_port, name="kill-proxy")

    def arm(self, victim: subprocess.Popen[Any], point: BreakPoint | None, nth: int) -> None:
        with self._lock:
            self._victim, self._point, self._left, self.fired = victim, point, nth, False
            self._generation += 1

    def _join(self, client: socket.socket, upstream: socket.socket) -> None:
        for s in (client, upstream):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self._lock:
            self._conns += [client, upstream]
            generation = self._generation
        pair = (client, upstream)
        for src, dst, direction in ((client, upstream, UP), (upstream, client, DOWN)):
            threading.Thread(
                target=self._pump, args=(src, dst, direction, pair, generation), daemon=True
            ).start()

    def _pump(
        self,
        src: socket.socket,
        dst: socket.socket,
        direction: str,
        pair: tuple[socket.socket, socket.socket],
        generation: int,
    ) -> None:
        buf = bytearray()
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                buf += data
                while (n := packet_length(buf)) is not None:
                    packet, buf = bytes(buf[:n]), buf[n:]
                    if not self._forward(packet, dst, direction, pair, generation):
                        return
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def _forward(
        self,
        packet: bytes,
        dst: socket.socket,
        direction: str,
        pair: tuple[socket.socket, socket.socket],
        generation: int,
    ) -> bool:
        # One lock for both directions: once the kill is decided, nothing more of this
        # connection moves either way, so the broker sees exactly the packets before it.
        # A connection of a killed publisher moves nothing after the next arm(): its
        # late packets must not count towards the next run's kill.
        with self._lock:
            if self.fired or generation != self._generation:
                return False
            hit = False
            p = self._point
            if p is not None and p.direction == direction and packet[0] >> 4 == p.packet_type:
                self._left -= 1
                hit = self._left == 0
            if hit and p is not None and p.kill_first:
                self._kill(pair)
                return False
            dst.sendall(packet)
            if hit:
                self._kill(pair)
                return False
            return True

    def _kill(self, pair: tuple[socket.socket, socket.socket]) -> None:
        self.fired = True
        if self._victim is not None:
            self._victim.kill()
        for s in pair:
            # shutdown, not only close: another thread is blocked in recv on it, and a
            # close alone would leave the broker's side open until its keepalive ran out.
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                s.close()

    def close(self) -> None:
        super().close()
        with self._lock:
            for s in self._conns:
                with contextlib.suppress(OSError):
                    s.close()


# ---------------------------------------------------------------- the peer publishers


def outbox_pending(work: Path) -> list[dict[str, Any]]:
    """The application's outbox: every reading, less those whose publish completed."""
    done = set((work / "done.log").read_text().split()) if (work / "done.log").exists() else set()
    lines = (work / "outbox.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["id"] not in done]


def payload(reading: dict[str, Any]) -> bytes:
    # Built from the outbox line alone, so a reading published again is byte-identical.
    return json.dumps({"v": 1, "gateway": "peer", "readings": [reading]}).encode()


def connect_properties(protocol: int) -> Properties | None:
    if protocol != 5:
        return None
    props = Properties(PacketTypes.CONNECT)
    props.SessionExpiryInterval = SESSION_EXPIRY_S
    return props


def run_paho(port: int, work: Path, client_id: str, protocol: int, window: int) -> None:
    pending = outbox_pending(work)
    by_id = {r["id"]: r for r in pending}
    done_fd = os.open(work / "done.log", os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    lock = threading.Lock()
    ids: dict[int, str] = {}
    early: dict[int, bool] = {}  # mid -> failed, for completions that beat the mid's record
    todo: queue.Queue[dict[str, Any] | None] = queue.Queue()
    left = [len(pending)]

    def completed(reading_id: str, failed: bool) -> None:
        if failed:
            # MQTT 5: a PUBCOMP >= 0x80 says the message was not taken, so the reading
            # goes out again. (A PUBREC 0x97 is what Mosquitto sends when it drops one;
            # paho does not read it, and the PUBCOMP that follows says 0x00: that loss
            # is invisible to the application.)
            todo.put(by_id[reading_id])
            return
        # One write(2) per line: a SIGKILL leaves the line whole or absent. No fsync:
        # the kills here keep the page cache, and the peer is not charged for one.
        os.write(done_fd, f"{reading_id}\n".encode())
        left[0] -= 1
        if left[0] == 0:
            todo.put(None)

    def on_publish(client: Any, userdata: Any, mid: int, reason: Any, props: Any) -> None:
        # paho calls this under its own lock, the one publish() takes: so ``lock`` is
        # never held around publish(), and a completion that beats the mid's record
        # waits in ``early`` until the record is made.
        with lock:
            if mid in ids:
                completed(ids.pop(mid), reason.is_failure)
            else:
                early[mid] = reason.is_failure

    if protocol == 5:
        client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id, protocol=mqtt.MQTTv5)
    else:
        client = mqtt.Client(
            mqtt.CallbackAPIVersion.VERSION2, client_id, clean_session=False,
            protocol=mqtt.MQTTv311,
        )  # fmt: skip
    client.on_publish = on_publish
    # paho's annotation says int; the delays are seconds as floats.
    client.reconnect_delay_set(cast(int, RECONNECT_S), cast(int, 0.5))
    client.max_inflight_messages_set(window)
    client.max_queued_messages_set(0)
    connected = threading.Event()
    client.on_connect = lambda *a: connected.set()
    if protocol == 5:
        client.connect(
            "127.0.0.1", port, clean_start=False, properties=connect_properties(protocol)
        )
    else:
        client.connect("127.0.0.1", port)
    client.loop_start()
    if not connected.wait(10):
        sys.exit("paho publisher: no CONNACK")
    for reading in pending:
        todo.put(reading)
    if not pending:
        todo.put(None)
    while (r := todo.get()) is not None:
        info = client.publish("peers/paho/readings", payload(r), qos=2)
        with lock:
            if info.mid in early:
                completed(r["id"], early.pop(info.mid))
            else:
                ids[info.mid] = r["id"]
    client.disconnect()
    client.loop_stop()


async def run_aiomqtt(port: int, work: Path, client_id: str, protocol: int, window: int) -> None:
    import logging

    import aiomqtt

    pending = outbox_pending(work)
    done_fd = os.open(work / "done.log", os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    done: set[str] = set()
    version = aiomqtt.ProtocolVersion.V5 if protocol == 5 else aiomqtt.ProtocolVersion.V311
    session: dict[str, Any] = (
        {"clean_start": False, "properties": connect_properties(5)}
        if protocol == 5
        else {"clean_session": False}
    )

    async def one(client: aiomqtt.Client, slots: asyncio.Semaphore, r: dict[str, Any]) -> None:
        async with slots:
            await client.publish("peers/aiomqtt/readings", payload(r), qos=2, timeout=60)
        os.write(done_fd, f"{r['id']}\n".encode())  # done: the awaited publish returned
        done.add(r["id"])

    async def watch(client: aiomqtt.Client) -> None:
        # A publish waiting for its PUBCOMP is not woken when the connection drops;
        # the message iterator is aiomqtt's public way to hear of it.
        async for _ in client.messages:
            pass

    while todo := [r for r in pending if r["id"] not in done]:
        try:
            async with aiomqtt.Client(
                "127.0.0.1", port, identifier=client_id, protocol=version,
                max_inflight_messages=window, logger=logging.getLogger("peer"), **session,
            ) as client, asyncio.TaskGroup() as tasks:  # fmt: skip
                watcher = tasks.create_task(watch(client))
                slots = asyncio.Semaphore(window)
                await asyncio.gather(*(tasks.create_task(one(client, slots, r)) for r in todo))
                watcher.cancel()
        except (aiomqtt.MqttError, ExceptionGroup):
            # aiomqtt does not reconnect by itself: the application connects again.
            # The readings not yet done are published again under new packet ids (the
            # new client object starts its ids at 1 again; a client object reused after
            # a dropped socket spun on a closed descriptor here).
            await asyncio.sleep(RECONNECT_S)


# ---------------------------------------------------------------- one system, one run


@dataclass
class Row:
    system: str
    published: int = 0
    delivered: int = 0
    lost: int = 0
    duplicated: int = 0  # extra copies
    copied: int = 0  # readings delivered more than once
    kills: dict[str, int] = field(default_factory=dict)
    stalls: int = 0  # runs that neither finished nor reached their kill within --run-timeout
    finished: bool = False  # the last, unharmed run said every reading was done
    reused_ids: int = 0
    note: str | None = None  # what the checker needed (settle)
    seconds: float = 0.0

    @property
    def exactly_once(self) -> float:
        return (self.delivered - self.copied) / max(self.published, 1)


def schedule(args: argparse.Namespace) -> list[tuple[str, int]]:
    """The kills every system gets: (point, the n-th packet of its type in that run)."""
    rng = random.Random(args.seed)
    names = list(POINTS)
    return [(names[i % len(names)], rng.randint(1, args.max_nth)) for i in range(args.kills)]


def publisher_cmd(system: str, port: int, work: Path, args: argparse.Namespace) -> list[str]:
    if system == "pubcomp":
        return [
            sys.executable, "-m", "pubcomp", "uplink", "run", "--store", str(work / "gw.db"),
            "--broker", f"mqtt://127.0.0.1:{port}", "--client-id", "peers-pubcomp",
            "--protocol", "5" if args.protocol == 5 else "3.1.1", "--batch", "1",
            "--keepalive", "5", "--topic-prefix", "peers", "--exit-when-drained",
            "--no-end-to-end",  # the QoS 2 hop, as the peers do it: no ingest here
        ]  # fmt: skip
    return [
        sys.executable, __file__, "--publisher", system, "--port", str(port),
        "--work", str(work), "--protocol", str(args.protocol), "--window", str(args.window),
    ]  # fmt: skip


def prepare(system: str, work: Path, n: int) -> set[str]:
    """The N readings, in the system's own outbox; returns their ids."""
    if system == "pubcomp":
        from pubcomp.sync.store import Reading, Store

        # One reading per append: the store packs an append into one row, and rows are
        # never split between messages, so --batch 1 then means one reading per message.
        with Store(work / "gw.db", gateway_id="peers") as store:
            seqs = [
                append(store, [Reading(f"s{i % 7}", float(i), "2026-11-24T00:00:00.000Z", "C")])[0]
                for i in range(n)
            ]
            return {f"peers/{store.epoch}/{seq}" for seq in seqs}
    rows = [
        {"id": f"{system}/{i}", "origin": system, "sensor": f"s{i % 7}",
         "ts": f"2026-11-24T00:00:{i % 60:02d}.000Z", "value": float(i), "unit": "C",
         "flags": []}
        for i in range(n)
    ]  # fmt: skip
    (work / "outbox.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {str(r["id"]) for r in rows}


def settle(checker: Checker, port: int, tag: str, quiet: float = 10.0) -> str | None:
    """Wait until a marker published after the last run has reached the checker: the
    broker queues to one subscriber in order, so everything released before it is in.
    Returns a note when the checker had to be reconnected or never got the marker."""
    marker = f"marker/{tag}"
    body = {"readings": [{"id": marker, "sensor": "-", "ts": None, "value": None}]}
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, f"marker-{tag}")
    client.connect("127.0.0.1", port)
    client.loop_start()
    client.publish("peers/marker", json.dumps(body), qos=2).wait_for_publish(10)
    note = None
    for attempt in range(2):
        seen, progress_at = -1, time.monotonic()
        while marker not in checker.snapshot() and time.monotonic() - progress_at < quiet:
            if checker.messages != seen:
                seen, progress_at = checker.messages, time.monotonic()
            time.sleep(0.01)
        if marker in checker.snapshot():
            break
        if attempt == 0:
            # Seen after many paho restarts: Mosquitto stopped sending to the checker.
            # A new connection of its session makes the broker resend what it holds.
            note = f"the checker got nothing for {quiet:g} s and was reconnected"
            subscribed = checker.subscriptions
            checker.client.disconnect()
            checker.client.reconnect()
            checker.wait_subscribed(subscribed)
        else:
            note = f"the checker never got the marker: counts as of {checker.messages} messages"
    client.disconnect()
    client.loop_stop()
    return note


def run_system(system: str, args: argparse.Namespace, base: Path) -> Row:
    work = base / system
    work.mkdir()
    broker = Mosquitto(work / "broker").start()
    proxy = KillProxy(broker.port)
    checker = Checker(broker.port, "peers/#", client_id=f"checker-{system}").start()
    row = Row(system, kills={p: 0 for p in POINTS})
    expected = prepare(system, work, args.readings)
    row.published = len(expected)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PUBCOMP_CRASH")}
    log = (work / "publisher.log").open("a")
    t0 = time.monotonic()

    def run_once(point: str | None, nth: int) -> int:
        proc = subprocess.Popen(
            publisher_cmd(system, proxy.port, work, args), env=env, stdout=log, stderr=log
        )
        proxy.arm(proc, POINTS[point] if point else None, nth)
        started = time.monotonic()
        seen, progress_at = checker.messages, started
        while (rc := proc.poll()) is None:
            # A stall is no new message at the checker for --run-timeout seconds: a long
            # unharmed run is progress, a client refused at every reconnection is not.
            if checker.messages != seen:
                seen, progress_at = checker.messages, time.monotonic()
            elif time.monotonic() - progress_at > args.run_timeout:
                proc.kill()
                row.stalls += 1
                rc = proc.wait()
                break
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(0.1)
        if args.verbose:
            print(f"  {system}: {point or 'unharmed'}:{nth} rc {rc} fired {proxy.fired} "
                  f"{time.monotonic() - started:.2f} s", file=sys.stderr)  # fmt: skip
        return rc

    try:
        for point, nth in schedule(args):
            rc = run_once(point, nth)
            if proxy.fired:
                row.kills[point] += 1
            elif row.stalls:
                break  # stuck: the same session would be stuck at every restart
            elif rc == 0:
                break  # everything went through before this kill's packet came
        for _ in range(1 if row.stalls else 3):  # then unharmed, until it says it is done
            if run_once(None, 0) == 0:
                row.finished = True
                break
        row.seconds = time.monotonic() - t0
        row.note = settle(checker, broker.port, system)
        snapshot = checker.snapshot()
    finally:
        checker.stop()
        proxy.close()
        broker.kill()
        log.close()
    counts = {k: n for k, n in snapshot.items() if not k.startswith("marker/")}
    row.delivered = len(expected & counts.keys())
    row.lost = len(expected - counts.keys())
    row.duplicated = sum(n - 1 for k, n in counts.items() if k in expected and n > 1)
    row.copied = sum(1 for k, n in counts.items() if k in expected and n > 1)
    row.reused_ids = broker.log().count("Reused message ID")
    return row


# ---------------------------------------------------------------- main


def print_table(rows: list[Row], args: argparse.Namespace) -> None:
    version = subprocess.run([mosquitto_binary(), "-h"], capture_output=True, text=True).stdout
    print(f"\n{args.readings:,} readings per system, one per QoS 2 message, MQTT "
          f"{'5' if args.protocol == 5 else '3.1.1'}, {args.kills} kills (seed {args.seed}), "
          f"peers' window {args.window}; "
          f"{version.splitlines()[0] if version else 'mosquitto'}\n")  # fmt: skip
    ours = next((r for r in rows if r.system == "pubcomp"), None)
    head = ("system", "published", "delivered", "lost", "duplicated", "exactly once",
            "ratio to pubcomp", "kills (sent/rec/comp)", "reused ids", "seconds")  # fmt: skip
    print(f"{head[0]:<10} {head[1]:>10} {head[2]:>10} {head[3]:>6} {head[4]:>11} {head[5]:>13} "
          f"{head[6]:>17} {head[7]:>22} {head[8]:>11} {head[9]:>8}")  # fmt: skip
    for r in rows:
        ratio = f"{r.exactly_once / ours.exactly_once:.3f}" if ours and ours.exactly_once else "-"
        kills = "/".join(str(r.kills[p]) for p in POINTS)
        print(f"{r.system:<10} {r.published:>10,} {r.delivered:>10,} {r.lost:>6,} "
              f"{r.duplicated:>11,} {r.exactly_once:>12.1%} {ratio:>17} {kills:>22} "
              f"{r.reused_ids:>11} {r.seconds:>8.1f}")  # fmt: skip
        if r.note:
            print(f"{'':<10} {r.note}")
        if r.stalls or not r.finished:
            print(f"{'':<10} stalled: {r.stalls} run(s) made no progress for "
                  f"{args.run_timeout:g} s and were killed; "
                  f"{'finished' if r.finished else 'never finished'}")  # fmt: skip
    if ours:
        for r in rows:
            if r is not ours:
                bad = r.lost + r.duplicated
                print(f"ratio: {r.system} lost or duplicated {bad:,} readings, pubcomp "
                      f"{ours.lost + ours.duplicated:,}")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--readings", type=int, default=600, help="readings per system")
    ap.add_argument("--kills", type=int, default=12, help="SIGKILLs per system, points in turn")
    ap.add_argument("--max-nth", type=int, default=40,
                    help="a kill comes at the n-th packet of its type, n in 1..this")  # fmt: skip
    ap.add_argument("--seed", type=int, default=17)
    ap.add_argument("--protocol", type=int, choices=(4, 5), default=5, help="4 is MQTT 3.1.1")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--window", type=int, default=WINDOW,
                    help="the peers' messages in flight (1: await each in turn)")  # fmt: skip
    ap.add_argument("--run-timeout", type=float, default=10.0,
                    help="seconds with no new message at the checker: a stall")  # fmt: skip
    ap.add_argument("--verbose", action="store_true", help="a line per publisher run")
    ap.add_argument("--keep", action="store_true", help="keep the work directory (logs)")
    # The publisher side, run by the bench itself as a subprocess.
    ap.add_argument("--publisher", choices=("paho", "aiomqtt"), help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.publisher == "paho":
        run_paho(args.port, args.work, "peers-paho", args.protocol, args.window)
        return
    if args.publisher == "aiomqtt":
        asyncio.run(run_aiomqtt(args.port, args.work, "peers-aiomqtt", args.protocol, args.window))
        return
    base = Path(tempfile.mkdtemp(prefix="peers-restart-"))
    rows = []
    try:
        for system in args.systems.split(","):
            print(f"{system} ...", file=sys.stderr, flush=True)
            rows.append(run_system(system, args, base))
    finally:
        if args.keep:
            print(f"work directory: {base}", file=sys.stderr)
        else:
            shutil.rmtree(base, ignore_errors=True)
    print_table(rows, args)


if __name__ == "__main__":
    main()
