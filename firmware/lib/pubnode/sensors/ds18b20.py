# DS18B20 temperature probes on one 1-Wire pin (onewire + ds18x20, built into MicroPython).
# Several probes on the bus are named <name>-0, <name>-1, ... in ROM order.
import time

from . import finite

CONVERT_MS = 750  # 12-bit conversion time, datasheet maximum
POWER_ON_RESET_C = 85.0  # what a probe reports when it lost power mid-conversion


class DS18B20:
    def __init__(self, name, pin):
        import ds18x20
        import machine
        import onewire

        self.name = name
        self.bus = ds18x20.DS18X20(onewire.OneWire(machine.Pin(pin)))
        self.roms = sorted(self.bus.scan())
        if not self.roms:
            raise OSError("no DS18B20 on pin %s" % pin)

    def read(self):
        self.bus.convert_temp()
        time.sleep_ms(CONVERT_MS)
        out = []
        for i, rom in enumerate(self.roms):
            name = self.name if len(self.roms) == 1 else "%s-%d" % (self.name, i)
            c = finite(self.bus.read_temp(rom))
            if c == POWER_ON_RESET_C:
                raise OSError("%s: power-on reset value 85.0" % name)
            out.append((name, c, "C"))
        return out


def build(cfg):
    return DS18B20(cfg["name"], cfg["pin"])
