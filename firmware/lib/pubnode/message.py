# One message: the readings of one sampling round, with the (boot, seq) that
# makes their ids, and its encodings (the wire format, the flash log's record).
#
# A message is a plain tuple (boot, seq, t, ticks, flat) and values are kept as
# integers in units of 1/10000: on a 32-bit MicroPython a float and a class
# instance are heap objects and a small int (up to +-107374.1823 here) is not,
# so a 500-reading buffer costs a fraction of the RAM. Four decimals keep a
# DS18B20's 1/16 degree steps exact; larger values become big ints, still exact.
#   boot   boot counter when it was taken: part of its id, forever
#   seq    per-boot message counter
#   t      port-epoch seconds when the clock was set, else None
#   ticks  time.ticks_ms() when taken (meaningful in its own boot only)
#   flat   (sensor, value * 10000, unit, sensor, ...)
import json
import time

BOOT, SEQ, T, TICKS, FLAT = 0, 1, 2, 3, 4
SCALE = 10000


def new(boot, seq, t, ticks, readings):
    flat = []
    for sensor, value, unit in readings:
        flat.append(sensor)
        flat.append(None if value is None else int(round(value * SCALE)))
        flat.append(unit)
    return (boot, seq, t, ticks, tuple(flat))


def count(msg):
    return len(msg[FLAT]) // 3


def readings(msg):
    flat = msg[FLAT]
    out = []
    for i in range(0, len(flat), 3):
        m = flat[i + 1]
        out.append((flat[i], None if m is None else m / SCALE, flat[i + 2]))
    return out


def record(msg):
    """The flash log's form: compact JSON, one line, without the ticks."""
    return json.dumps([msg[BOOT], msg[SEQ], msg[T], msg[FLAT]])


def from_record(text):
    boot, seq, t, flat = json.loads(text)
    if len(flat) % 3:
        raise ValueError("bad record")
    return (boot, seq, t, None, tuple(flat))


def iso(t):
    """UTC ISO 8601 with milliseconds, from port epoch seconds."""
    y, mo, d, h, mi, s = time.gmtime(int(t))[:6]
    ms = int((t - int(t)) * 1000)
    return "%04d-%02d-%02dT%02d:%02d:%02d.%03dZ" % (y, mo, d, h, mi, s, ms)


def payload(node, msg, boot, now_ticks, dropped=None):
    """The wire format's node message (docs/wire-format.md); ``dropped``: the
    messages this node gave up, if any (drops.py).

    Without a clock the gateway stamps its own time; ``dt`` then says how long
    ago the readings were taken, known only for a message of this boot.
    """
    dt = None
    if msg[T] is None and msg[BOOT] == boot and msg[TICKS] is not None:
        dt = max(0, time.ticks_diff(now_ticks, msg[TICKS])) / 1000
    out = []
    for sensor, value, unit in readings(msg):
        r = {"sensor": sensor, "value": value, "unit": unit}
        if dt:
            r["dt"] = dt
        out.append(r)
    body = {
        "v": 1,
        "node": node,
        "boot": msg[BOOT],
        "seq": msg[SEQ],
        "ts": None if msg[T] is None else iso(msg[T]),
        "readings": out,
    }
    if dropped:
        body["dropped"] = dropped
    return json.dumps(body).encode()
