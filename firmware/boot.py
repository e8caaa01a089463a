# Runs first at every boot: bring Wi-Fi up (bounded wait; main.py keeps trying).
import sys

sys.path.append("/lib")

try:
    from pubnode import config
    from pubnode.wifi import Wifi

    _cfg = config.load()
    Wifi(_cfg["wifi"]["ssid"], _cfg["wifi"]["password"]).wait(_cfg["wifi"]["timeout_s"])
except Exception as e:  # noqa: BLE001 - main.py reports a bad config; boot must not stop here
    print("boot: %r" % e)
