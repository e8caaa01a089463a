"""The systemd notify protocol, received on a real Unix datagram socket as NOTIFY_SOCKET."""

from __future__ import annotations

import asyncio
import socket
import sqlite3
import threading
import time
from pathlib import Path

from devkit.broker import Mosquitto
from devkit.gateway_helpers import GatewayProc, offline_config
from pubcomp.gateway import service
from pubcomp.gateway.notify import Notifier


class NotifySocket:
    """What systemd does: bind a datagram socket and read what the service says."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.sock.settimeout(0.2)
        self.got: list[tuple[float, dict[str, str]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                data = self.sock.recv(4096)
            except TimeoutError:
                continue
            fields = dict(line.split("=", 1) for line in data.decode().splitlines())
            self.got.append((time.monotonic(), fields))

    def times(self, key: str, since: float = 0.0, until: float = float("inf")) -> list[float]:
        return [t for t, f in list(self.got) if key in f and since <= t <= until]

    def wait(self, key: str, n: int = 1, since: float = 0.0, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while len(self.times(key, since)) < n:
            assert time.monotonic() < deadline, f"waited for {n} x {key}: {self.got}"
            time.sleep(0.02)

    def mark(self, text: str) -> None:
        """Queue a marker from the calling thread, in order with what it sends itself."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.sendto(text.encode(), self.path)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close()


def test_ready_status_watchdog_withheld_while_the_store_is_locked_and_stopping(
    tmp_path: Path, mosquitto: Mosquitto
) -> None:
    ns = NotifySocket(tmp_path / "notify.sock")
    gw = GatewayProc(
        tmp_path, mosquitto.port, sensors=[{"id": "t", "type": "simulated", "interval_s": 0.2}]
    )
    try:
        gw.start(env={"NOTIFY_SOCKET": ns.path, "WATCHDOG_USEC": "600000"}, wait=False)
        ns.wait("READY")
        ready = next(f for _, f in ns.got if "READY" in f)
        assert ready["READY"] == "1" and ready["STATUS"].startswith("uplink ")
        ns.wait("WATCHDOG", 3)  # every 0.3 s: half of WATCHDOG_USEC
        # Another process holds the store's write lock: the gateway cannot commit, so it
        # must stop telling systemd it is well (systemd would then restart it).
        db = sqlite3.connect(gw.db, isolation_level=None)
        db.execute("BEGIN EXCLUSIVE")
        locked = time.monotonic()
        # Queued after every status sent before the lock: a probe that was merely slow
        # before it (behind an fsync on a busy machine) says UNHEALTHY too, and pings again.
        ns.mark("LOCKED=1")

        def unhealthy_since(t: float) -> list[float]:
            return [
                at
                for at, f in list(ns.got)
                if at > t and f.get("STATUS", "").startswith("UNHEALTHY: store probe")
            ]

        deadline = time.monotonic() + 30
        while not unhealthy_since(locked):
            assert time.monotonic() < deadline, ns.got
            time.sleep(0.02)
        # Held for three more watchdog intervals: no ping may come while it is held.
        ns.wait("STATUS", 3, since=unhealthy_since(locked)[0])
        ns.mark("RELEASING=1")
        db.execute("ROLLBACK")
        released = time.monotonic()
        db.close()
        ns.wait("RELEASING")  # read by the listener thread
        # By the order the socket queued them (not by clock): after UNHEALTHY, no WATCHDOG
        # until the lock was released (a ping sent before it was queued before it).
        got = [f for _, f in list(ns.got)]
        locked_i = next(i for i, f in enumerate(got) if "LOCKED" in f)
        first_bad = next(
            i
            for i, f in enumerate(got)
            if i > locked_i and f.get("STATUS", "").startswith("UNHEALTHY: store probe")
        )
        releasing = next(i for i, f in enumerate(got) if "RELEASING" in f)
        assert [f for f in got[first_bad:releasing] if "WATCHDOG" in f] == []
        ns.wait("WATCHDOG", 2, since=released)  # well again: the pings come back
        assert gw.terminate() == 0
        ns.wait("STOPPING")
    finally:
        if gw.proc and gw.proc.poll() is None:
            gw.kill()
        ns.close()


def test_no_watchdog_pings_while_the_event_loop_is_wedged(tmp_path: Path) -> None:
    """The pings come from the event loop itself: a loop stuck in a call sends none."""
    ns = NotifySocket(tmp_path / "notify.sock")
    cfg = offline_config(tmp_path, "gw-wedge")
    notifier = Notifier({"NOTIFY_SOCKET": ns.path, "WATCHDOG_USEC": "200000"})

    async def main() -> int:
        gw = service.Gateway(cfg, notifier=notifier)
        stop = asyncio.Event()
        run = asyncio.create_task(gw.run(stop))
        await asyncio.to_thread(ns.wait, "WATCHDOG", 3)  # pinging (however slow the start)
        ns.mark("WEDGE=start")  # queued after every ping the loop sent before
        time.sleep(1.5)  # a blocking call on the loop: everything on it stops
        ns.mark("WEDGE=end")
        await asyncio.to_thread(ns.wait, "WATCHDOG", 3, time.monotonic())  # pinging again
        stop.set()
        return await run

    try:
        assert asyncio.run(main()) == 0
        ns.wait("WEDGE", 2)  # both markers read by the listener thread
        ns.wait("STOPPING")
        got = [f for _, f in list(ns.got)]
        start_i = next(i for i, f in enumerate(got) if f.get("WEDGE") == "start")
        end_i = next(i for i, f in enumerate(got) if f.get("WEDGE") == "end")
        assert len([f for f in got[:start_i] if "WATCHDOG" in f]) >= 3
        assert [f for f in got[start_i:end_i] if "WATCHDOG" in f] == []
        assert len([f for f in got[end_i:] if "WATCHDOG" in f]) >= 3
        assert ns.times("STOPPING")
    finally:
        ns.close()
