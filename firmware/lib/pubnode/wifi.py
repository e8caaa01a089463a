# Wi-Fi station with backoff: boot.py waits for it once; the loop keeps it up.
import time

import network

BACKOFF_MAX_MS = 60000


class Wifi:
    def __init__(self, ssid, password):
        self.ssid, self.password = ssid, password
        self.wlan = network.WLAN(network.STA_IF)
        self.wlan.active(True)
        self.backoff_ms = 1000
        self.next_try = time.ticks_ms()

    def up(self):
        return self.wlan.isconnected()

    def ensure(self):
        """Start a (re)connection when down and the backoff allows; never blocks."""
        if self.wlan.isconnected():
            self.backoff_ms = 1000
            return True
        now = time.ticks_ms()
        if time.ticks_diff(now, self.next_try) >= 0:
            try:
                self.wlan.connect(self.ssid, self.password)
            except OSError:
                pass
            self.next_try = time.ticks_add(now, self.backoff_ms)
            self.backoff_ms = min(self.backoff_ms * 2, BACKOFF_MAX_MS)
        return False

    def wait(self, timeout_s):
        deadline = time.ticks_add(time.ticks_ms(), timeout_s * 1000)
        while time.ticks_diff(deadline, time.ticks_ms()) > 0:
            if self.ensure():
                return True
            time.sleep_ms(100)
        return False
