"""A serial port read without blocking the event loop, reopened with backoff.

``serial_for_url`` is used so ``/dev/serial0``, ``/dev/ttyUSB0``, ``loop://``,
``socket://host:port`` and pseudo-terminals all work. Reads run in a worker
thread with a short timeout; an unplugged USB adapter (an OSError or
SerialException) is reported by the caller and the port is reopened with
exponential backoff until it comes back (backoff.py).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import serial

from .backoff import reopen_delay


class SerialPort:
    def __init__(
        self, url: str, baudrate: int = 9600, read_timeout: float = 0.2, **kwargs: Any
    ) -> None:
        self.url, self.baudrate = url, baudrate
        self.read_timeout = read_timeout
        self.kwargs = kwargs
        self._port: Any = None
        self.reopen_delay = 0.1
        self.max_reopen_delay = 10.0

    def open(self) -> None:
        """Open now (raises serial.SerialException with the OS's reason)."""
        self._port = serial.serial_for_url(
            self.url, baudrate=self.baudrate, timeout=self.read_timeout, **self.kwargs
        )

    @property
    def is_open(self) -> bool:
        return self._port is not None and self._port.is_open

    async def read(self, size: int = 256) -> bytes:
        """Up to ``size`` bytes; b"" when the read timed out. Raises SerialException."""
        if not self.is_open:
            await asyncio.to_thread(self.open)
        port = self._port
        try:
            return await asyncio.to_thread(port.read, size)
        except (serial.SerialException, OSError, TypeError, AttributeError) as exc:
            # pyserial raises TypeError/AttributeError from read() on a port closed
            # under it; all of these mean "the device went away".
            self.close()
            raise serial.SerialException(str(exc) or type(exc).__name__) from exc

    async def write(self, data: bytes) -> None:
        if not self.is_open:
            await asyncio.to_thread(self.open)
        await asyncio.to_thread(self._port.write, data)

    async def wait_reopen(self, attempt: int) -> None:
        await asyncio.sleep(reopen_delay(attempt, self.reopen_delay, self.max_reopen_delay))

    def close(self) -> None:
        if self._port is not None:
            with contextlib.suppress(Exception):
                self._port.close()
        self._port = None
