"""The Grafana dashboard (examples/grafana/pubcomp-dashboard.json) and the alert rules
(examples/prometheus/pubcomp-alerts.yml) name only metrics a gateway exports: every PromQL
query of both is read for its metric names, and each name is looked up in the /metrics of a
real gateway process with sensors, a node and an uplink to a real Mosquitto. The dashboard's
queries are valid PromQL by promtool, and each filters by the dashboard's job and instance.
"""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from devkit.broker import Mosquitto
from devkit.gateway_helpers import GatewayProc, PahoNode
from devkit.node_helpers import wait_until

from .metrics_helpers import exported_names, samples, scrape_text
from .test_prometheus_rules import alert_rules, needs_promtool

DASHBOARD = Path(__file__).parent.parent / "examples" / "grafana" / "pubcomp-dashboard.json"
SENSORS = [
    {"id": "temp", "type": "simulated", "signal": "sine", "unit": "C", "interval_s": 0.1},
    {"id": "rain", "type": "pulse", "pin": 17, "interval_s": 0.5, "simulated_rate_hz": 20},
]
# Prometheus's own metric for each scrape target: the one name not from the gateway.
PROMETHEUS_OWN = {"up"}

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_IDENT = re.compile(r"(?<![\w:$.])[A-Za-z_:][\w:]*")
_KEYWORDS = {"and", "or", "unless", "bool", "offset", "inf", "nan"}
_SELECTOR = re.compile(r"(?<![\w:$])(pubcomp_[\w:]*|up)\s*(\{[^}]*\})?")


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression (or a Grafana ``label_values(...)``) reads.

    Out go string literals (``event="dropped_quota"`` names no metric), the label lists of
    ``by``/``without``/``on``/``ignoring``/``group_left``/``group_right``, label matchers
    ``{...}`` and ranges ``[...]``; what is left of the identifiers are functions (followed
    by ``(``), keywords, and the metric names.
    """
    if expr.startswith("label_values("):
        expr = expr.removeprefix("label_values(").rsplit(",", 1)[0]
    bare = _STRING.sub('""', expr)
    bare = _GROUPING.sub(" ", bare)
    bare = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", bare)
    return {
        m.group(0)
        for m in _IDENT.finditer(bare)
        if not bare[m.end() :].lstrip().startswith("(") and m.group(0).lower() not in _KEYWORDS
    }


def test_metric_names_are_read_out_of_promql() -> None:
    names = metric_names
    rate = 'sum by (instance) (rate(pubcomp_a_total{job=~"$job", event="b"}[$__rate_interval]))'
    assert names(rate) == {"pubcomp_a_total"}
    assert names("pubcomp_store_bytes / pubcomp_store_quota_bytes > 0.8") == {
        "pubcomp_store_bytes",
        "pubcomp_store_quota_bytes",
    }
    assert names('label_values(pubcomp_up_seconds{job=~"$job"}, instance)') == {
        "pubcomp_up_seconds"
    }
    assert names("time() - (pubcomp_node_last_seen_timestamp_seconds > 0)") == {
        "pubcomp_node_last_seen_timestamp_seconds"
    }
    assert names('count(up{job="pubcomp"} == 0) or vector(0)') == {"up"}
    assert names("changes(pubcomp_start_timestamp_seconds[1h]) >= 3") == {
        "pubcomp_start_timestamp_seconds"
    }
    assert names("sum by (up) (x) unless on (instance) group_left (fleet) y offset 5m") == {
        "x",
        "y",
    }
    assert names("sum(x) without (sensor) > bool 1e6 and max_over_time(z[1h:5m])") == {"x", "z"}


def _panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for p in panels:
        yield p
        yield from _panels(p.get("panels", []))  # a collapsed row keeps its panels inside


def dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def dashboard_queries() -> list[tuple[str, str]]:
    """(where, PromQL) for every panel target and every query variable."""
    d = dashboard()
    out = [
        (f"panel {p['id']} {p['title']!r} target {t['refId']}", t["expr"])
        for p in _panels(d["panels"])
        for t in p.get("targets", [])
    ]
    for v in d["templating"]["list"]:
        if v["type"] == "query":
            q = v["query"]
            out.append((f"variable {v['name']}", q["query"] if isinstance(q, dict) else q))
    return out


def test_dashboard_is_a_real_dashboard() -> None:
    d = dashboard()
    assert d["uid"] and d["title"] and d["schemaVersion"] >= 36
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert {"job", "instance"} <= variables.keys()
    panels = list(_panels(d["panels"]))
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for p in panels:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24 and g["w"] > 0 and g["h"] > 0, p["title"]
        if p["type"] == "row":
            continue
        assert p["targets"] and p.get("description"), p["title"]
        for t in p["targets"]:
            assert t["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
    # Each selector of a gateway metric keeps to the chosen jobs and instances.
    for where, expr in dashboard_queries():
        for name, matchers in _SELECTOR.findall(expr):
            if where.startswith("variable"):
                continue
            assert 'job=~"$job"' in matchers and 'instance=~"$instance"' in matchers, (
                f"{where}: {name}{matchers}"
            )
    # What an operator of many gateways looks for is on it.
    used = set().union(*(metric_names(e) for _, e in dashboard_queries()))
    wanted = {
        "pubcomp_uplink_connected",
        "pubcomp_backlog_readings",
        "pubcomp_oldest_reading_age_seconds",
        "pubcomp_uplink_delivered_readings_total",
        "pubcomp_store_bytes",
        "pubcomp_store_quota_bytes",
        "pubcomp_flash_bytes_per_day",
        "pubcomp_flash_life_years",
        "pubcomp_store_fsyncs_total",
        "pubcomp_store_commits_total",
        "pubcomp_sensor_readings_total",
        "pubcomp_node_messages_total",
        "pubcomp_node_connected",
        "pubcomp_clock_synced",
        "pubcomp_start_timestamp_seconds",
    }
    assert wanted - used == set()


def _as_promql(expr: str) -> str:
    """A dashboard query as Prometheus sees it once Grafana has put in its variables."""
    if expr.startswith("label_values("):
        expr = expr.removeprefix("label_values(").rsplit(",", 1)[0]
    return (
        expr.replace("$__rate_interval", "1m")
        .replace('"$job"', '"pubcomp"')
        .replace('"$instance"', '".*"')
    )


@needs_promtool
def test_dashboard_queries_are_promql(tmp_path: Path) -> None:
    """promtool parses each query, put in a recording rule (it checks nothing else there)."""
    queries = dashboard_queries()
    rules = [
        {"record": f"dashboard:q{i}", "expr": _as_promql(e)} for i, (_, e) in enumerate(queries)
    ]
    path = tmp_path / "dashboard-queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    out = subprocess.run(
        ["promtool", "check", "rules", str(path)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(rules)} rules found" in out.stdout


CLOUD_METRICS = "pubcomp_completeness_"


def test_every_metric_named_is_exported_by_a_live_gateway(
    tmp_path: Path, mosquitto: Mosquitto
) -> None:
    gw = GatewayProc(
        tmp_path,
        mosquitto.port,
        sensors=SENSORS,
        nodes={"node-1": "pw-1"},
        extra={"store": {"quota_mb": 50}},
    )
    gw.start()
    node = PahoNode("node-1", "pw-1", gw.ingress_port).start()
    try:
        # Wait until every kind of series has samples: readings delivered, the node's counted.
        def ready() -> bool:
            s = samples(scrape_text(gw))
            return (
                s.get(("pubcomp_uplink_delivered_readings_total", ()), 0) > 0
                and s.get(("pubcomp_node_messages_total", (("node", "node-1"),)), 0) > 0
                and s.get(("pubcomp_sensor_readings_total", (("sensor", "rain"),)), 0) > 0
            )

        assert wait_until(ready, 30, step=0.2), scrape_text(gw)
        text = scrape_text(gw)
    finally:
        node.stop()
        assert gw.terminate() == 0
    exported = exported_names(text)
    assert len(exported) > 30, text
    # The cloud's alerts name the pipeline's metrics (a textfile, not a gateway's /metrics:
    # tests/test_completeness.py checks those).
    gateway_alerts = [r for r in alert_rules() if not r["expr"].startswith(CLOUD_METRICS)]
    queries = dashboard_queries() + [(f"alert {r['alert']}", r["expr"]) for r in gateway_alerts]
    assert len(queries) > 40
    missing: dict[str, set[str]] = {}
    for where, expr in queries:
        names = metric_names(expr)
        assert names, f"{where} names no metric: {expr}"
        unknown = names - exported - PROMETHEUS_OWN
        if unknown:
            missing[where] = unknown
    assert not missing, f"not on the gateway's /metrics: {missing}"
    # up (Prometheus's, not the gateway's) only where nothing the gateway says can tell.
    with_up = {w for w, e in queries if "up" in metric_names(e)}
    assert with_up == {
        "alert PubcompGatewayUnreachable",
        "panel 2 'Gateways not answering' target A",
    }


def test_a_misspelt_metric_would_be_caught() -> None:
    """The check above is not vacuous: a name the gateway does not export is reported."""
    text = "# HELP pubcomp_backlog_readings x\n# TYPE pubcomp_backlog_readings gauge\n"
    text += "pubcomp_backlog_readings 3.0\n# TYPE pubcomp_store_commits counter\n"
    exported = exported_names(text)
    assert {"pubcomp_backlog_readings", "pubcomp_store_commits_total"} <= exported
    assert metric_names("rate(pubcomp_store_commit_total[5m])") - exported == {
        "pubcomp_store_commit_total"
    }
    assert metric_names("pubcomp_backlog_reading > 0") - exported == {"pubcomp_backlog_reading"}
