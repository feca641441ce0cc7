"""Small helpers shared by the benches: tables and a stderr progress bar (rich), the --json last line, percentiles."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from rich import box
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
from rich.progress import Progress as RichProgress
from rich.table import Table


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


def _console(file: Any) -> Console:
    # wide and plain: a bench's output is read in logs and pipes as often as on a terminal
    return Console(file=file or sys.stdout, width=200, highlight=False, color_system=None)


def _cell(v: Any) -> str:
    return f"{v:.2f}" if isinstance(v, float) else str(v)


def print_table(title: str, rows: Sequence[tuple[str, Any]], *, file: Any = None) -> None:
    """``name: value`` rows under a title (floats with 2 decimals), as SGLang's bench_serving prints its result."""
    t = Table(title=title, show_header=False, box=None, pad_edge=False, title_justify="left", title_style="bold")
    t.add_column(no_wrap=True)
    t.add_column(justify="right", no_wrap=True)
    for k, v in rows:
        t.add_row(k, _cell(v))
    _console(file).print(t)


def print_grid(header: Sequence[str], rows: Sequence[Sequence[Any]], *, title: str = "", file: Any = None) -> None:
    """Right-aligned columns under a header rule; floats with 2 decimals."""
    t = Table(
        title=title or None,
        box=box.SIMPLE_HEAD,
        show_edge=False,
        pad_edge=False,
        title_justify="left",
        title_style="bold",
    )
    for h in header:
        t.add_column(h, justify="right", no_wrap=True)
    for r in rows:
        t.add_row(*(_cell(c) for c in r))
    _console(file).print(t)


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
    """A progress bar on stderr (rich; only when stderr is a terminal, unless forced)."""

    def __init__(self, total: int, label: str = "", *, enabled: bool | None = None) -> None:
        self.total, self.done = max(total, 1), 0
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        self._bar = RichProgress(*columns, console=Console(stderr=True), disable=not self.enabled)
        self._task = self._bar.add_task(label, total=self.total)
        self._bar.start()

    def advance(self, n: int = 1) -> None:
        self.done += n
        self._bar.advance(self._task, n)

    def close(self) -> None:
        self._bar.stop()
