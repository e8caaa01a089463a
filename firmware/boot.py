# Runs first at every boot: pick the set of application files (pubboot.py: a
# pending update is tried once, a failed one rolled back), then bring Wi-Fi up
# (bounded wait; main.py keeps trying). The set is picked before anything of it
# is imported: MicroPython keeps modules imported here for main.py.
import sys

sys.path.append("/lib")

try:
    import pubboot

    pubboot.select()
    pubboot.select_image()
except Exception as e:  # noqa: BLE001 - the factory set in /lib runs instead
    print("boot: software selection failed: %r" % e)

try:
    from pubnode import config
    from pubnode.wifi import Wifi

    _cfg = config.load()
    Wifi(_cfg["wifi"]["ssid"], _cfg["wifi"]["password"]).wait(_cfg["wifi"]["timeout_s"])
except Exception as e:  # noqa: BLE001 - main.py reports a bad config; boot must not stop here
    print("boot: %r" % e)
