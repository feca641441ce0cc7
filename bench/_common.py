"""Small helpers shared by the benches: a table, the --json last line, a stderr progress bar, percentiles."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np


def stats_ms(values_s: Sequence[float], name: str, pcts: Iterable[int] = (99,)) -> dict[str, float]:
    """bench_serving's mean/median/std/pNN fields, in ms, from values in seconds (0 when empty)."""
    a = np.asarray(values_s, dtype=np.float64) * 1000.0
    empty = a.size == 0
    out = {
        f"mean_{name}_ms": 0.0 if empty else float(a.mean()),
        f"median_{name}_ms": 0.0 if empty else float(np.median(a)),
        f"std_{name}_ms": 0.0 if empty else float(a.std()),
    }
    for p in pcts:
        out[f"p{p}_{name}_ms"] = 0.0 if empty else float(np.percentile(a, p))
    return out


def print_table(title: str, rows: Sequence[tuple[str, Any]], *, file: Any = None) -> None:
    file = file or sys.stdout
    width = max([len(k) for k, _ in rows] + [20]) + 2
    print(f"{'=' * 12} {title} {'=' * 12}", file=file)
    for k, v in rows:
        if isinstance(v, float):
            v = f"{v:.2f}"
        print(f"{k + ':':<{width}}{v}", file=file)
    print("=" * (26 + len(title)), file=file, flush=True)


def print_grid(header: Sequence[str], rows: Sequence[Sequence[Any]], *, title: str = "", file: Any = None) -> None:
    """Right-aligned columns under a header rule; floats with 2 decimals."""
    file = file or sys.stdout
    cells = [[f"{c:.2f}" if isinstance(c, float) else str(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(header)]
    if title:
        print(title, file=file)
    print("  ".join(h.rjust(w) for h, w in zip(header, widths)), file=file)
    print("  ".join("-" * w for w in widths), file=file)
    for r in cells:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)), file=file)
    file.flush()


def add_model_arg(p: Any) -> None:
    """``--model DIR``: the model dir a bench runs (a supported Hugging Face MoE dir, or one we wrote)."""
    p.add_argument(
        "--model",
        type=Path,
        default=None,
        metavar="DIR",
        help='model dir: any supported Hugging Face MoE checkpoint (design §2 "Models"); default: the shipped '
        "tiny Qwen3-MoE",
    )


def model_dir(arg: Path | None) -> Path:
    """``--model``'s dir, checked (a one-line SystemExit naming what is missing), or the shipped default."""
    from t1async.model.modeldir import check_model_dir
    from t1async.model.weights import default_model_dir
    from t1async.protocol.errors import ConfigError

    if arg is None:
        return default_model_dir()
    try:
        return check_model_dir(arg, "--model")
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def trainable_routing(routing: np.ndarray, dense_layers: Sequence[int]) -> np.ndarray:
    """A forward's routing ``[T, layers, k]`` as a segment carries it (int16): a dense layer routes nothing, so
    its rows are missing (-1), as ingest makes SGLang's zero rows for such a layer (design §2 "Models")."""
    out = routing.astype(np.int16)
    out[:, list(dense_layers)] = -1
    return out


def emit_json(obj: dict) -> None:
    """The machine-readable result: one JSON object, the last line of stdout (design §11)."""
    print(json.dumps(obj, sort_keys=True), flush=True)


class Progress:
    """A one-line progress bar on stderr (only when stderr is a terminal, unless forced)."""

    def __init__(self, total: int, label: str = "", *, enabled: bool | None = None) -> None:
        self.total, self.label, self.done = max(total, 1), label, 0
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self.t0 = time.perf_counter()

    def advance(self, n: int = 1) -> None:
        self.done += n
        if not self.enabled:
            return
        frac = min(self.done / self.total, 1.0)
        bar = "#" * int(30 * frac) + "." * (30 - int(30 * frac))
        elapsed = time.perf_counter() - self.t0
        sys.stderr.write(f"\r{self.label} [{bar}] {self.done}/{self.total} {elapsed:6.1f}s")
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")
            sys.stderr.flush()
