"""GPIO drivers through gpiozero's MockFactory and a fake RPi.GPIO module (no hardware)."""

from __future__ import annotations

import asyncio
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gpiozero.pins.mock as gpiozero_mock
import pytest
from gpiozero.pins.mock import MockFactory

from pubcomp.sensors.digital import DigitalInput
from pubcomp.sensors.pins import GPIOUnavailable, detect, make_factory, rpigpio
from pubcomp.sensors.pins.rpigpio import RPiGPIOFactory
from pubcomp.sensors.pins.simulated import SimulatedFactory
from pubcomp.sensors.pins.zero import GpiozeroFactory
from pubcomp.sensors.pulse import PulseCounter
from tests.sensor_helpers import ListSink


class Ticks:
    """The edges' clock, moved by the test: a burst of bounces stays inside the debounce
    window however long a busy machine pauses between two of its edges."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t

    def wait(self, seconds: float) -> None:
        self.t += seconds


def bounce_pulse(set_level: Callable[[bool], None], ticks: Ticks, bounces: int = 10) -> None:
    """One press of an active-low contact whose closing bounces ``bounces`` times,
    all well inside a few milliseconds."""
    for _ in range(bounces):
        set_level(False)
        set_level(True)
    set_level(False)
    ticks.wait(0.004)
    set_level(True)


def test_pulse_counter_debounces_bursts_gpiozero_mock(monkeypatch: pytest.MonkeyPatch) -> None:
    ticks = Ticks()
    # gpiozero's mock pins stamp an edge by their module's monotonic(): that alone is replaced.
    monkeypatch.setattr(gpiozero_mock, "monotonic", ticks)
    mock = MockFactory()
    factory = GpiozeroFactory(pin_factory=mock)
    pin = factory.input(17, pull="up")
    counter = PulseCounter("rain", pin, scale=0.2794, unit="mm", debounce_s=0.02)
    mp = mock.pin(17)
    for _ in range(5):
        bounce_pulse(lambda lv: mp.drive_high() if lv else mp.drive_low(), ticks)
        ticks.wait(0.03)  # the next press comes after the debounce window
    assert counter.take() == 5
    assert counter.counters["bounces_ignored"] >= 5 * 10
    factory.close()


def test_pulse_counter_report_scale_total_rate_and_restored_total() -> None:
    sim = SimulatedFactory()
    pin = sim.input(5, "up")
    counter = PulseCounter("water", pin, scale=0.5, unit="L", debounce_s=0.01, start_pulses=1000)
    for i in range(12):  # 12 clean pulses, 0.1 s apart on the pin's own clock
        pin.drive(False, t=i * 0.1)
        pin.drive(True, t=i * 0.1 + 0.02)
    sink = ListSink()
    counter.report(sink, elapsed_s=60.0)
    assert sink.values("water.count") == [6.0]  # 12 pulses x 0.5 L
    assert sink.values("water.total") == [506.0]  # the total came back from the store
    assert sink.values("water.rate") == [360.0]  # L/h
    assert [r.unit for r in sink.readings] == ["L", "L", "L/h"]
    assert counter.pulses_total == 1012  # what the gateway persists with the readings


def test_pulse_counter_counts_only_its_edge() -> None:
    sim = SimulatedFactory()
    pin = sim.input(6, "down")
    counter = PulseCounter("s0", pin, edge="rising", debounce_s=0.0)
    for i in range(3):
        pin.drive(True, t=i)
        pin.drive(False, t=i + 0.5)
    assert counter.take() == 3


def test_pulse_counter_run_reports_every_interval() -> None:
    async def main() -> ListSink:
        sim = SimulatedFactory()
        pin = sim.input(7)
        counter = PulseCounter("g", pin, interval_s=0.1, debounce_s=0.0)
        sink = ListSink()
        task = asyncio.create_task(counter.run(sink))
        pin.drive(False)
        pin.drive(True)
        await sink.wait_for(lambda s: len(s.values("g.total")) >= 2, timeout=5)
        task.cancel()
        return sink

    sink = asyncio.run(main())
    assert sink.values("g.total")[:2] == [1.0, 1.0]


class FakeGPIO(types.ModuleType):
    """The part of RPi.GPIO the backend uses, with levels the test sets."""

    BCM, IN, BOTH = 11, 1, 33
    PUD_UP, PUD_DOWN, PUD_OFF = 22, 21, 20

    def __init__(self) -> None:
        super().__init__("RPi.GPIO")
        self.levels: dict[int, bool] = {}
        self.callbacks: dict[int, Callable[[int], None]] = {}
        self.mode: int | None = None
        self.calls: list[tuple[Any, ...]] = []

    def setwarnings(self, flag: bool) -> None:
        pass

    def setmode(self, mode: int) -> None:
        self.mode = mode

    def setup(self, pin: int, direction: int, pull_up_down: int = 20) -> None:
        assert self.mode == self.BCM and direction == self.IN
        self.calls.append(("setup", pin, pull_up_down))
        self.levels[pin] = pull_up_down == self.PUD_UP

    def input(self, pin: int) -> int:
        return int(self.levels[pin])

    def add_event_detect(self, pin: int, edge: int, callback: Any = None, bouncetime: Any = None):  # type: ignore[no-untyped-def]
        assert edge == self.BOTH and bouncetime is None  # software debounce, not RPi.GPIO's
        self.callbacks[pin] = callback

    def remove_event_detect(self, pin: int) -> None:
        self.callbacks.pop(pin, None)

    def cleanup(self, pin: int | None = None) -> None:
        self.calls.append(("cleanup", pin))

    def set_level(self, pin: int, level: bool) -> None:
        if self.levels[pin] != level:
            self.levels[pin] = level
            if pin in self.callbacks:
                self.callbacks[pin](pin)


def test_pulse_counter_on_rpigpio_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    ticks = Ticks()
    # The backend stamps an edge by time.monotonic(): that module's alone is replaced.
    monkeypatch.setattr(rpigpio, "time", types.SimpleNamespace(monotonic=ticks))
    gpio = FakeGPIO()
    factory = RPiGPIOFactory(gpio_module=gpio)
    pin = factory.input(27, "up")
    assert ("setup", 27, gpio.PUD_UP) in gpio.calls
    counter = PulseCounter("rain", pin, debounce_s=0.02)
    for _ in range(3):
        bounce_pulse(lambda lv: gpio.set_level(27, lv), ticks)
        ticks.wait(0.03)
    assert counter.take() == 3
    factory.close()
    assert ("cleanup", 27) in gpio.calls and 27 not in gpio.callbacks


def test_make_factory_rpigpio_imports_the_library_only_when_created(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gpio = FakeGPIO()
    rpi = types.ModuleType("RPi")
    rpi.GPIO = gpio  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "RPi", rpi)
    monkeypatch.setitem(sys.modules, "RPi.GPIO", gpio)
    factory = make_factory("rpigpio")
    assert factory.name == "rpigpio" and gpio.mode == gpio.BCM


def test_rpigpio_off_a_pi_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "RPi", None)  # as here: not installed
    with pytest.raises(GPIOUnavailable, match=r"RPi\.GPIO cannot be used here"):
        make_factory("rpigpio")


@pytest.mark.parametrize(
    ("model", "backends"),
    [
        (b"Raspberry Pi 5 Model B Rev 1.0\x00", ("gpiozero",)),
        (b"Raspberry Pi Compute Module 5 Rev 1.0\x00", ("gpiozero",)),  # a Pi 5 (issue 25)
        (b"Raspberry Pi Compute Module 5 Lite Rev 1.0\x00", ("gpiozero",)),
        (b"Raspberry Pi 500 Rev 1.0\x00", ("gpiozero",)),
        (b"Raspberry Pi Compute Module 4 Rev 1.1\x00", ("rpigpio", "gpiozero")),
        (b"Raspberry Pi 4 Model B Rev 1.5\x00", ("rpigpio", "gpiozero")),
        (b"Raspberry Pi Zero 2 W Rev 1.0\x00", ("rpigpio", "gpiozero")),
        (b"Pine64 RockPro64\x00", ("gpiozero", "rpigpio")),
        (None, ("gpiozero", "rpigpio")),  # masked (a container): real backends all the same
    ],
)
def test_auto_tries_the_real_backends_best_first_and_says_why(
    tmp_path: Path, model: bytes | None, backends: tuple[str, ...]
) -> None:
    path = tmp_path / "model"
    if model is not None:
        path.write_bytes(model)
    picked, why = detect(path)
    assert picked == backends and why


def test_auto_fails_loudly_rather_than_simulate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No model file and no GPIO library that loads (a container, a laptop): an error that
    says what to do, never fake pins (which made up pulses with simulated_rate_hz)."""
    import gpiozero

    monkeypatch.setitem(sys.modules, "RPi", None)  # not installed
    monkeypatch.setattr(gpiozero.Device, "pin_factory", None)  # lgpio: no gpiochip here
    with pytest.raises(GPIOUnavailable) as err:
        make_factory("auto", model_path=tmp_path / "no-such-model")
    text = str(err.value)
    assert "cannot read" in text and "gpio: simulated" in text
    assert "rpigpio: RPi.GPIO cannot be used here" in text and "gpiozero:" in text


def test_auto_takes_the_first_backend_that_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    import gpiozero

    monkeypatch.setitem(sys.modules, "RPi", None)
    monkeypatch.setattr(gpiozero.Device, "pin_factory", MockFactory())  # "lgpio" loads
    factory = make_factory("auto", model_path="/nonexistent/model")
    assert factory.name == "gpiozero"


def test_digital_input_reports_debounced_changes_and_heartbeats() -> None:
    mock = MockFactory()
    factory = GpiozeroFactory(pin_factory=mock)
    door = DigitalInput("door", factory.input(22, "up"), debounce_s=0.05, heartbeat_s=0.3)
    mp = mock.pin(22)

    async def main() -> ListSink:
        sink = ListSink()
        task = asyncio.create_task(door.run(sink))
        await sink.wait_for(lambda s: len(s.readings) == 1)  # the initial state
        for _ in range(8):  # the contact closes with a bounce burst
            mp.drive_low()
            mp.drive_high()
        mp.drive_low()
        await sink.wait_for(lambda s: len(s.values("door")) == 2, timeout=2)
        await sink.wait_for(lambda s: any("heartbeat" in r.flags for r in s.readings), timeout=2)
        task.cancel()
        return sink

    sink = asyncio.run(main())
    values = sink.values("door")
    assert values[:2] == [0.0, 1.0]  # closed (active low) after one debounced change
    assert door.counters["bounces_ignored"] >= 8
    factory.close()
