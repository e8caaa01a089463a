"""What a serial parser yields: decoded frames, or errors the driver reports and counts."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime


@dataclass(slots=True)
class Frame:
    # channel suffix -> (value, unit)
    values: dict[str, tuple[float | None, str | None]]
    utc: datetime | None = None  # a trusted time in the frame (GPS RMC)
    kind: str = ""


@dataclass(slots=True)
class FrameError:
    kind: str  # bad_checksum, bad_frame
    detail: str


@dataclass
class ByteBuffer:
    """A bounded receive buffer: a stream of junk can never grow it without limit."""

    limit: int = 4096
    data: bytearray = field(default_factory=bytearray)

    def add(self, chunk: bytes) -> int:
        """Append; returns how many old bytes were dropped to stay under the limit."""
        self.data += chunk
        over = len(self.data) - self.limit
        if over > 0:
            del self.data[:over]
            return over
        return 0
