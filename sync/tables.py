"""Tables as an operator reads them: in a terminal (``pubcomp status``, ``pubcomp fleet
status``) and in a page (the gateway's status page, the report and its fleet page).

Here because both the gateway and the pipeline draw them, and neither may import
the other (docs/architecture.md, "Layers"). Plain strings in, plain strings out;
nothing imported beyond the standard library.
"""

from __future__ import annotations

import html
from collections.abc import Iterable, Sequence


def text_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Columns padded to their widest cell, two spaces apart, no trailing blanks."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
        for r in [header, *rows]
    )


class Raw(str):
    """A cell that is HTML already (an inline chart): written as it is, not escaped."""

    __slots__ = ()


def html_row(cells: Iterable[str], *, attrs: str = "", classes: Sequence[str | None] = ()) -> str:
    """``<tr{attrs}>`` of ``<td>`` cells, escaped unless ``Raw``; ``classes``: the class
    of the first cells, in order (None: none)."""
    tds = []
    for i, cell in enumerate(cells):
        cls = classes[i] if i < len(classes) else None
        text = cell if isinstance(cell, Raw) else html.escape(cell)
        tds.append((f'<td class="{cls}">' if cls else "<td>") + text + "</td>")
    return f"<tr{attrs}>{''.join(tds)}</tr>"


def html_table(header: Sequence[str], rows: Iterable[str], *, tid: str | None = None) -> str:
    """A ``<table>`` (with ``id`` ``tid``) of a header row and ``rows`` made by
    ``html_row``."""
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    ident = f' id="{html.escape(tid)}"' if tid else ""
    return f"<table{ident}><tr>{head}</tr>{''.join(rows)}</table>"
