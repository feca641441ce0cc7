"""``bench.mismatch``'s output: the table it prints and the chart it draws from a measured result."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


def chart(result: dict, path: Path, configs: Sequence[str]) -> None:
    """The three panels of mismatch.png, one bar per config in ``configs`` order."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg = result["configs"]
    labels = ["baseline\n(retok, free)", "TITO", "R3\n(retok)", "TITO + R3"]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for ax, key, title in zip(
        axes,
        ("mean_abs_dlogp_id_matched", "loss_drift_tokens", "routing_drift"),
        ("mean |Δlogp|, ID-matched loss tokens", "loss-region drift (tokens)", "routing drift"),
    ):
        vals = [cfg[c][key] for c in configs]
        bars = ax.bar(labels, vals, color=["#999999", "#4c72b0", "#dd8452", "#55a868"])
        ax.set_title(title)
        for b, v in zip(bars, vals):
            ax.annotate(
                f"{v:.4g}", (b.get_x() + b.get_width() / 2, b.get_height()), ha="center", va="bottom", fontsize=8
            )
    fig.suptitle(
        f"sampler {result['sampler_dtype']} (batched) vs learner fp32; tito_r3 / baseline (ID-matched) = "
        f"{result['ratio']:.3f} (paper 0.62); raw baseline {cfg['baseline']['mean_abs_dlogp']:.4g} pairs "
        "different tokens",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_modes(result: dict) -> None:
    """``--engine vllm``: mean |Δlogp| per sampler mode (rows) and configuration (columns), id-matched for the
    retokenized ones."""
    modes = result.get("modes")
    if not modes:
        return
    names = list(next(iter(modes.values()))["configs"])
    print(f"\n{'sampler mode':<22}" + "".join(f"{n:>12}" for n in names))
    for m, v in modes.items():
        row = [v["configs"][n]["mean_abs_dlogp_id_matched"] for n in names]
        print(f"{m:<22}" + "".join(f"{x:>12.5f}" for x in row))
    print("(mean |learner logprob - sampler logprob| over loss tokens; the paper: baseline 0.021, TITO+R3 0.013)")


def print_result(result: dict, configs: Sequence[str]) -> None:
    """The human table: one row per config in ``configs`` order, then the ratios."""
    ws = result["warm_start"]
    if ws:
        print(
            f"model: warm-started by SFT ({ws['steps']} steps on {ws['demos']} oracle demos, "
            f"loss {ws['loss_before']:.2f} -> {ws['loss_after']:.2f})"
        )
    else:
        print(f"model: {result['model']}")
    print(
        f"mismatch: {result['episodes']} episodes x {result['turns']} turns, {result['tokens']} tokens "
        f"({result['sampled_tokens']} sampled); sampler {result['sampler_dtype']} batched, learner fp32"
    )
    hdr = (
        f"{'config':<10} {'|dlogp| raw':>12} {'|dlogp| id-matched':>19} {'p99 raw':>9} {'loss drift':>11} "
        f"{'id mismatch':>12} {'routing drift':>14}"
    )
    print(hdr)
    print("-" * len(hdr))
    for c in configs:
        d = result["details"][c]
        print(
            f"{c:<10} {d['mean_abs_dlogp']:>12.5f} {d['mean_abs_dlogp_id_matched']:>19.5f} "
            f"{d['p99_abs_dlogp']:>9.4f} "
            f"{d['loss_drift_tokens']:>11d} {d['loss_id_mismatch_tokens']:>12d} {d['routing_drift']:>14.4f}"
        )
    share = result["baseline_id_mismatch_share"]
    print(
        f"raw: every loss token with a sampled logprob; for baseline and r3 {share:.0%} "
        "of them pair the logprob of one token with the sampled logprob of a different token"
    )
    print("id-matched: loss tokens whose ID is the sampled ID (TITO: all of them)")
    print(f"tito_r3 / baseline (id-matched) = {result['ratio']:.3f}   (T1 paper: 0.013 / 0.021 = 0.62)")
    print(f"tito / baseline (id-matched)    = {result['ratio_tito']:.3f}")
    print(f"tito_r3 / baseline (raw)        = {result['ratio_raw']:.3f}   (flattering: the raw baseline mixes tokens)")
    print(f"TITO boundaries (learner assembly): {result['tito_boundaries']}")
