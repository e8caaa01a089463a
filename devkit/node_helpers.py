"""Run the node firmware as a CPython process (firmware/host/run_node.py) against a gateway."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from .node import HostNode
from .node import node_config as board_config
from .procs import track

DEEPSLEEP_EXIT = 75


def node_config(node: str, password: str, port: int, **over: Any) -> dict[str, Any]:
    return board_config(node, password, "127.0.0.1", port, **over)


class NodeProc(HostNode):
    """A host-port board whose process the tests' reaper knows about."""

    def start(self) -> NodeProc:
        super().start()
        assert self.proc is not None
        track(self.proc)
        return self


def wait_until(pred: Any, timeout: float, step: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(step)
    return bool(pred())


RESET_EXIT = 76  # firmware/host/standins/machine.py: machine.reset()
WDT_EXIT = 3  # the watchdog fired


class Board(NodeProc):
    """A host-port board that starts again after machine.reset(), its watchdog or a deep
    sleep, as hardware does, until ``stop()``; ``starts`` counts the boots it ran."""

    def __init__(self, flash: Path, cfg: dict[str, Any]) -> None:
        super().__init__(flash, cfg)
        self.starts = 0
        self.exits: list[int] = []
        self._stop = threading.Event()
        self._cut = threading.Event()
        self._thread: threading.Thread | None = None

    def run(self) -> Board:
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, daemon=True, name=f"board-{self.node}")
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.starts += 1
            self.start()
            assert self.proc is not None
            code = self.proc.wait()
            self.exits.append(code)
            if self._stop.is_set():
                return
            if self._cut.is_set():
                self._cut.clear()  # the power comes back
            elif code not in (RESET_EXIT, WDT_EXIT, DEEPSLEEP_EXIT):
                return  # deep sleep's wake is a boot too

    def power_cut(self) -> None:
        """SIGKILL (RAM goes; the host's page cache keeps what was written): it boots again."""
        self._cut.set()
        self.kill()

    def stop(self) -> None:
        self._stop.set()
        self.kill()
        if self._thread is not None:
            self._thread.join(10)
