"""The exit codes of the commands an operator's checks run, in one table
(docs/operations.md, "Reading status" and "The fleet seen from the cloud").

``pubcomp status`` speaks for one gateway, from its health port; ``pubcomp fleet
status`` and ``pubcomp fleet watch --once`` for every gateway, from what the cloud
has heard. Where a code means the same, it is the same number on both sides, so a
gateway's code in the fleet is the code its own ``pubcomp status`` gives:

- 0: the gateway runs, is healthy and delivers / every gateway does;
- 1 ``EXIT_UNHEALTHY``: it runs, but a task died or its store does not answer;
  ``EXIT_FAILED`` (``pubcomp node update --no-revert``): a wave failed, the rollout halted;
- 2 ``EXIT_USAGE``: the command was wrong (fleet: or its source cannot be read);
- 3 ``EXIT_NOT_RUNNING`` (``pubcomp status``): nothing answers on its health port;
  ``EXIT_OFFLINE`` (fleet): a gateway's Will came, it stopped, or it went silent;
- 4 ``EXIT_NOT_DELIVERING``: it runs, but its uplink is down or stalled: readings
  wait on its disk;
- 5 ``EXIT_CLOCK`` (fleet only): a gateway's clock is not synchronised;
- 6 ``EXIT_DISK`` (fleet only): a gateway's store is near its quota, or its disk full;
- 7 ``EXIT_ROLLOUT_HALTED`` (``pubcomp fleet rollout``, ``pubcomp node update``): a
  wave's gate failed; the rollout stopped and reverted the gateways (nodes) it had
  updated;
- 8 ``EXIT_REVERT_FAILED`` (``pubcomp node update``): the rollout halted, and at least
  one node it had updated could not be taken back: it may run the version that failed;
- 9 ``EXIT_UNEXPLAINED`` (``pubcomp fleet completeness``): the warehouse misses
  readings that no gateway's ledger explains (held, evicted, dead-lettered, refused,
  dropped on the node): the alarm.

3 has two names because it says two things: "not running" is what the gateway's
own machine can know, "offline" what the cloud can (a gateway whose network is cut
may still run). They share the number because both mean "not seen running: go and
look at the gateway itself", and a check reads them alike; a check that must tell
them apart knows which command it ran.

``pubcomp gateway run`` has codes of its own: 2 a bad argument, 1 it could not
start (a fleet file problem, another gateway running, a port in use), and
``EXIT_STORE_UNWRITABLE``.

Nothing here imports anything: ``pubcomp``'s argument parsing reads these.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_UNHEALTHY = 1
EXIT_FAILED = 1  # node update --no-revert: a wave failed; the rollout halted there
EXIT_USAGE = 2  # argparse exits 2 as well
EXIT_NOT_RUNNING = 3  # pubcomp status: nothing answers on the gateway's health port
EXIT_OFFLINE = 3  # fleet: a gateway is offline (its Will, a clean stop) or silent
EXIT_NOT_DELIVERING = 4  # the uplink is down or stalled: readings wait on the gateway's disk
EXIT_CLOCK = 5  # fleet: a gateway's clock is not synchronised: its readings are flagged
EXIT_DISK = 6  # fleet: a gateway's store is near its quota, or its disk nearly full
EXIT_ROLLOUT_HALTED = 7  # fleet rollout, node update: a gate failed; halted and reverted
EXIT_REVERT_FAILED = 8  # node update: halted, and a node's revert failed (or was impossible)
EXIT_UNEXPLAINED = 9  # fleet completeness: readings missing that no ledger explains
# pubcomp gateway run: EX_TEMPFAIL (sysexits.h): the store's card refuses writes;
# trying again later may work (systemd starts it again: each start probes the card).
EXIT_STORE_UNWRITABLE = 75
