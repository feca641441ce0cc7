"""Two policies' eval rows side by side: ``python -m bench.compare_arms BEFORE.jsonl AFTER.jsonl``.

Any two eval files of the same tasks (``python -m t1async.eval --out``, or a ``bench.learning`` fold's
``eval-<arm>-T0.jsonl`` / ``test-<arm>-T0.jsonl``): greedy pass@1 and mean tests passed an episode, each a mean
over content keys, and AFTER minus BEFORE by key (``bench.learning_stats.compare``: the keys' cluster bootstrap
95% CI and the sign-flip p). The test keys of a held-out group (``--held-out``, by default
``sandbox_agent.synth.split.OOD_PREFIXES``) are compared apart, as ``bench.learning --folds`` reports them.
Errored episodes are left out of both sides and counted."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from bench._common import emit_json, print_grid
from bench.learning_stats import compare
from t1async.eval.stats import split_errors


def read_rows(path: Path) -> list[dict]:
    """The episode rows of an eval file; ValueError naming the file and line when one is not a JSON object."""
    rows = []
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(
                    f"{path}:{n}: not JSON ({exc.msg}): is this an eval file (t1async.eval --out)?"
                ) from None
            if not isinstance(row, dict) or "task" not in row or "resolved" not in row:
                raise ValueError(f"{path}:{n}: an episode row needs 'task' and 'resolved': is this an eval file?")
            rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no episode rows")
    return rows


def compare_parts(before: Sequence[Mapping], after: Sequence[Mapping], held_out: tuple[str, ...]) -> dict[str, dict]:
    """``compare`` on the keys outside ``held_out`` ("in") and on those inside it ("held_out"), each part only
    where both sides have rows; plus the errored episodes each side left out."""

    def part(rows: Sequence[Mapping], inside: bool) -> list[Mapping]:
        return [r for r in rows if str(r.get("content_key", "")).startswith(held_out) == inside]

    parts = {"in": (before, after)}
    if held_out:
        parts = {
            name: (part(before, inside), part(after, inside)) for name, inside in (("in", False), ("held_out", True))
        }
    out: dict[str, dict] = {}
    for name, (b, a) in parts.items():
        c = compare(b, a) if b and a else None
        if c is not None and c["keys"]:
            out[name] = c
    out["errors"] = {"before": split_errors(before)[1], "after": split_errors(after)[1]}
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.compare_arms", description=__doc__.split("\n\n")[0])
    p.add_argument("before", type=Path, help="the reference policy's eval rows (JSONL)")
    p.add_argument("after", type=Path, help="the other policy's eval rows on the same tasks (JSONL)")
    p.add_argument(
        "--held-out",
        default=None,
        help="comma-separated content-key prefixes compared apart (default: the synth split's OOD prefixes; "
        "'' compares all keys together)",
    )
    p.add_argument("--json", action="store_true", help="(the last line is JSON anyway)")
    args = p.parse_args(argv)
    if args.held_out is None:
        from sandbox_agent.synth.split import OOD_PREFIXES

        held = tuple(OOD_PREFIXES)
    else:
        held = tuple(x for x in args.held_out.split(",") if x)
    try:
        before, after = read_rows(args.before), read_rows(args.after)
    except (OSError, ValueError) as exc:
        print(f"bench.compare_arms: {exc}", file=sys.stderr)
        return 2
    res = compare_parts(before, after, held)
    if not any(k in res for k in ("in", "held_out")):
        print("bench.compare_arms: the two files share no content key: are they of the same tasks?", file=sys.stderr)
        return 2
    grid = []
    for name in ("in", "held_out"):
        if name not in res:
            continue
        c = res[name]
        for m in ("pass1", "tests"):
            lo, hi = c["ci95_diff"][m]
            grid.append(
                (
                    name,
                    m,
                    c["keys"],
                    c[f"{m}_before"],
                    c[f"{m}_after"],
                    c["diff"][m],
                    f"[{lo:+.2f}, {hi:+.2f}]",
                    c["p_diff"][m],
                )
            )
    print_grid(("keys", "metric", "n keys", "before", "after", "after - before", "95% CI by key", "p"), grid)
    emit_json({"before": str(args.before), "after": str(args.after), "held_out_prefixes": list(held), **res})
    return 0


if __name__ == "__main__":
    sys.exit(main())
