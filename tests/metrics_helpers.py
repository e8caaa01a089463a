"""Scraping a live gateway's /metrics, parsed by prometheus-client's own parser."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from devkit.gateway_helpers import GatewayProc

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]

# The sample names a family of each type exposes (prometheus-client's text format 0.0.4).
SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "info": ("_info",),
    "stateset": ("",),
    "histogram": ("_bucket", "_count", "_sum", "_created"),
    "gaugehistogram": ("_bucket", "_gcount", "_gsum"),
    "summary": ("", "_count", "_sum", "_created"),
    "unknown": ("",),
}


def scrape_text(gw: GatewayProc) -> str:
    with urllib.request.urlopen(gw.url("/metrics"), timeout=5) as r:
        text: str = r.read().decode()
    return text


def samples(text: str) -> Samples:
    """Each sample's value by (name, sorted labels)."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }


def exported_names(text: str) -> set[str]:
    """Every metric name a query may use: each sample's, and the names each declared family
    exposes by its type (a counter ``x`` as ``x_total``), for families with no sample yet."""
    names: set[str] = set()
    for f in text_string_to_metric_families(text):
        names.update(s.name for s in f.samples)
        names.update(f.name + suffix for suffix in SUFFIXES[f.type])
    return names
