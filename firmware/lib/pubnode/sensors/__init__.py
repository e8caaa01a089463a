# One small module per sensor kind; each has build(cfg) -> an object whose
# read() returns a list of (sensor, value, unit) and raises OSError on a bad read.


def build(cfg):
    kind = cfg["kind"]
    if kind == "ds18b20":
        from . import ds18b20 as mod
    elif kind == "dht22":
        from . import dht22 as mod
    elif kind == "adc":
        from . import adc as mod
    else:
        raise ValueError("unknown sensor kind %r" % kind)
    return mod.build(cfg)


def finite(value):
    """None for NaN or infinity: the wire format refuses them."""
    if value is None or value != value or value in (float("inf"), float("-inf")):
        return None
    return value
