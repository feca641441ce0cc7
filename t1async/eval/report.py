"""What an evaluation prints and draws: the per-task table, overall and per-family figures with CIs, a PNG."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import IO

from t1async.eval.stats import TaskScore


def _fig(d: dict, key: str, pct: bool) -> str:
    f = d.get(key)
    if not isinstance(f, dict):
        return "-"
    lo, hi = f["ci95"]
    if pct:
        return f"{f['mean']:.1%} [{lo:.1%}, {hi:.1%}]"
    return f"{f['mean']:.2f} [{lo:.2f}, {hi:.2f}]"


def print_report(
    scores: Sequence[TaskScore], overall: dict, families: dict[str, dict], k_values: Sequence[int], out: IO[str]
) -> None:
    w = max([len(s.task) for s in scores] + [4])
    fw = max([len(f) for f in families] + [6])
    out.write(f"{'task':<{w}}  {'family':<{fw}}  {'resolved':>8}  {'tests passed':>12}  {'turns':>5}\n")
    out.write("-" * (w + fw + 35) + "\n")
    for s in scores:
        out.write(
            f"{s.task:<{w}}  {s.family:<{fw}}  {s.resolved:>4}/{s.n:<3}  {s.tests_mean:>6.2f}/{s.tests_total:<5}"
            f"  {s.turns_mean:>5.1f}\n"
        )
    ks = [f"pass@{k}" for k in k_values if f"pass@{k}" in overall]
    out.write(
        "\n"
        + f"{'family':<{fw}}  {'tasks':>5}  "
        + "  ".join(f"{k + ' (95% CI)':<24}" for k in ks)
        + f"  {'tests passed (95% CI)':<24}\n"
    )
    for name, d in [*families.items(), ("ALL", overall)]:
        out.write(
            f"{name:<{fw}}  {d['tasks']:>5}  "
            + "  ".join(f"{_fig(d, k, True):<24}" for k in ks)
            + f"  {_fig(d, 'tests', False):<24}\n"
        )
    out.flush()


def plot(overall: dict, families: dict[str, dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [*families, "ALL"]
    ds = [*families.values(), overall]
    fig, axes = plt.subplots(1, 2, figsize=(max(8, 1.1 * len(names) + 4), 4))
    for ax, key, label in ((axes[0], "pass@1", "pass@1"), (axes[1], "tests_frac", "share of tests passed")):
        means = [d[key]["mean"] if key in d else 0.0 for d in ds]
        err = [
            [max(m - d[key]["ci95"][0], 0) if key in d else 0 for m, d in zip(means, ds)],
            [max(d[key]["ci95"][1] - m, 0) if key in d else 0 for m, d in zip(means, ds)],
        ]
        colors = ["#4c72b0"] * len(families) + ["#55a868"]
        ax.bar(names, means, yerr=err, capsize=3, color=colors)
        ax.set_ylim(0, 1.05)
        ax.set_title(f"{label} (95% bootstrap CI over tasks)", fontsize=10)
        ax.tick_params(axis="x", rotation=45)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
