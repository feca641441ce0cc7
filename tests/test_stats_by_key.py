"""Statistics by content key (``t1async.eval.stats``): the cluster bootstrap covers a known effect at about its
level with the ~10 keys a split holds, clustering widens the interval when a key's tasks move together, and
the sign-flip permutation test is exact and holds its size."""

from __future__ import annotations

import numpy as np
import pytest

from t1async.eval.stats import (
    bootstrap_ci,
    by_key_ci,
    cluster_bootstrap_ci,
    expanded_alpha,
    key_means,
    paired_by_key,
    sign_flip_p,
    t_quantile,
)


def test_t_quantile_and_the_expanded_tail():
    for p, df, exact in ((0.975, 9, 2.2622), (0.975, 3, 3.1824), (0.975, 30, 2.0423), (0.95, 5, 2.0150)):
        assert t_quantile(p, df) == pytest.approx(exact, rel=2e-3)
    assert expanded_alpha(10) < 0.02 < 0.05 == pytest.approx(expanded_alpha(1))
    assert expanded_alpha(400) == pytest.approx(0.05, abs=0.002)  # many keys: the plain percentile


def _paired(rng, keys: int, per_key: int, effect: float) -> tuple[dict, dict, dict]:
    """before/after task values where each key has its own level and its own effect (effect + key noise)."""
    before, after, key_of = {}, {}, {}
    for k in range(keys):
        level, eff = rng.normal(0, 1), effect + rng.normal(0, 0.5)
        for j in range(per_key):
            t = f"k{k}-t{j}"
            key_of[t] = f"k{k}"
            before[t] = level + rng.normal(0, 0.2)
            after[t] = level + eff + rng.normal(0, 0.2)
    return before, after, key_of


@pytest.mark.parametrize("expanded", [True, False])
def test_the_cluster_bootstrap_covers_a_known_effect(expanded):
    rng = np.random.default_rng(1)
    hits, trials = 0, 400
    for i in range(trials):
        b, a, key_of = _paired(rng, keys=10, per_key=4, effect=0.3)
        d = {t: a[t] - b[t] for t in a}
        lo, hi = cluster_bootstrap_ci(
            list(d.values()), [key_of[t] for t in d], seed=i, resamples=1000, expanded=expanded
        )
        hits += lo <= 0.3 <= hi
    cover = hits / trials
    if expanded:  # at about its level (binomial sd of 400 trials: 1.1 points)
        assert 0.91 <= cover <= 0.985, cover
    else:  # the plain percentile over 10 keys is too narrow: what the issue found
        assert cover < 0.93, cover


def test_clustering_widens_the_interval_when_a_keys_tasks_move_together():
    rng = np.random.default_rng(2)
    key_of, values = {}, {}
    for k in range(12):
        level = rng.normal(0, 1)  # the key's tasks share it: 8 tasks of a key are ~one observation
        for j in range(8):
            values[f"k{k}-t{j}"] = level + rng.normal(0, 0.05)
            key_of[f"k{k}-t{j}"] = f"k{k}"
    naive = bootstrap_ci(list(values.values()))
    clustered = by_key_ci(values, key_of)["ci95"]
    width = clustered[1] - clustered[0]
    assert width > 2.0 * (naive[1] - naive[0])  # ~sqrt(8) = 2.8x wider
    # independent tasks: clustering costs little (the expansion over 12 keys aside)
    indep = {t: rng.normal(0, 1) for t in values}
    w_naive = np.diff(bootstrap_ci(list(indep.values())))[0]
    w_key = np.diff(by_key_ci(indep, key_of)["ci95"])[0]
    assert w_key < 1.6 * w_naive


def test_the_sign_flip_test_is_exact_and_holds_its_size():
    assert sign_flip_p([1.0, 1.0, 1.0]) == pytest.approx(2 / 8)
    assert sign_flip_p([0.5] * 10) == pytest.approx(2 / 1024)
    assert sign_flip_p([1.0, -1.0]) == 1.0
    rng = np.random.default_rng(3)
    p_null = [paired_by_key(*_paired(rng, 10, 3, 0.0), seed=i)["p"] for i in range(300)]
    assert 0.02 <= np.mean(np.asarray(p_null) < 0.05) <= 0.09
    p_eff = [paired_by_key(*_paired(rng, 10, 3, 1.0), seed=i)["p"] for i in range(100)]
    assert np.mean(np.asarray(p_eff) < 0.05) > 0.9
    many = sign_flip_p(list(rng.normal(0.0, 1.0, size=40)), resamples=2000)
    assert 0.0 < many <= 1.0


def test_paired_by_key_weighs_keys_alike_and_pairs_only_common_tasks():
    key_of = {"a1": "A", "a2": "A", "a3": "A", "b1": "B"}
    before = {"a1": 0.0, "a2": 0.0, "a3": 0.0, "b1": 0.0, "c1": 5.0}
    after = {"a1": 1.0, "a2": 1.0, "a3": 1.0, "b1": 0.0}
    r = paired_by_key(before, after, key_of)
    assert r["mean"] == pytest.approx(0.5) and r["keys"] == 2 and r["tasks"] == 4  # keys, not tasks, weigh
    assert key_means(after, key_of) == {"A": 1.0, "B": 0.0}
    with pytest.raises(ValueError, match="3 values but 2"):
        cluster_bootstrap_ci([1.0, 2.0, 3.0], ["a", "b"])
