"""The demo's sensor bench: what the real drivers read when no sensor is wired.

- a PMS5003 on a pseudo-terminal: real 32-byte frames, one a second, as the
  sensor sends them in active mode (the gateway's pyserial driver reads them);
- a DS18B20 as a sysfs 1-Wire directory (``28-.../temperature`` in
  millidegrees), rewritten atomically once a second.

The pulse counter needs nothing here: ``gpio: simulated`` fakes its pin.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import threading
import time
import tty
from pathlib import Path

from pubcomp.sensors import pms5003

PROBE = "28-0000demo0001"


class SensorBench:
    def __init__(self, w1_dir: Path) -> None:
        self.w1 = w1_dir
        (self.w1 / PROBE).mkdir(parents=True, exist_ok=True)
        self.master, self._slave = os.openpty()
        tty.setraw(self._slave)
        os.set_blocking(self.master, False)  # nobody reading (gateway down): drop, never block
        self.pms_port = os.ttyname(self._slave)
        self.frames = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="sensor-bench")

    def start(self) -> SensorBench:
        self._write_probe(time.time())
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            t = time.time()
            self._write_probe(t)
            # Town air: a slow swell over a quarter of an hour, a little noise.
            pm25 = max(int(12 + 3 * math.sin(t / 150) + random.gauss(0, 0.7)), 0)
            frame = pms5003.encode_frame(max(pm25 - 4, 0), pm25, pm25 + 6)
            with contextlib.suppress(BlockingIOError, OSError):
                os.write(self.master, frame)
                self.frames += 1

    def _write_probe(self, t: float) -> None:
        # A cabinet warming and cooling with the day (about a degree an hour at most),
        # with the probe's 1/16 degree steps of noise.
        millideg = int(1000 * (21.5 + 0.4 * math.sin(t / 1800) + random.choice((-1, 0, 1)) / 16))
        tmp = self.w1 / PROBE / "temperature.tmp"
        tmp.write_text(f"{millideg}\n")
        tmp.replace(self.w1 / PROBE / "temperature")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        os.close(self.master)
        os.close(self._slave)
