"""Processes the tests start (gateways, ingests): a failing test must not leave them running."""

from __future__ import annotations

import subprocess
from typing import Any

_live: list[subprocess.Popen[str]] = []


def track(proc: subprocess.Popen[str]) -> subprocess.Popen[str]:
    _live.append(proc)
    return proc


def kill_stray() -> None:
    for p in _live:
        if p.poll() is None:
            p.kill()
            p.wait()
    _live.clear()


def stop(proc: subprocess.Popen[Any], timeout: float = 30) -> None:
    """SIGTERM, and SIGKILL if it has not ended within ``timeout``."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
