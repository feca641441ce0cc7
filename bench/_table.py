"""Tiny output helpers for benches (DESIGN §11): a human table, and the ``--json`` object as the last stdout line."""

from __future__ import annotations

import json
import sys
from typing import Any, Sequence


def print_table(header: Sequence[str], rows: Sequence[Sequence[Any]], *, title: str = "", file: Any = None) -> None:
    """Right-aligned columns; floats with 2 decimals."""
    file = file or sys.stdout
    cells = [[f"{c:.2f}" if isinstance(c, float) else str(c) for c in r] for r in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(header)]
    if title:
        print(title, file=file)
    print("  ".join(h.rjust(w) for h, w in zip(header, widths)), file=file)
    print("  ".join("-" * w for w in widths), file=file)
    for r in cells:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)), file=file)
    file.flush()


def emit_json(obj: dict) -> None:
    """One JSON object on the last line of stdout, for scripts."""
    print(json.dumps(obj, sort_keys=True), flush=True)
