# The node: load config.json and run the loop. A crash reboots the node (after a
# pause, so a bad config does not boot-loop the flash to death).
import sys
import time

import machine

from pubnode import config
from pubnode.app import Node

try:
    Node(config.load()).run()
except config.ConfigError as e:
    print(e)
    time.sleep(60)  # leave time to fix it over mpremote before the reset
    machine.reset()
except Exception as e:  # noqa: BLE001 - any other failure: log, then reset
    print("node failed: %r" % e)
    sys.print_exception(e)
    time.sleep(5)
    machine.reset()
