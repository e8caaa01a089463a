# config.json on the board: defaults filled in, mistakes named.
import json

try:
    from binascii import a2b_base64
except ImportError:
    from ubinascii import a2b_base64

DEFAULTS = {
    "wifi": {"ssid": "", "password": "", "timeout_s": 20},
    # tls: connect with TLS and trust only the certificate in ca (PEM: the gateway's own,
    # or the site CA that signed it), checked against server_hostname (default: host).
    "gateway": {
        "host": "",
        "port": 1883,
        "keepalive_s": 60,
        "timeout_s": 10,
        "tls": False,
        "ca": "",
        "server_hostname": "",
    },
    "node": {"id": "", "password": ""},
    "interval_s": 10,
    "buffer_readings": 500,
    "spill": {"mode": "overflow", "dir": "spill", "segments": 4, "segment_bytes": 32768},
    "deep_sleep": False,
    "ntp": True,
    "wdt_ms": 30000,
    "led": {"pin": None, "active_high": True},
    "sensors": [],
    # Software from the gateway (docs/firmware.md): ask every check_s; a new set must
    # deliver a reading within trial_s of its first boot, or the node goes back.
    "update": {"enabled": True, "check_s": 300, "trial_s": 120},
    "rounds": 0,  # stop after this many sampling rounds (0: never); for tests and benchmarks
}
REQUIRED = (("gateway", "host"), ("node", "id"), ("node", "password"))
SPILL_MODES = ("off", "overflow", "always")
SENSOR_KINDS = ("ds18b20", "dht22", "adc")


class ConfigError(ValueError):
    pass


def pem_to_der(pem):
    """The first certificate of a PEM text, as DER bytes (what ssl's cadata takes)."""
    begin, end = "-----BEGIN CERTIFICATE-----", "-----END CERTIFICATE-----"
    i = pem.find(begin)
    j = pem.find(end, i + 1)
    if i < 0 or j < 0:
        raise ConfigError("config.json: gateway.ca must be a PEM certificate (BEGIN CERTIFICATE)")
    body = "".join(pem[i + len(begin) : j].split())
    try:
        der = a2b_base64(body.encode())
    except ValueError:
        raise ConfigError("config.json: gateway.ca: the certificate is not valid base64")
    if len(der) < 64 or der[0] != 0x30:
        raise ConfigError("config.json: gateway.ca: not a DER certificate inside the PEM")
    return der


def merged(data):
    out = {}
    for key, default in DEFAULTS.items():
        value = data.get(key, default)
        if isinstance(default, dict):
            if not isinstance(value, dict):
                raise ConfigError("config.json: %s must be an object" % key)
            d = dict(default)
            for k in value:
                if k not in default:
                    raise ConfigError("config.json: unknown key %s.%s" % (key, k))
            d.update(value)
            value = d
        out[key] = value
    for key in data:
        if key not in DEFAULTS:
            raise ConfigError("config.json: unknown key %s" % key)
    for section, key in REQUIRED:
        if not out[section][key]:
            raise ConfigError("config.json: %s.%s is required" % (section, key))
    gw = out["gateway"]
    if gw["tls"]:
        if not gw["ca"]:
            raise ConfigError(
                "config.json: gateway.tls needs gateway.ca (the certificate the node trusts)"
            )
        pem_to_der(gw["ca"])
    elif gw["ca"]:
        raise ConfigError("config.json: gateway.ca is set but gateway.tls is false")
    if out["spill"]["mode"] not in SPILL_MODES:
        raise ConfigError("config.json: spill.mode must be one of %s" % (SPILL_MODES,))
    if out["deep_sleep"] and out["spill"]["mode"] == "off":
        raise ConfigError("config.json: deep_sleep needs spill.mode overflow or always")
    up = out["update"]
    for k in ("check_s", "trial_s"):
        if not (isinstance(up[k], (int, float)) and up[k] > 0):
            raise ConfigError("config.json: update.%s must be a positive number of seconds" % k)
    if not (isinstance(out["buffer_readings"], int) and out["buffer_readings"] > 0):
        raise ConfigError("config.json: buffer_readings must be a positive integer")
    for i, s in enumerate(out["sensors"]):
        if s.get("kind") not in SENSOR_KINDS:
            raise ConfigError("config.json: sensors[%d].kind must be one of %s" % (i, SENSOR_KINDS))
        if not s.get("name"):
            raise ConfigError("config.json: sensors[%d].name is required" % i)
    return out


def load(path="config.json"):
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError:
        raise ConfigError("%s: not found; copy config.example.json and edit it" % path)
    except ValueError as e:
        raise ConfigError("%s: not valid JSON (%s)" % (path, e))
    if not isinstance(data, dict):
        raise ConfigError("%s: must hold a JSON object" % path)
    return merged(data)
