"""The alert rules operators load (examples/prometheus/pubcomp-alerts.yml), checked by
Prometheus's own ``promtool``: ``check rules`` (syntax, PromQL, templates) and ``test rules``
(pubcomp-alerts.test.yml: each alert fires where it should and stays quiet where it should
not). tests/test_grafana_dashboard.py checks every metric they name against a live gateway.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

HERE = Path(__file__).parent.parent / "examples" / "prometheus"
RULES = HERE / "pubcomp-alerts.yml"
RULE_TESTS = HERE / "pubcomp-alerts.test.yml"

needs_promtool = pytest.mark.skipif(
    shutil.which("promtool") is None,
    reason="promtool missing (apt-get install prometheus; make test installs it)",
)


def alert_rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [r for g in groups for r in g["rules"] if "alert" in r]


def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = ["promtool", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=HERE)


@needs_promtool
def test_promtool_check_rules() -> None:
    out = _promtool("check", "rules", RULES.name)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(alert_rules())} rules found" in out.stdout, out.stdout


@needs_promtool
def test_promtool_test_rules() -> None:
    out = _promtool("test", "rules", RULE_TESTS.name)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout, out.stdout


def test_every_alert_is_tested_firing_and_quiet() -> None:
    """The unit tests cover each alert both ways: a test that expects it (with its text),
    and one that expects nothing."""
    spec = yaml.safe_load(RULE_TESTS.read_text())
    fired: set[str] = set()
    quiet: set[str] = set()
    for t in spec["tests"]:
        for case in t.get("alert_rule_test", []):
            (fired if case.get("exp_alerts") else quiet).add(case["alertname"])
    names = {r["alert"] for r in alert_rules()}
    assert names - fired == set(), "alerts never tested firing"
    assert names - quiet == set(), "alerts never tested staying quiet"
    assert (fired | quiet) <= names, "tests for alerts that do not exist"


def test_every_alert_tells_the_operator_what_to_do() -> None:
    rules = alert_rules()
    assert len(rules) >= 6
    for r in rules:
        assert r["alert"].startswith("Pubcomp"), r["alert"]
        assert r["labels"]["severity"] in ("critical", "warning", "info"), r["alert"]
        ann = r["annotations"]
        assert "{{ $labels.instance }}" in ann["summary"], r["alert"]
        assert len(ann["description"]) > 150, f"{r['alert']}: say what it means and what to do"


def test_every_alert_is_in_the_operations_guide() -> None:
    guide = (Path(__file__).parent.parent / "docs" / "operations.md").read_text()
    section = guide.split("## Prometheus alerts and the Grafana dashboard", 1)[1].split("\n## ")[0]
    missing = [r["alert"] for r in alert_rules() if f"| {r['alert']} |" not in section]
    assert not missing, "add them to the table in docs/operations.md"
