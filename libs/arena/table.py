"""Tables a person reads: headers, aligned columns, one line per row (``arena status``).

Cells never break a line (newlines and tabs become spaces). When the table is wider than the
terminal, the last column (free text: a reason) is cut with ``…``, then the columns named in
``drop`` are left out, in that order, until it fits; identifiers are never cut.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence

#: The narrowest the last column is cut to before other columns are left out.
MIN_LAST = 12
GAP = "  "


def _cell(value: object) -> str:
    return " ".join(str(value).split()) if value is not None else "-"


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]], *, width: int | None = None,
                 right: Sequence[str] = (), drop: Sequence[str] = ()) -> list[str]:
    """The table's lines: the header, then a line per row. ``right``: headers of columns aligned
    right (numbers). ``drop``: headers of columns to leave out, first to last, while the table is too
    wide. ``width``: the terminal's (``COLUMNS``; 120 off a terminal) unless given."""
    width = width if width is not None else shutil.get_terminal_size((120, 24)).columns
    columns = list(headers)
    cells = [[_cell(v) for v in row] for row in rows]
    widths = {h: max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(headers)}

    def fixed(cols: list[str]) -> int:  # every column but the last, and the gaps
        return sum(widths[h] for h in cols[:-1]) + len(GAP) * (len(cols) - 1)

    for name in drop:
        if fixed(columns) + min(widths[columns[-1]], MIN_LAST) <= width:
            break
        if name in columns[:-1]:
            columns.remove(name)
    last = columns[-1]
    room = max(MIN_LAST, len(last), width - fixed(columns))
    index = {h: i for i, h in enumerate(headers)}

    def line(values: Sequence[str]) -> str:
        parts = []
        for h in columns:
            v = values[index[h]]
            if h == last:
                parts.append(v if len(v) <= room else v[:room - 1] + "…")
            else:
                parts.append(v.rjust(widths[h]) if h in right else v.ljust(widths[h]))
        return GAP.join(parts).rstrip()

    return [line(list(headers)), *(line(r) for r in cells)]
