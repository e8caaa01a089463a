"""Run the node firmware as a CPython process (firmware/host/run_node.py) against a gateway."""

from __future__ import annotations

import time
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
