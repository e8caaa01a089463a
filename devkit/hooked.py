"""``pubcomp`` with the test hooks installed: the only way they act (issue 25).

    python devkit/hooked.py gateway run --config fleet.yaml   # as `pubcomp gateway run ...`

The product reads no test hook from its environment: a variable left in
/etc/pubcomp/environment must not make an installed gateway kill itself or
lie about its clock. Tests, benchmarks and the demo start processes through
this file (``command(...)``), which reads the hooks from the environment,
installs them, then runs the normal main. It is not in the wheel (devkit/ is
never installed; tests/test_wheel.py checks).

- ``PUBCOMP_CRASH_AT=point[:n]`` (and ``PUBCOMP_CRASH_MARKER=path``): the n-th pass
  through a crash point SIGKILLs the process (``pubcomp.sync.faults.arm``);
- ``PUBCOMP_CLOCK_KERNEL=synced|unsynced``: what the gateway believes the kernel
  says of its clock (``pubcomp.gateway.clock.force_kernel_state``).

The sensor commit log, an audit feature, is the fleet file's ``store.commit_log``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

HERE = Path(__file__).resolve()
CRASH_AT, CRASH_MARKER, CLOCK_KERNEL = (
    "PUBCOMP_CRASH_AT",
    "PUBCOMP_CRASH_MARKER",
    "PUBCOMP_CLOCK_KERNEL",
)
HOOKS = (CRASH_AT, CRASH_MARKER, CLOCK_KERNEL)


def command(*args: str) -> list[str]:
    """The argv that runs ``pubcomp ARGS`` with the hooks of its environment installed."""
    return [sys.executable, str(HERE), *args]


def install(env: Mapping[str, str] = os.environ) -> list[str]:
    """Install the hooks ``env`` names; what was installed, for the log."""
    done = []
    spec = env.get(CRASH_AT)
    if spec:
        from pubcomp.sync import faults

        point, _, n = spec.partition(":")
        faults.arm(point, int(n or 1), env.get(CRASH_MARKER) or None)
        done.append(f"{CRASH_AT}={spec}")
    clock = env.get(CLOCK_KERNEL, "").strip().lower()
    if clock:
        if clock not in ("synced", "unsynced"):
            raise SystemExit(f"{CLOCK_KERNEL}={clock!r}: expected synced or unsynced")
        from pubcomp.gateway import clock as gateway_clock

        gateway_clock.force_kernel_state(clock == "synced")
        done.append(f"{CLOCK_KERNEL}={clock}")
    return done


def main(argv: Sequence[str] | None = None) -> int:
    install()
    from pubcomp.cli import main as pubcomp_main

    return pubcomp_main(argv)


if __name__ == "__main__":
    # Run as a file: its folder went first on sys.path, where nothing should be imported from.
    if sys.path and Path(sys.path[0]).resolve() == HERE.parent:
        del sys.path[0]
    sys.exit(main())
