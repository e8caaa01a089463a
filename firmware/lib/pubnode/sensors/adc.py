# One ADC channel, scaled: value = raw * scale + offset, raw from read_u16() (0..65535).
# "samples" raw reads are averaged, which quiets the ESP32's noisy ADC.
from . import finite


def scaled(raw, scale, offset, digits=4):
    return finite(round(raw * scale + offset, digits))


class ADC:
    def __init__(self, name, pin, scale=1.0, offset=0.0, unit=None, samples=1):
        import machine

        self.name = name
        self.adc = machine.ADC(machine.Pin(pin) if isinstance(pin, int) else pin)
        self.scale, self.offset, self.unit = scale, offset, unit
        self.samples = max(1, samples)

    def read(self):
        raw = sum(self.adc.read_u16() for _ in range(self.samples)) / self.samples
        return [(self.name, scaled(raw, self.scale, self.offset), self.unit)]


def build(cfg):
    return ADC(
        cfg["name"],
        cfg["pin"],
        cfg.get("scale", 1.0),
        cfg.get("offset", 0.0),
        cfg.get("unit"),
        cfg.get("samples", 1),
    )
