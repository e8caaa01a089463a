# Status LED patterns: what the node is doing, readable from across a room.
#
# Each pattern is a 2-second cycle of (on_ms, off_ms) pairs:
#   no Wi-Fi      one blink
#   no gateway    two blinks
#   bad cert      three blinks: the gateway's TLS certificate is not the one pinned
#   buffer full   fast blinking (5 per second): readings are being dropped or spilled
#   sending       on while a publish is in flight
#   all well      a short flash every cycle (alive)
import time

CYCLE_MS = 2000
PATTERNS = {
    "no_wifi": ((150, 1850),),
    "no_gateway": ((150, 200), (150, 1500)),
    "bad_cert": ((150, 200), (150, 200), (150, 1150)),
    "buffer_full": ((100, 100),) * 10,
    "sending": ((2000, 0),),
    "ok": ((30, 1970),),
}


def level_at(state, ms):
    """1 if the LED is on ``ms`` milliseconds into the cycle of ``state``."""
    t = ms % CYCLE_MS
    for on, off in PATTERNS[state]:
        if t < on:
            return 1
        t -= on
        if t < off:
            return 0
        t -= off
    return 0


class StatusLed:
    def __init__(self, pin=None, active_high=True):
        self.pin = pin
        self.active_high = active_high
        self.state = "no_wifi"

    def show(self, state):
        if state not in PATTERNS:
            raise ValueError("unknown LED state %r" % state)
        self.state = state
        self.tick()

    def tick(self):
        if self.pin is None:
            return
        on = level_at(self.state, time.ticks_ms())
        self.pin.value(on if self.active_high else 1 - on)
