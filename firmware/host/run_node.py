"""The firmware's host port: ``python firmware/host/run_node.py FLASH`` runs a node under CPython.

The flash directory holds config.json, boot.txt and spill/ as on the board.
MicroPython-only pieces come from firmware/host/standins (usocket, machine,
network, ...); time gets MicroPython's ticks functions; umqtt.simple is the
real one, fetched by scripts/fetch-umqtt.py.
"""

from __future__ import annotations

import gc
import os
import runpy
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
FIRMWARE = HERE.parent
ROOT = FIRMWARE.parent
TICKS_PERIOD = 1 << 30


def ticks_ms() -> int:
    return int(time.monotonic() * 1000) % TICKS_PERIOD


def ticks_add(t: int, delta: int) -> int:
    return (t + delta) % TICKS_PERIOD


def ticks_diff(a: int, b: int) -> int:
    d = (a - b) % TICKS_PERIOD
    return d - TICKS_PERIOD if d >= TICKS_PERIOD // 2 else d


def main() -> None:
    flash = Path(sys.argv[1]).resolve()
    # As on the board: the stand-ins are the port's own modules, pubboot.py sits at the
    # root, the factory set in /lib, umqtt installed by mip.
    sys.path[:0] = [
        str(HERE / "standins"),
        str(FIRMWARE / "lib"),
        str(ROOT / ".cache" / "umqtt"),
    ]
    sys.path.append(str(FIRMWARE))  # pubboot.py, at the root of the board
    sys.dont_write_bytecode = True  # nothing in the flash directory but what the board has
    time.ticks_ms = ticks_ms  # type: ignore[attr-defined]
    time.ticks_add = ticks_add  # type: ignore[attr-defined]
    time.ticks_diff = ticks_diff  # type: ignore[attr-defined]
    time.sleep_ms = lambda ms: time.sleep(ms / 1000)  # type: ignore[attr-defined]
    gc.mem_free = lambda: -1  # type: ignore[attr-defined]
    sys.print_exception = lambda e: traceback.print_exception(e, file=sys.stdout)  # type: ignore[attr-defined]
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    os.chdir(flash)
    try:
        import esp32  # the stand-in, where the board is an ESP32 with OTA partitions
    except ImportError:
        pass
    else:
        esp32.boot_rom()  # the bootloader: which app partition runs, its rollback
    runpy.run_path(str(FIRMWARE / "boot.py"), run_name="__main__")
    runpy.run_path(str(FIRMWARE / "main.py"), run_name="__main__")


if __name__ == "__main__":
    main()
