"""The eval's numbers: pass@k against brute-force enumeration, bootstrap CIs, per-task and per-family means."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from t1async.eval.stats import bootstrap_ci, by_family, mean_ci, paired_diff, pass_at_k, summarise, task_scores


@pytest.mark.parametrize(("n", "c", "k"), [(5, 0, 1), (5, 2, 1), (5, 2, 2), (6, 3, 4), (4, 4, 3), (7, 1, 7)])
def test_pass_at_k_is_the_chance_that_k_of_n_samples_hold_a_correct_one(n, c, k):
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    brute = sum(any(samples[i] for i in s) for s in subsets) / len(subsets)
    assert pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12)
    assert pass_at_k(n, c, 1) == pytest.approx(c / n)
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(n, c, n + 1)


def test_bootstrap_ci_brackets_the_mean_narrows_with_more_tasks_and_is_seeded():
    rng = np.random.default_rng(0)
    small, large = rng.random(10), rng.random(400)
    for v in (small, large):
        lo, hi = bootstrap_ci(v)
        assert lo < v.mean() < hi
    assert np.diff(bootstrap_ci(large)) < np.diff(bootstrap_ci(small))
    assert bootstrap_ci(small, seed=3) == bootstrap_ci(small, seed=3)
    assert bootstrap_ci([0.5]) == (0.5, 0.5)
    assert all(math.isnan(x) for x in bootstrap_ci([]))


def test_summary_weighs_every_task_the_same_and_splits_by_family():
    eps = (
        [{"task": "a", "family": "f", "resolved": True, "tests_passed": 4, "tests_total": 4, "turns": 3}] * 2
        + [
            {"task": "b", "family": "f", "resolved": False, "tests_passed": 1, "tests_total": 4, "turns": 5},
            {"task": "b", "family": "f", "resolved": True, "tests_passed": 4, "tests_total": 4, "turns": 5},
        ]
        + [{"task": "c", "family": "g", "resolved": False, "tests_passed": 0, "tests_total": 2, "turns": 1}] * 2
    )
    scores = task_scores(eps)
    got = [(s.task, s.n, s.resolved, s.tests_mean) for s in scores]
    assert got == [("a", 2, 2, 4.0), ("b", 2, 1, 2.5), ("c", 2, 0, 0.0)]
    s = summarise(scores, k_values=(1, 2, 5))
    assert s["tasks"] == 3 and s["episodes"] == 6 and "pass@5" not in s  # k above the samples per task: omitted
    assert s["pass@1"]["mean"] == pytest.approx((1 + 0.5 + 0) / 3)
    assert s["pass@2"]["mean"] == pytest.approx((1 + 1 + 0) / 3)
    assert s["tests"]["mean"] == pytest.approx((4 + 2.5 + 0) / 3)
    assert s["tests_frac"]["mean"] == pytest.approx((1 + 2.5 / 4 + 0) / 3)
    assert s["resolved_rate"] == pytest.approx(3 / 6)
    lo, hi = s["pass@1"]["ci95"]
    assert 0.0 <= lo <= s["pass@1"]["mean"] <= hi <= 1.0
    fam = by_family(scores)
    assert set(fam) == {"f", "g"} and fam["f"]["pass@1"]["mean"] == pytest.approx(0.75) and fam["g"]["tasks"] == 1


def test_paired_diff_resamples_tasks_with_both_their_values():
    rng = np.random.default_rng(1)
    before = {f"t{i}": float(x) for i, x in enumerate(rng.random(30))}
    after = {t: v + 0.1 + 0.05 * rng.standard_normal() for t, v in before.items()}
    after["only-after"] = 5.0  # a task one side lacks is left out
    d = paired_diff(before, after, seed=3)
    diffs = np.array([after[t] - before[t] for t in sorted(before)])
    # the paired bootstrap by hand: tasks resampled, the mean difference of each resample, its 2.5/97.5 %
    means = diffs[np.random.default_rng(3).integers(0, diffs.size, size=(4000, diffs.size))].mean(axis=1)
    lo, hi = np.quantile(means, [0.025, 0.975])
    assert d["tasks"] == 30 and d["mean"] == pytest.approx(diffs.mean())
    assert d["ci95"] == pytest.approx([lo, hi], abs=1e-12)
    # paired: far narrower than the spread of either side alone
    assert d["ci95"][1] - d["ci95"][0] < 0.5 * np.subtract(*bootstrap_ci(list(before.values()))[::-1])
    none = paired_diff({}, after)
    assert none["tasks"] == 0 and math.isnan(none["mean"]) and all(map(math.isnan, none["ci95"]))
    assert mean_ci([1.0, 3.0], seed=0)["mean"] == 2.0
