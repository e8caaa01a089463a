# Random bits from the hardware RNG where the port has one (os.urandom on ESP32
# and RP2), else from the random module (seeded from the clock and ticks).
import os


def bits(n):
    urandom = getattr(os, "urandom", None)
    if urandom is not None:
        r = 0
        for b in urandom((n + 7) // 8):
            r = r << 8 | b
        return r & ((1 << n) - 1)
    import random

    return random.getrandbits(n)
