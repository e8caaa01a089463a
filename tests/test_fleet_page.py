"""The report's fleet page (pipeline/fleetpage.py) during a rollout: each gateway's
release, its apply state as a badge, what was rolled back there and why."""

from __future__ import annotations

import re
from html.parser import HTMLParser
from typing import Any

from pubcomp.pipeline import fleet, fleetpage

from .test_fleet_view import NOW, status

SHA = "ab" * 32


def _release(**over: Any) -> dict[str, Any]:
    r: dict[str, Any] = {
        "version": 1,
        "sha256": SHA,
        "state": "committed",
        "previous": None,
        "bad": [],
        "last_error": None,
    }
    return {**r, **over}


class Cells(HTMLParser):
    """The release cell of each gateway's row: its text and its badge's state."""

    def __init__(self) -> None:
        super().__init__()
        self.col = -1
        self.gw: str | None = None
        self.text: dict[str, str] = {}
        self.badge: dict[str, str] = {}
        self.rel = fleet.HEADER.index("release")

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "tr":
            self.gw, self.col = a.get("data-gateway"), -1
        elif tag == "td":
            self.col += 1
        elif tag == "span" and self.gw and self.col == self.rel and "data-release-state" in a:
            self.badge[self.gw] = a["data-release-state"] or ""

    def handle_data(self, data: str) -> None:
        if self.gw and self.col == self.rel:
            self.text[self.gw] = self.text.get(self.gw, "") + data


def test_the_page_shows_each_gateways_release_state_and_what_was_rolled_back() -> None:
    why = "trial failed: sensors not reading: pm-gw-b"
    views = [
        fleet.view(status("gw-a", release=_release(version=2, previous=1)), seen=NOW - 5),
        fleet.view(
            status(
                "gw-b",
                release=_release(
                    version=2, candidate=2, state="rolling_back", previous=1, last_error=why
                ),
            ),
            seen=NOW - 5,
        ),
        fleet.view(
            status("gw-c", release=_release(state="rolled_back", bad=[2], last_error=why)),
            seen=NOW - 5,
        ),
        fleet.view(status("gw-d"), seen=NOW - 5),  # run without --release-dir
    ]
    page = fleetpage.render(views, "/wh", NOW)
    cells = Cells()
    cells.feed(page)
    assert cells.badge == {"gw-a": "committed", "gw-b": "rolling_back", "gw-c": "rolled_back"}
    assert re.sub(r"\s+", " ", cells.text["gw-b"]).startswith("2 \u2192 2 rolling back")
    assert why in cells.text["gw-b"]
    assert "bad: 2" in cells.text["gw-c"] and why in cells.text["gw-c"]
    assert cells.text["gw-d"] == "-"
    # Each state stands out by its own colour.
    for state in ("committed", "rolling_back", "rolled_back", "trial", "refused"):
        assert re.search(rf"\.rel\.{state}[,{{]", page), state


def test_text_in_a_release_is_escaped() -> None:
    v = fleet.view(
        status("gw-x", release=_release(state="refused<b>", last_error="<script>x</script>")),
        seen=NOW - 5,
    )
    page = fleetpage.render([v], "/wh", NOW)
    assert "<script>x" not in page and "&lt;script&gt;x" in page
    assert 'data-release-state="refusedb"' in page
