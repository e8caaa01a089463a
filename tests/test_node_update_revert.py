"""A halted node rollout reverts the nodes it updated (issue 28: part 4's rule for part 5's
node software), with real processes: `pubcomp gateway run`, nodes on the firmware's host
port (firmware/host/run_node.py), and `pubcomp node update` itself. Each node's flash and
console are the independent view: which set its pointer names, what files that set holds,
which set marker its last boot printed (tests/test_node_update.py's make_lib)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from devkit.broker import Mosquitto
from devkit.link import LinkProxy
from devkit.node_helpers import Board, wait_until
from pubcomp.sync.exitcodes import EXIT_REVERT_FAILED, EXIT_ROLLOUT_HALTED
from tests.test_node_update import Site, _image, _otadata, make_lib, runs, same_files

# A set whose link goes to a dead port on node-c only: it works on the first wave's
# nodes (they commit it) and fails on the second wave's (tried, never connects, rolled
# back by boot), which halts the rollout after the first wave committed.
BROKEN_ON_C = {
    "pubnode/link.py": (
        "self.host, self.port = host, port",
        "self.host, self.port = host, (9 if node_id == 'node-c' else port)",
    )
}
NODES = ["node-a", "node-b", "node-c"]


@pytest.fixture
def site(tmp_path: Path, mosquitto: Mosquitto) -> Iterator[Site]:
    s = Site(tmp_path, mosquitto, NODES)
    try:
        yield s
    finally:
        s.close()


def last_marker(board: Board) -> str | None:
    """The set marker the board printed last: the set its code was last imported from
    (the factory set prints none)."""
    found = re.findall(r"^set marker: (\S+)$", board.output(), re.M)
    return found[-1] if found else None


def start(site: Site) -> dict[str, Board]:
    boards = {n: site.board(n).run() for n in NODES}
    assert wait_until(lambda: all(site.software(n) for n in NODES), 30)
    return boards


def test_a_halted_rollout_reverts_the_nodes_it_updated(site: Site) -> None:
    boards = start(site)
    a, b, c = (boards[n] for n in NODES)
    one = make_lib(site.tmp, "one")
    first = site.update("--all", "--files", str(one), "--format", "py", "--waves", "100%",
                        "--timeout", "60")  # fmt: skip
    assert first.returncode == 0, first.stdout + first.stderr
    assert [runs(x) for x in (a, b, c)] == ["1", "1", "1"]

    broken = make_lib(site.tmp, "broken", BROKEN_ON_C)
    done = site.update("--all", "--files", str(broken), "--format", "py", "--waves", "2",
                       "--timeout", "60")  # fmt: skip
    out = done.stdout
    print(out)
    assert "wave 1/2: version 2 offered to node-a, node-b" in out, out + done.stderr
    assert "halted: wave 2: 1 failed (node-c)" in out, out
    # The nodes' own view: node-a and node-b ran set 2 (its marker printed at a boot) and
    # now run set 1's files again, under a new number: the revert.
    for x in (a, b):
        assert "set marker: broken" in x.output(), x.node
        assert wait_until(lambda x=x: last_marker(x) == "one", 10), (
            f"{x.node} runs set {runs(x)}, marker {last_marker(x)}: not set 1's files",
            x.output()[-3000:],
        )
        current = runs(x)
        assert current not in (None, "1", "2"), (x.node, current)
        assert same_files(x.flash / "sets" / current, one), x.node
        assert not (x.flash / "sets" / "2").exists()  # committed sets drop the others
    assert runs(a) == runs(b) == "3"
    for n in ("node-a", "node-b"):
        sw = site.software(n)  # what each node says of itself, through the gateway
        assert (sw["version"], sw["state"]) == (3, "running"), (n, sw)
    # node-c rolled set 2 back by itself and keeps set 1: it is not offered the revert.
    assert runs(c) == "1" and last_marker(c) == "one"
    assert "revert: version 3 (the files of version 1) offered to node-a, node-b" in out, out
    assert re.search(r"^node-a\s+reverted\s+3\s+runs version 3: the files of version 1", out,
                     re.M), out  # fmt: skip
    assert re.search(r"^node-b\s+reverted\s+3\s", out, re.M), out
    assert re.search(r"^node-c\s+rolled_back\s+1\s", out, re.M), out
    assert "reverted: 2 node(s) run what they ran before" in out, out
    assert done.returncode == EXIT_ROLLOUT_HALTED, done.returncode
    # The failed version's offers are gone: no node can take it later.
    offers = site.state / "offers"
    assert not (offers / "node-c.json").exists()
    assert '"version": 3' in (offers / "node-a.json").read_text()


def test_nodes_that_ran_their_factory_set_are_reverted_to_it(site: Site) -> None:
    """The gateway never had the factory set (deploy.sh put it in /lib): the revert is a
    set of kind "factory", no files under a new version, and the node runs /lib under it."""
    boards = start(site)
    a, b, c = (boards[n] for n in NODES)
    broken = make_lib(site.tmp, "broken", BROKEN_ON_C)
    done = site.update("--all", "--files", str(broken), "--format", "py", "--waves", "2",
                       "--timeout", "60")  # fmt: skip
    out = done.stdout
    print(out)
    assert "halted: wave 2: 1 failed (node-c)" in out, out + done.stderr
    for x in (a, b):
        log = x.output()
        assert "set marker: broken" in log, x.node
        assert wait_until(lambda x=x: runs(x) == "2", 10), (x.node, runs(x), log[-3000:])
        assert list((x.flash / "sets" / "2").iterdir()) == []  # nothing of its own: /lib
        # The boot into version 2 imported the factory set: no marker after the switch.
        after = x.output().split("update: version 2 staged beside version 1")[-1]
        assert "update: version 2 committed" in after and "set marker" not in after, after
        assert site.software(x.node)["version"] == 2
    assert runs(c) is None
    assert "revert: version 2 (the factory set) offered to node-a, node-b" in out, out
    assert re.search(r"^node-a\s+reverted\s+2\s+runs version 2: the factory set again", out,
                     re.M), out  # fmt: skip
    assert done.returncode == EXIT_ROLLOUT_HALTED, done.returncode


def test_a_revert_that_cannot_be_made_is_said_and_exits_8(site: Site) -> None:
    """The set node-a and node-b ran was deleted from the gateway by hand: they cannot be
    taken back; the command says so per node and exits EXIT_REVERT_FAILED."""
    boards = start(site)
    one = make_lib(site.tmp, "one")
    first = site.update("--all", "--files", str(one), "--format", "py", "--waves", "100%",
                        "--timeout", "60")  # fmt: skip
    assert first.returncode == 0, first.stdout + first.stderr
    shutil.rmtree(site.state / "sets" / "1")
    broken = make_lib(site.tmp, "broken", BROKEN_ON_C)
    done = site.update("--all", "--files", str(broken), "--format", "py", "--waves", "2",
                       "--timeout", "60")  # fmt: skip
    out = done.stdout
    print(out)
    assert done.returncode == EXIT_REVERT_FAILED, out + done.stderr
    for n in ("node-a", "node-b"):
        assert re.search(rf"^{n}\s+revert_failed\s+2\s+it ran version 1, and this gateway "
                         r"holds no set 1", out, re.M), out  # fmt: skip
        assert runs(boards[n]) == "2"  # still on the version that failed elsewhere
    assert "reverted: 0 node(s) run what they ran before; revert_failed: node-a, node-b" in out
    assert not list((site.state / "offers").iterdir())  # version 2 is offered to no one


def test_no_revert_leaves_the_updated_nodes_on_the_new_version(site: Site) -> None:
    boards = start(site)
    a, b, c = (boards[n] for n in NODES)
    broken = make_lib(site.tmp, "broken", BROKEN_ON_C)
    done = site.update("--all", "--files", str(broken), "--format", "py", "--waves", "2",
                       "--timeout", "60", "--no-revert")  # fmt: skip
    out = done.stdout
    print(out)
    assert done.returncode == 1, out + done.stderr
    assert "halted: wave 2: 1 failed (node-c)" in out, out
    assert "revert:" not in out and "reverted" not in out, out
    for x in (a, b):
        assert runs(x) == "1" and last_marker(x) == "broken", x.node
        assert site.software(x.node)["version"] == 1
    assert runs(c) is None  # it rolled set 1 back: on its factory set again
    assert "pubboot: set 1 did not commit on its try: rolled back to 0" in c.output()
    assert [p.name for p in (site.state / "sets").iterdir()] == ["1"]  # no revert set


def test_an_esp32_image_rollout_that_halts_reverts_to_the_image_before(
    tmp_path: Path, mosquitto: Mosquitto
) -> None:
    """The ESP32 path (esp32.Partition stand-in): image 2 commits on node-e1, then fails its
    trial on node-e2 (its link is down while it tries it; the bootloader goes back), the
    rollout halts, and node-e1 gets image 1's bytes again as image 3, written to its other
    OTA partition, booted and marked valid."""
    site = Site(tmp_path, mosquitto, ["node-e1", "node-e2"])
    link = LinkProxy(site.gw.ingress_port)
    try:
        e1 = site.board("node-e1")
        parts = e1.esp32()
        e2 = site.board("node-e2", port=link.port)
        e2.esp32()
        for b in (e1, e2):
            b.run()
        assert wait_until(lambda: site.software("node-e1") and site.software("node-e2"), 30)
        good = _image(site.tmp, "fw-good", 120_000)
        first = site.update("--all", "--format", "image", "--files", str(good), "--waves",
                            "100%", "--timeout", "60")  # fmt: skip
        assert first.returncode == 0, first.stdout + first.stderr
        assert _otadata(e1)["boot"] == "ota_1"
        second = _image(site.tmp, "fw-second", 100_000)
        cli = subprocess.Popen(
            [sys.executable, "-m", "pubcomp.cli", "node", "update", "--config",
             str(site.gw.fleet), "--gateway", site.gw.gid, "--all", "--waves", "1",
             "--format", "image", "--files", str(second), "--timeout", "60"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        try:
            assert wait_until(lambda: "image 2 written and set to boot" in e2.output(), 60, 0.01)
            link.down()
            assert wait_until(lambda: "the bootloader went back" in e2.output(), 30)
            link.up()
            out, _ = cli.communicate(timeout=120)
        finally:
            if cli.poll() is None:
                cli.kill()
        print(out)
        assert "update: image 2 committed" in e1.output()  # the first wave took it
        assert wait_until(lambda: "update: image 3 committed" in e1.output(), 10), out
        # image 3 went to the partition image 2 did not run from, with image 1's bytes.
        assert _otadata(e1) == {"boot": "ota_1", "state": {"ota_0": "valid", "ota_1": "valid"}}
        data = good.read_bytes()
        assert (parts / "ota_1.bin").read_bytes()[: len(data)] == data
        assert site.software("node-e1")["image"] == 3
        assert (site.software("node-e2")["image"], site.software("node-e2")["image_bad"]) == (1, 2)
        assert "revert: image 3 (the files of image 1) offered to node-e1" in out, out
        assert re.search(r"^node-e1\s+reverted\s+3\s+runs image 3: the files of image 1",
                         out, re.M), out  # fmt: skip
        assert re.search(r"^node-e2\s+rolled_back\s+1\s", out, re.M), out
        assert cli.returncode == EXIT_ROLLOUT_HALTED, out
    finally:
        link.close()
        site.close()
