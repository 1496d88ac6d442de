"""Plain-text tables for the CLI (left-aligned columns, two spaces apart)."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["render_table"]


def render_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> list[str]:
    """The lines of a table: the header, then one line per row."""
    cells = [[str(c) for c in header], *[[str(c) for c in row] for row in rows]]
    widths = [max(len(line[i]) for line in cells) for i in range(len(header))]
    return [
        "  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in cells
    ]
