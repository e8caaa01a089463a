"""esp32.Partition under CPython: two OTA app partitions and the bootloader's rollback.

As MicroPython documents it (docs/library/esp32.rst) and ports/esp32/esp32_partition.c
does it: ``Partition(Partition.RUNNING)``, ``.info()`` (type, subtype, addr, size, label,
encrypted), ``.readblocks``/``.writeblocks`` (4096-byte blocks; the simple write erases
the blocks it covers first, the extended one with an offset does not, so the block must
have been erased with ``ioctl(6, block)``), ``ioctl`` 4/5/6 (block count, block size,
erase), ``get_next_update()``, ``set_boot()`` and ``mark_app_valid_cancel_rollback()``.
Flash is NOR: erased bytes read 0xFF and a write can only clear bits (new = old & data),
so a write to a block that was not erased garbles it, as on the chip.

The bootloader (ESP-IDF with CONFIG_BOOTLOADER_APP_ROLLBACK_ENABLE, which MicroPython's
sdkconfig.base sets) runs in ``boot_rom()``, which firmware/host/run_node.py calls at
each start: an image that does not begin with the app image magic 0xE9 is not booted;
a new image boots once as pending verification; if that boot ends without
``mark_app_valid_cancel_rollback()``, the next boot marks it aborted and boots the
previous valid one.

There is no esp32 module unless PUBCOMP_ESP32_DIR names where the partitions live (a
Pico W has none): ``import esp32`` raises ImportError then. The partition table is
MicroPython's partitions-4MiB-ota.csv: ota_0 and ota_1 of 0x180000 bytes each.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

_DIR = os.environ.get("PUBCOMP_ESP32_DIR")
if not _DIR:
    raise ImportError("no module named 'esp32' (this board has no OTA partitions)")
DIR = Path(_DIR)

BLOCK = 4096
TABLE = {"ota_0": (0x10000, 0x180000), "ota_1": (0x190000, 0x180000)}
APP_MAGIC = 0xE9
ESP_ERR_OTA_ROLLBACK_INVALID_STATE = -0x1508  # what check_esp_err raises as OSError
HEAP_DATA, HEAP_EXEC = 4, 1
_running: str | None = None


def _otadata() -> dict[str, Any]:
    try:
        d: dict[str, Any] = json.loads((DIR / "otadata.json").read_text())
        return d
    except (OSError, ValueError):
        return {"boot": "ota_0", "state": {"ota_0": "valid"}}


def _save(d: dict[str, Any]) -> None:
    DIR.mkdir(parents=True, exist_ok=True)
    tmp = DIR / "otadata.json.tmp"
    tmp.write_text(json.dumps(d))
    os.replace(tmp, DIR / "otadata.json")


def _other(label: str) -> str:
    return "ota_1" if label == "ota_0" else "ota_0"


def _image_ok(label: str) -> bool:
    p = DIR / f"{label}.bin"
    if not p.exists():
        return label == "ota_0"  # the image esptool wrote (this process's own firmware)
    with p.open("rb") as f:
        return f.read(1) == bytes([APP_MAGIC])


def boot_rom() -> str:
    """The bootloader: which partition runs this boot (and its rollback bookkeeping)."""
    global _running
    d = _otadata()
    boot, state = d["boot"], d.setdefault("state", {})
    if state.get(boot) == "pending_verify":
        state[boot] = "aborted"  # its one boot ended without being marked valid
        boot = _other(boot)
    elif state.get(boot) == "new":
        if _image_ok(boot):
            state[boot] = "pending_verify"
        else:
            state[boot] = "aborted"  # esp_image_verify failed: not booted
            boot = _other(boot)
    d["boot"] = boot
    _save(d)
    _running = boot
    return boot


def _flash(label: str) -> Path:
    p = DIR / f"{label}.bin"
    if not p.exists():
        DIR.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"\xff" * TABLE[label][1])
    return p


class Partition:
    BOOT, RUNNING = 0, 1
    TYPE_APP, TYPE_DATA = 0, 1

    def __init__(self, id: Any, block_size: int = BLOCK) -> None:
        if id == Partition.RUNNING:
            label = _running or boot_rom()
        elif id == Partition.BOOT:
            label = _otadata()["boot"]
        elif id in TABLE:
            label = id
        else:
            raise OSError(2, "ENOENT")
        self.label = label
        self.block_size = block_size

    @classmethod
    def find(
        cls, type: int = 0, subtype: int = 0xFF, label: str | None = None, block_size: int = BLOCK
    ) -> list[Partition]:
        if type != cls.TYPE_APP:
            return []
        return [cls(n, block_size) for n in TABLE if label in (None, n)]

    def info(self) -> tuple[int, int, int, int, str, bool]:
        addr, size = TABLE[self.label]
        return (self.TYPE_APP, 0x10 + int(self.label[-1]), addr, size, self.label, False)

    def readblocks(self, block: int, buf: Any, offset: int = 0) -> None:
        at = block * self.block_size + offset
        with _flash(self.label).open("rb") as f:
            f.seek(at)
            data = f.read(len(buf))
        buf[: len(data)] = data

    def writeblocks(self, block: int, buf: Any, offset: int | None = None) -> None:
        at = block * self.block_size + (offset or 0)
        data = bytes(buf)
        with _flash(self.label).open("r+b") as f:
            if offset is None:  # the simple write erases what it covers first
                first = at - at % BLOCK
                last = -(-(at + len(data)) // BLOCK) * BLOCK
                f.seek(first)
                old = bytearray(f.read(last - first))
                old[at - first : at - first + len(data)] = b"\xff" * len(data)
                f.seek(first)
                f.write(bytes(old))
            f.seek(at)
            old = f.read(len(data))
            f.seek(at)
            f.write(bytes(a & b for a, b in zip(old, data, strict=True)))  # NOR: bits only clear

    def ioctl(self, cmd: int, arg: int) -> int | None:
        if cmd in (1, 2, 3):  # init, deinit, sync
            return 0
        if cmd == 4:
            return TABLE[self.label][1] // self.block_size
        if cmd == 5:
            return self.block_size
        if cmd == 6:
            with _flash(self.label).open("r+b") as f:
                f.seek(arg * BLOCK)
                f.write(b"\xff" * BLOCK)
            return 0
        return None

    def set_boot(self) -> None:
        d = _otadata()
        d["boot"] = self.label
        d.setdefault("state", {})[self.label] = "new"
        _save(d)

    def get_next_update(self) -> Partition:
        return Partition(_other(self.label), BLOCK)

    @classmethod
    def mark_app_valid_cancel_rollback(cls) -> None:
        d = _otadata()
        running = _running or boot_rom()
        if d.get("state", {}).get(running) == "pending_verify":
            d["state"][running] = "valid"
            _save(d)
