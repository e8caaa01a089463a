# DHT22 (AM2302) temperature and humidity on one pin (the built-in dht module).
# Readings: <name>-t in C and <name>-rh in %. It needs 2 s between reads.
from . import finite


class DHT22:
    def __init__(self, name, pin):
        import dht
        import machine

        self.name = name
        self.dev = dht.DHT22(machine.Pin(pin))

    def read(self):
        self.dev.measure()  # OSError on a timeout or a bad checksum
        t, rh = finite(self.dev.temperature()), finite(self.dev.humidity())
        if rh is not None and not 0 <= rh <= 100:
            raise OSError("%s: humidity %s out of range" % (self.name, rh))
        return [(self.name + "-t", t, "C"), (self.name + "-rh", rh, "%")]


def build(cfg):
    return DHT22(cfg["name"], cfg["pin"])
