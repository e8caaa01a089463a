"""What a serial parser yields: decoded frames, or errors the driver reports and counts."""

from __future__ import annotations

from dataclasses import dataclass
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
