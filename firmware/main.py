# The node: load config.json and run the loop. A crash reboots the node (after a
# pause, so a bad config does not boot-loop the flash to death). Everything,
# the imports included, is inside the try: a set of application files that
# does not even import must end in a reset, which rolls it back (pubboot.py),
# not at the REPL.
import sys
import time

import machine

try:
    import pubboot
except ImportError:  # a board deployed before node updates: no updates taken
    pubboot = None


def run():
    from pubnode import config
    from pubnode.app import Node

    try:
        cfg = config.load()
    except config.ConfigError as e:
        print(e)
        time.sleep(60)  # leave time to fix it over mpremote before the reset
        machine.reset()
    Node(cfg, bootsel=pubboot).run()


try:
    run()
except Exception as e:  # noqa: BLE001 - any other failure: log, then reset
    print("node failed: %r" % e)
    sys.print_exception(e)
    time.sleep(5)
    machine.reset()
