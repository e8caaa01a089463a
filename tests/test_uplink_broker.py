"""Broker restarts and connection cuts, against a real Mosquitto."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import random
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from devkit.broker import Mosquitto
from devkit.checker import Checker, exactly_once_report
from devkit.uplink_helpers import (
    communicate_while,
    fill_store,
    run_uplink,
    start_uplink,
    store_states,
    summary,
)
from pubcomp.sync.store import Store


def _wait_for_inflight(store: Path, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if store_states(store):
            return
        time.sleep(0.005)
    raise AssertionError("the uplink never had a message in flight")


def _settle(checker: Checker, quiet: float = 2.0) -> None:
    """Wait until the checker has stopped receiving (the broker has delivered all it will).

    Which of the frozen uplink's in-flight PUBLISHes reached the broker is not known, so
    quiet is the sign; 2 s of it, since a busy machine can pause the broker or the
    checker for half a second (what it still held for the checker would be lost with a
    broker that keeps nothing, and counted against the uplink)."""
    last, since = -1, time.monotonic()
    while time.monotonic() - since < quiet:
        n = sum(checker.snapshot().values())
        if n != last:
            last, since = n, time.monotonic()
        time.sleep(0.05)


@dataclass
class RestartRun:
    counts: collections.Counter[str]
    expected: set[str]
    stderr: str
    inflight_at_restart: int
    resent: int


def restart_broker_under_uplink(tmp_path: Path, broker: Mosquitto, protocol: str) -> RestartRun:
    """Drain 30,000 readings; freeze the uplink (SIGSTOP) with messages in flight, let the
    checker catch up, stop the broker gracefully and start it again, then let the uplink
    go on (SIGCONT), once the checker has subscribed again, to the end. The freeze keeps
    the checker's own loss window (messages the broker held for it, or published before
    it was subscribed again) out of the result."""
    checker = Checker(broker.port, "telemetry/#").start()
    store = tmp_path / "gw.db"
    expected = fill_store(store, 30_000)
    proc = start_uplink(
        store, broker.url, "--protocol", protocol, "--batch", "5", "--exit-when-drained"
    )
    try:
        _wait_for_inflight(store)
        proc.send_signal(signal.SIGSTOP)
        inflight = len(store_states(store))
        _settle(checker)
        subscribed = checker.subscriptions
        broker.stop()  # graceful: with persistence, Mosquitto saves its sessions
        broker.start()
        # The checker subscribes again before the uplink goes on: without persistence
        # the broker forgot its subscription, and a message published before the new
        # SUBACK would reach nobody (on a loaded machine the uplink won that race).
        checker.wait_subscribed(after=subscribed, timeout=60)
        proc.send_signal(signal.SIGCONT)
        _, err = communicate_while(proc, checker.count, 60)
        assert proc.returncode == 0, err
        counts = checker.wait_for(expected, 60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGCONT)
        proc.kill()
        checker.stop()
    with Store(store) as s:
        resent = s.counters().get("resent_after_session_loss", 0)
    return RestartRun(counts, expected, err, inflight, resent)


@pytest.mark.parametrize("protocol", ["5", "3.1.1"], ids=["mqtt5", "mqtt311"])
def test_broker_restart_with_persistence_keeps_the_session(
    tmp_path: Path, persistent_mosquitto: Mosquitto, protocol: str
) -> None:
    """MQTT-3.1.2-4 / 5.0 3.1.2-23: the session outlives the connection, even a broker restart."""
    run = restart_broker_under_uplink(tmp_path, persistent_mosquitto, protocol)
    report = exactly_once_report(run.counts, run.expected)
    assert report["missing"] == 0 and report["duplicated"] == 0, report
    assert run.inflight_at_restart > 0 and run.resent == 0


@pytest.mark.parametrize("protocol", ["5", "3.1.1"], ids=["mqtt5", "mqtt311"])
def test_broker_restart_without_persistence_requeues_under_new_ids(
    tmp_path: Path, mosquitto: Mosquitto, protocol: str
) -> None:
    """Session lost (5.0 3.2.2-5, MQTT-3.1.2-6): in-flight readings go out again, counted.

    Nothing is lost; a copy the broker had already delivered arrives again with
    the same reading id, which the cloud dedup absorbs.
    """
    run = restart_broker_under_uplink(tmp_path, mosquitto, protocol)
    report = exactly_once_report(run.counts, run.expected)
    assert report["missing"] == 0 and report["unexpected"] == 0, report
    assert run.inflight_at_restart > 0 and run.resent > 0
    # Every duplicate is a re-sent reading (same id), and there are no more than were re-sent.
    assert sum(n - 1 for n in run.counts.values()) <= run.resent
    assert "session" in run.stderr and "re-queued" in run.stderr


class CuttingProxy:
    """A TCP proxy that cuts each connection after a random number of bytes."""

    def __init__(self, target_port: int, rng: random.Random, max_bytes: int = 60_000) -> None:
        self.target_port = target_port
        self.rng = rng
        self.max_bytes = max_bytes
        self.cuts = 0
        self.loop = asyncio.new_event_loop()
        self.port = 0
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> CuttingProxy:
        self._thread.start()
        assert self._ready.wait(5)
        return self

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        server = self.loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.port = server.sockets[0].getsockname()[1]
        self._server = server
        self._ready.set()
        self.loop.run_forever()

    async def _handle(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        try:
            br, bw = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            cw.close()
            return
        budget = [self.rng.randint(1, self.max_bytes)]

        async def pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            with contextlib.suppress(Exception):
                while True:
                    data = await r.read(4096)
                    if not data:
                        break
                    if len(data) >= budget[0]:
                        w.write(data[: budget[0]])  # cut in the middle of a packet
                        await w.drain()
                        budget[0] = 0
                        break
                    budget[0] -= len(data)
                    w.write(data)
                    await w.drain()

        await asyncio.wait(
            [asyncio.ensure_future(pipe(cr, bw)), asyncio.ensure_future(pipe(br, cw))],
            return_when=asyncio.FIRST_COMPLETED,
        )
        self.cuts += 1
        for w in (cw, bw):
            with contextlib.suppress(Exception):
                w.transport.abort()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)


@pytest.mark.parametrize("protocol", ["5", "3.1.1"], ids=["mqtt5", "mqtt311"])
def test_connection_cut_at_random_bytes_exactly_once(
    tmp_path: Path, mosquitto: Mosquitto, protocol: str
) -> None:
    proxy = CuttingProxy(mosquitto.port, random.Random(7 if protocol == "5" else 11)).start()
    checker = Checker(mosquitto.port, "telemetry/#").start()
    store = tmp_path / "gw.db"
    expected = fill_store(store, 5_000)
    try:
        res = run_uplink(
            store,
            f"mqtt://127.0.0.1:{proxy.port}",
            "--protocol",
            protocol,
            "--batch",
            "5",
            timeout=120,
            progress=checker.count,
        )
        assert res.returncode == 0, res.stderr[-3000:]
        counts = checker.wait_for(expected, 30)
    finally:
        checker.stop()
        proxy.stop()
    assert proxy.cuts >= 10
    report = exactly_once_report(counts, expected)
    assert report["missing"] == 0 and report["duplicated"] == 0, report
    assert summary(res)["backlog"] == 0
