"""A local Mosquitto on a free loopback port, for the demo, the benchmarks and the tests.

The broker can be stopped (SIGTERM, which saves its persistence file), killed
(SIGKILL) and restarted on the same port inside a test; it is always stopped
by its PID.
"""

from __future__ import annotations

import getpass
import os
import random
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

_handed_out: set[int] = set()


# Ports are handed out below the kernel's ephemeral range (32768 and up by default), so
# no outgoing connection takes one between its choice and its bind, and each pytest-xdist
# worker has a slice of its own, so two workers never pick the same one.
_PORTS_LOW, _PORTS_HIGH = 10_000, 32_000


def _port_slice() -> range:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    index = int(worker[2:]) if worker.startswith("gw") and worker[2:].isdigit() else 0
    size = (_PORTS_HIGH - _PORTS_LOW) // max(count, 1)
    start = _PORTS_LOW + (index % max(count, 1)) * size
    return range(start, start + size)


def free_port() -> int:
    """A loopback port nothing listens on now, and never one this process had before:
    the kernel may give the same port to two binds in a row once the first is closed,
    and a gateway with its plaintext and TLS listeners on one port does not start."""
    ports = _port_slice()
    offset = random.randrange(len(ports))
    for i in range(len(ports)):
        port = ports[(offset + i) % len(ports)]
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free loopback port in {ports}")


def mosquitto_binary() -> str:
    for cand in (shutil.which("mosquitto"), "/usr/sbin/mosquitto"):
        if cand and os.access(cand, os.X_OK):
            return cand
    raise RuntimeError("mosquitto is not installed: run `make test` (it installs it) or apt-get")


class Mosquitto:
    def __init__(
        self,
        workdir: Path,
        *,
        persistence: bool = False,
        port: int | None = None,
        extra_config: str = "",
        max_queued_messages: int = 0,
        users: dict[str, str] | None = None,
        acl_file: Path | None = None,
    ) -> None:
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.persistence = persistence
        self.port = port or free_port()
        self.extra_config = extra_config
        # 0 (no limit) unless a test wants Mosquitto's own drop of an absent
        # subscriber's queue (its default is 1,000).
        self.max_queued_messages = max_queued_messages
        # With users: no anonymous clients, a password file of these, and the ACL.
        self.users = users
        self.acl_file = acl_file
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = self.workdir / "mosquitto.log"

    @property
    def url(self) -> str:
        return f"mqtt://127.0.0.1:{self.port}"

    def _write_config(self) -> Path:
        conf = self.workdir / "mosquitto.conf"
        lines = [
            f"listener {self.port} 127.0.0.1",
            *self._auth_lines(),
            f"user {getpass.getuser()}",
            # The checker must never be the one that drops messages.
            f"max_queued_messages {self.max_queued_messages}",
            "max_queued_bytes 0",
            f"log_dest file {self.log_path}",
            "log_type error",
            "log_type warning",
            "log_type notice",
            "log_type information",
            "connection_messages true",
            "log_timestamp true",
        ]
        if self.persistence:
            lines += [
                "persistence true",
                f"persistence_location {self.workdir}/",
                "persistence_file mosquitto.db",
                "autosave_interval 1800",
            ]
        else:
            lines.append("persistence false")
        conf.write_text("\n".join(lines) + "\n" + self.extra_config)
        return conf

    def _auth_lines(self) -> list[str]:
        if self.users is None:
            return ["allow_anonymous true"]
        passwd = self.workdir / "passwd"
        passwd.write_text("".join(f"{u}:{p}\n" for u, p in self.users.items()))
        passwd.chmod(0o600)
        # mosquitto_passwd -U hashes the plain passwords in place.
        subprocess.run(["mosquitto_passwd", "-U", str(passwd)], check=True, capture_output=True)
        lines = ["allow_anonymous false", f"password_file {passwd}"]
        if self.acl_file is not None:
            lines.append(f"acl_file {self.acl_file}")
        return lines

    def start(self, timeout: float = 10.0) -> Mosquitto:
        assert self.proc is None or self.proc.poll() is not None, "already running"
        conf = self._write_config()
        self.proc = subprocess.Popen(
            [mosquitto_binary(), "-c", str(conf)],
            stdout=subprocess.DEVNULL,
            stderr=open(self.workdir / "mosquitto.stderr", "ab"),  # noqa: SIM115
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mosquitto exited at start:\n{self.log()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return self
            except OSError:
                time.sleep(0.02)
        raise RuntimeError(f"mosquitto did not listen on {self.port}:\n{self.log()}")

    def stop(self, timeout: float = 10.0) -> None:
        """Graceful stop: SIGTERM, after which Mosquitto writes its persistence file."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def restart(self) -> Mosquitto:
        self.stop()
        return self.start()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
