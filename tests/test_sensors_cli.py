"""``pubcomp sensor test`` as a field technician runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import tty

from pubcomp.sensors import nmea, registry


def pubcomp(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pubcomp", *args], capture_output=True, text=True, timeout=timeout
    )


def test_reads_a_gps_on_a_pty_and_prints_json_lines() -> None:
    master, slave = os.openpty()
    tty.setraw(master)
    path = os.ttyname(slave)
    stop = threading.Event()

    def feed() -> None:
        gga = nmea.sentence("GPGGA,123519,4807.038,N,01131.000,E,1,08,0.9,545.4,M,46.9,M,,")
        while not stop.is_set():
            os.write(master, b"$GPXXX,no checksum\r\n" + gga)
            time.sleep(0.05)

    t = threading.Thread(target=feed, daemon=True)
    t.start()
    try:
        res = pubcomp("sensor", "test", "--type", "nmea", "--port", path, "--count", "4")
    finally:
        stop.set()
        t.join()
        os.close(master)
        os.close(slave)
    assert res.returncode == 0, res.stderr
    lines = [json.loads(ln) for ln in res.stdout.splitlines()]
    assert len(lines) == 4
    assert {ln["sensor"] for ln in lines} >= {"nmea.fix", "nmea.satellites"}
    assert "fault: nmea: bad_frame" in res.stderr  # broken frames reported on stderr


def test_clear_errors_for_a_missing_port_or_pin() -> None:
    res = pubcomp("sensor", "test", "--type", "pms5003", "--port", "/dev/ttyUSB99")
    assert res.returncode == 1 and "could not open port /dev/ttyUSB99" in res.stderr
    res = pubcomp("sensor", "test", "--type", "pulse")
    assert res.returncode == 1 and "--pin is needed" in res.stderr
    res = pubcomp("sensor", "test", "--type", "pulse", "--pin", "17", "--gpio", "rpigpio")
    assert res.returncode == 1 and "RPi.GPIO cannot be used here" in res.stderr


def test_simulated_pulse_counter_from_the_command_line() -> None:
    res = pubcomp(
        "sensor",
        "test",
        "--type",
        "pulse",
        "--pin",
        "17",
        "--gpio",
        "simulated",
        "--interval",
        "0.2",
        "--count",
        "3",
        "--option",
        "scale=0.2794",
        "--option",
        'unit="mm"',
    )
    assert res.returncode == 0, res.stderr
    lines = [json.loads(ln) for ln in res.stdout.splitlines()]
    assert [ln["sensor"] for ln in lines] == ["pulse.count", "pulse.total", "pulse.rate"]
    assert lines[0]["unit"] == "mm" and lines[2]["unit"] == "mm/h"


def test_the_help_lists_every_registered_type_with_what_it_needs() -> None:
    res = pubcomp("sensor", "test", "--help")
    assert res.returncode == 0, res.stderr
    listed = res.stdout.split("sensor types (--type)")[1].splitlines()[1:]
    rows = {ln.split()[0]: ln for ln in listed if ln.strip()}
    assert list(rows) == list(registry.names())
    for name, kind in registry.sensor_types().items():
        assert kind.summary in rows[name]
    assert "--pin" in rows["pulse"] and "--port" in rows["nmea"]
