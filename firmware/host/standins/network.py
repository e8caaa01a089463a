"""network under CPython: a station that is up unless the flash holds a file "wifi-down"."""

from __future__ import annotations

import os

STA_IF = 0


class WLAN:
    def __init__(self, interface: int = STA_IF) -> None:
        self.connects = 0

    def active(self, flag: bool | None = None) -> bool:
        return True

    def connect(self, ssid: str, password: str) -> None:
        self.connects += 1

    def isconnected(self) -> bool:
        return not os.path.exists("wifi-down")
