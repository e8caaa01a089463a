"""machine under CPython: the board pieces the firmware touches.

- WDT is real: a thread ends the process (exit 3) when the loop stops feeding it.
- deepsleep(ms) ends the process with exit code 75 after writing the wake-up
  time to "deepsleep.ms"; the harness starts it again, as the board's reset would.
- ADC returns a slow ramp, so readings differ.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any

DEEPSLEEP_EXIT = 75
RESET_EXIT = 76
WDT_EXIT = 3


def _exit(code: int) -> None:
    sys.stdout.flush()
    os._exit(code)


class WDT:
    def __init__(self, id: int = 0, timeout: int = 5000) -> None:
        self.timeout = timeout / 1000
        self.last = time.monotonic()
        threading.Thread(target=self._watch, daemon=True).start()

    def feed(self) -> None:
        self.last = time.monotonic()

    def _watch(self) -> None:
        while True:
            time.sleep(self.timeout / 4)
            if time.monotonic() - self.last > self.timeout:
                print(f"WDT: not fed for {self.timeout:.1f} s, resetting", flush=True)
                _exit(WDT_EXIT)


class Pin:
    IN, OUT = 0, 1

    def __init__(self, id: Any, mode: int | None = None) -> None:
        self.id, self._v = id, 0

    def value(self, v: int | None = None) -> int:
        if v is not None:
            self._v = v
        return self._v


class ADC:
    def __init__(self, pin: Any) -> None:
        self.n = 0

    def read_u16(self) -> int:
        self.n += 1
        return (int(time.monotonic() * 1000) + self.n) % 65536


def deepsleep(ms: int = 0) -> None:
    with open("deepsleep.ms", "w") as f:
        f.write(str(ms))
    _exit(DEEPSLEEP_EXIT)


def reset() -> None:
    _exit(RESET_EXIT)


def unique_id() -> bytes:
    return b"\x0c\xaf\xe0\x01"
