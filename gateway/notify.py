"""The systemd notify protocol, written by hand (sd_notify(3)): one datagram per state.

``sdnotify`` swallows every error; here a failed send is logged once and
counted, and the service goes on (a missing notify socket must never stop a
gateway). Outside systemd (no ``$NOTIFY_SOCKET``) every call is a no-op.
"""

from __future__ import annotations

import logging
import os
import socket
import time

log = logging.getLogger(__name__)


class Notifier:
    def __init__(self, environ: dict[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        addr = env.get("NOTIFY_SOCKET", "")
        if addr.startswith("@"):
            addr = "\0" + addr[1:]  # an abstract socket
        self.address = addr or None
        usec = env.get("WATCHDOG_USEC", "")
        pid = env.get("WATCHDOG_PID", "")
        mine = not pid or pid == str(os.getpid())
        # Ping at half the timeout, as sd_watchdog_enabled(3) advises.
        self.watchdog_interval = int(usec) / 2e6 if usec.isdigit() and mine else None
        self.failures = 0
        self.sent = 0
        self._sock: socket.socket | None = None

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def send(self, *fields: str) -> bool:
        if self.address is None:
            return False
        msg = "\n".join(fields).encode()
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.sendto(msg, self.address)
        except OSError as exc:
            self.failures += 1
            if self.failures == 1:
                log.warning("systemd notify to %s failed: %s", self.address, exc)
            return False
        self.sent += 1
        return True

    def ready(self, status: str) -> bool:
        return self.send("READY=1", f"STATUS={status}", f"MAINPID={os.getpid()}")

    def status(self, status: str) -> bool:
        return self.send(f"STATUS={status}")

    def watchdog(self) -> bool:
        return self.send("WATCHDOG=1")

    def stopping(self, status: str = "stopping") -> bool:
        return self.send("STOPPING=1", f"STATUS={status}")

    def reloading(self, status: str = "reloading") -> bool:
        """The process is about to be replaced by a new one (re-exec) that will say READY=1;
        MONOTONIC_USEC lets systemd 253+ tell this reload from an older one."""
        usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        return self.send("RELOADING=1", f"MONOTONIC_USEC={usec}", f"STATUS={status}")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
