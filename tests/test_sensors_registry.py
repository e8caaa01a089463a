"""Sensor types register themselves: a driver module declares its type, options and
needs; the registry finds it with nothing else edited, and refuses a declaration that
does not hold together. sensors/ stays apart from the other parts."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from pubcomp.gateway import config
from pubcomp.sensors import registry
from pubcomp.sensors.errors import SensorConfigError
from pubcomp.sensors.registry import Need

ROOT = Path(__file__).resolve().parent.parent

# A sensor type as a new driver module declares it: this module is all there is.
THERMO = """
from typing import Literal

from pubcomp.sensors.registry import Need, Provided, SensorOptions, SensorType
from pubcomp.sensors.simulated import SimulatedSensor


class ThermoOptions(SensorOptions):
    type: Literal["{name}"]
    port: str


def build(cfg: ThermoOptions, provided: Provided) -> SimulatedSensor:
    return SimulatedSensor(cfg.id)


SENSOR = SensorType("{name}", ThermoOptions, build, needs={{Need.SERIAL}}, summary="a thermo")
"""


@pytest.fixture
def package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An empty package on sys.path, standing in for sensors/."""
    pkg = tmp_path / "fakesensors"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield pkg
    for name in [m for m in sys.modules if m.split(".")[0] == "fakesensors"]:
        del sys.modules[name]


def test_a_new_module_is_a_new_type_with_nothing_else_edited(package: Path) -> None:
    (package / "thermo.py").write_text(THERMO.format(name="thermo"))
    (package / "helpers.py").write_text("X = 1\n")  # a module that declares nothing
    found = registry.discover(importlib.import_module("fakesensors"))
    assert list(found) == ["thermo"]
    kind = found["thermo"]
    assert kind.needs == {Need.SERIAL} and kind.summary == "a thermo"
    cfg = kind.parse({"id": "t1", "type": "thermo", "port": "/dev/ttyUSB0"})
    assert kind.build(cfg, registry.Provided()).sensor == "t1"
    with pytest.raises(SensorConfigError, match=r"sensor t1: prot: unknown key"):
        kind.parse({"id": "t1", "type": "thermo", "port": "x", "prot": "y"})


def test_a_type_declared_twice_is_refused(package: Path) -> None:
    (package / "thermo.py").write_text(THERMO.format(name="thermo"))
    (package / "thermo2.py").write_text(THERMO.format(name="thermo"))
    with pytest.raises(SensorConfigError, match="'thermo' is declared twice: in fakesensors"):
        registry.discover(importlib.import_module("fakesensors"))


def test_a_declaration_that_does_not_hold_together_is_refused(package: Path) -> None:
    (package / "thermo.py").write_text(THERMO.format(name="thermo"))
    mod = importlib.import_module("fakesensors.thermo")
    with pytest.raises(SensorConfigError, match=r'must say type: Literal\["hygro"\]'):
        registry.SensorType("hygro", mod.ThermoOptions, mod.build)
    with pytest.raises(SensorConfigError, match="needs i2c: it has no 'bus' option"):
        registry.SensorType("thermo", mod.ThermoOptions, mod.build, needs={Need.I2C})
    with pytest.raises(SensorConfigError, match=r"Need\.STATE and state_key go together"):
        registry.SensorType("thermo", mod.ThermoOptions, mod.build, needs={Need.STATE})


def test_the_fleet_file_and_the_registry_agree() -> None:
    """The config's union is the registry's models: one model per type, none elsewhere."""
    assert registry.names() == config.SENSOR_TYPES
    assert set(registry.names()) >= {"pulse", "digital", "ds18b20", "nmea", "modbus"}
    assert all(kind.summary for kind in registry.sensor_types().values())
    entry = {"id": "t", "type": "ds18b20", "interval_s": 5}
    gw = config.GatewayConfig.model_validate(
        {"id": "g", "fleet": "f", "uplink": {"broker": "mqtt://h:1"}, "sensors": [entry]}
    )
    assert isinstance(gw.sensors[0], registry.get("ds18b20").options)
    assert registry.needing(Need.GPIO) == ("digital", "pulse")
    assert registry.get("pulse").saved_key("rain") == "pulses_total/rain"  # as stores hold it
    with pytest.raises(SensorConfigError, match="unknown sensor type 'thermo'; one of digital"):
        registry.get("thermo")


def test_a_gpio_type_without_a_backend_is_a_clear_error() -> None:
    with pytest.raises(SensorConfigError, match="sensor rain: type pulse needs a GPIO backend"):
        registry.build("pulse", "rain", {"pin": 17})


def test_declaring_the_types_imports_no_hardware_library() -> None:
    """smbus2, pymodbus and the GPIO libraries load when a driver is built, not when the
    fleet file is checked or ``pubcomp`` starts."""
    code = textwrap.dedent(
        """
        import sys
        import pubcomp.gateway.config
        from pubcomp.sensors.registry import sensor_types
        from pubcomp.cli import build_parser
        build_parser()
        assert len(sensor_types()) >= 8
        loaded = sorted(m for m in ("smbus2", "pymodbus", "gpiozero", "RPi", "lgpio")
                        if m in sys.modules)
        print(loaded)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "[]"


def test_sensors_imports_nothing_of_the_other_parts() -> None:
    """sensors/ knows nothing of sync/, gateway/ or pipeline/ (docs/architecture.md)."""
    wrong = []
    for path in sorted((ROOT / "sensors").rglob("*.py")):
        depth = len(path.relative_to(ROOT / "sensors").parts)  # 1: sensors/x.py
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level > depth:  # above sensors/: another part of pubcomp
                    wrong.append(f"{path.name}: from {'.' * node.level}{node.module}")
                names = [node.module or ""]
            wrong += [
                f"{path.name}: {name}"
                for name in names
                if name.startswith(("pubcomp.sync", "pubcomp.gateway", "pubcomp.pipeline"))
            ]
    assert wrong == []
