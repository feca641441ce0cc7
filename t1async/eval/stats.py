"""The numbers of an evaluation, pure and numpy-only: pass@k, mean tests passed, 95% bootstrap CIs, and the
paired difference of two evaluations of the same tasks (``paired_diff``).

Episodes are grouped by task. Every figure is a mean over tasks of a per-task value (each task weighs the
same, however many samples it has), and its confidence interval comes from resampling *tasks* with
replacement (the samples of a task are not independent draws of the benchmark):

- ``pass@k``: the unbiased estimator of Chen et al. (2021), ``1 - C(n - c, k) / C(n, k)`` for a task with
  ``n`` samples of which ``c`` resolved; ``pass@1`` is then ``c / n``;
- ``tests``: the mean number of the task's tests that pass (design §8's dense reward), and ``tests_frac``
  the same as a share of the task's tests.

Held-out tasks come in content keys (``sandbox_agent.synth``: the tasks of one key are one item asked in
several wordings, not independent draws), so the benches' figures are by key (``by_key_ci``,
``paired_by_key``): a key's value is the mean of its tasks', every key weighs the same, and the interval is a
*cluster* bootstrap that resamples keys. With the ~10-40 keys a split holds, a plain percentile bootstrap is
too narrow (its variance is short by ``(G - 1) / G`` and it uses normal tails); ``expanded_alpha`` widens it
as Hesterberg (2015) does, to the tail a ``t`` interval with ``G - 1`` degrees of freedom would have. The
paired comparison also gives the exact sign-flip permutation p-value over keys (``sign_flip_p``: under no
effect, each key's difference is as likely to have either sign).

An episode that errored (``episode_error``: the sandbox, the sampler, the wall clock, the verifier, the task's
setup) is no outcome of the policy: ``split_errors`` takes it out of the figures and counts it by kind, so an
error is reported as one, never as a failure of the policy.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

from sandbox_agent.images.buildfail import IMAGE_BUILD_FAILED


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of ``k`` samples drawn without replacement from ``n`` (``c`` correct)
    is correct. Needs ``1 <= k <= n`` and ``0 <= c <= n``."""
    if not (1 <= k <= n and 0 <= c <= n):
        raise ValueError(f"pass@k needs 1 <= k <= n and 0 <= c <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    # 1 - prod_{i = n - c + 1}^{n} (1 - k / i), numerically stable (Chen et al.)
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def bootstrap_ci(
    values: Sequence[float], *, resamples: int = 2000, seed: int = 0, level: float = 0.95
) -> tuple[float, float]:
    """Percentile bootstrap CI of the mean of ``values`` (one value per task); (v, v) for a single value."""
    v = np.asarray(values, dtype=np.float64)
    if v.size == 0:
        return (float("nan"), float("nan"))
    if v.size == 1:
        return (float(v[0]), float(v[0]))
    rng = np.random.default_rng(seed)
    means = v[rng.integers(0, v.size, size=(resamples, v.size))].mean(axis=1)
    a = (1.0 - level) / 2.0
    lo, hi = np.quantile(means, [a, 1.0 - a])
    return (float(lo), float(hi))


@dataclass(frozen=True)
class TaskScore:
    task: str
    family: str
    n: int  # samples
    resolved: int  # samples that resolved the task
    tests_mean: float  # mean tests passed over the samples
    tests_total: int
    turns_mean: float


def scored(episodes: Iterable[Mapping]) -> tuple[list[Mapping], list[str]]:
    """The episodes that count for the policy, and the tasks (sorted) whose image did not build: those are
    no episode of the policy (reason ``image_build_failed``), so they are reported apart, never as fails."""
    keep, unbuilt = [], set()
    for e in episodes:
        if e.get("reason") == IMAGE_BUILD_FAILED:
            unbuilt.add(str(e["task"]))
        else:
            keep.append(e)
    return keep, sorted(unbuilt)


EPISODE_ERRORS = ("sandbox", "sampler", "timeout", "aborted", "verifier", "setup")


def episode_error(e: Mapping) -> str | None:
    """Why an episode row (``t1async.eval.run``) is no outcome of the policy, or None when it is one:
    ``sampler`` (a request failed), ``aborted`` (the sampler aborted a turn), ``sandbox`` (a command could not
    run, or the episode raised), ``setup`` (the task's setup.sh failed), ``timeout`` (the agent's wall time ran
    out), ``verifier`` (the tests could not be run or read: status timeout, parse_error or error). An image
    that did not build is ``scored``'s, not this."""
    reason, detail = e.get("reason"), str(e.get("detail", ""))
    if reason == IMAGE_BUILD_FAILED:
        return None
    if reason == "error":
        if detail.startswith("sampler failed"):
            return "sampler"
        return "setup" if detail.startswith("TaskSetupError") else "sandbox"
    if reason in ("timeout", "aborted"):
        return str(reason)
    if e.get("verify_status", "ok") != "ok":
        return "verifier"
    return None


def split_errors(episodes: Iterable[Mapping]) -> tuple[list[Mapping], dict[str, int]]:
    """The episodes that are outcomes of the policy, and the count of the others by ``episode_error`` kind
    (every kind listed, 0 when none)."""
    keep: list[Mapping] = []
    counts = dict.fromkeys(EPISODE_ERRORS, 0)
    for e in episodes:
        kind = episode_error(e)
        if kind is None:
            keep.append(e)
        else:
            counts[kind] += 1
    return keep, counts


def task_scores(episodes: Iterable[Mapping]) -> list[TaskScore]:
    """One score per task from episode rows (``task, family, resolved, tests_passed, tests_total, turns``)."""
    by: dict[str, list[Mapping]] = {}
    for e in episodes:
        by.setdefault(str(e["task"]), []).append(e)
    out = []
    for task in sorted(by):
        es = by[task]
        out.append(
            TaskScore(
                task=task,
                family=str(es[0].get("family", "")),
                n=len(es),
                resolved=sum(bool(e["resolved"]) for e in es),
                tests_mean=float(np.mean([e["tests_passed"] for e in es])),
                tests_total=max(int(e.get("tests_total", 0)) for e in es),
                turns_mean=float(np.mean([e.get("turns", 0) for e in es])),
            )
        )
    return out


def mean_ci(values: Sequence[float], *, seed: int = 0, resamples: int = 2000) -> dict:
    """``{"mean", "ci95"}`` of ``values`` (one per task): their mean and its ``bootstrap_ci``."""
    lo, hi = bootstrap_ci(values, seed=seed, resamples=resamples)
    return {"mean": float(np.mean(values)) if len(values) else float("nan"), "ci95": [lo, hi]}


def paired_diff(
    before: Mapping[str, float], after: Mapping[str, float], *, seed: int = 0, resamples: int = 4000
) -> dict:
    """``{"mean", "ci95", "tasks"}`` of ``after - before`` over the tasks both have (task -> value), with a
    paired percentile bootstrap CI: a resample draws tasks, each with both its values, so the CI is that of
    the difference (not two CIs subtracted, which would count the tasks' own spread twice)."""
    d = [after[t] - before[t] for t in sorted(set(before) & set(after))]
    return {**mean_ci(d, seed=seed, resamples=resamples), "tasks": len(d)}


def summarise(scores: Sequence[TaskScore], *, k_values: Sequence[int] = (1,), seed: int = 0) -> dict:
    """Overall figures with CIs: ``tasks, episodes, pass@k`` for each k no larger than every task's
    sample count, ``tests``, ``tests_frac``, ``resolved_rate`` (share of episodes)."""
    if not scores:
        return {"tasks": 0, "episodes": 0}
    n_min = min(s.n for s in scores)
    out: dict = {"tasks": len(scores), "episodes": int(sum(s.n for s in scores))}
    for k in sorted({k for k in k_values if 1 <= k <= n_min}):
        out[f"pass@{k}"] = mean_ci([pass_at_k(s.n, s.resolved, k) for s in scores], seed=seed)
    out["tests"] = mean_ci([s.tests_mean for s in scores], seed=seed)
    out["tests_frac"] = mean_ci([s.tests_mean / s.tests_total if s.tests_total else 0.0 for s in scores], seed=seed)
    out["resolved_rate"] = sum(s.resolved for s in scores) / out["episodes"]
    return out


def by_family(scores: Sequence[TaskScore], *, k_values: Sequence[int] = (1,), seed: int = 0) -> dict[str, dict]:
    fams: dict[str, list[TaskScore]] = {}
    for s in scores:
        fams.setdefault(s.family, []).append(s)
    return {f: summarise(v, k_values=k_values, seed=seed) for f, v in sorted(fams.items())}


# ------------------------------------------------------------------------------------ by content key


def t_quantile(p: float, df: int) -> float:
    """Student's t quantile (Abramowitz and Stegun 26.7.5's expansion in 1/df around the normal one; within
    0.2% of the exact value from df = 3, e.g. 2.262 at p = 0.975, df = 9)."""
    if df < 1:
        raise ValueError(f"t quantile needs df >= 1, got {df}")
    z = NormalDist().inv_cdf(p)
    g1 = (z**3 + z) / 4
    g2 = (5 * z**5 + 16 * z**3 + 3 * z) / 96
    g3 = (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384
    g4 = (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / 92160
    return float(z + g1 / df + g2 / df**2 + g3 / df**3 + g4 / df**4)


def expanded_alpha(n: int, level: float = 0.95) -> float:
    """The two-sided tail share whose percentile bootstrap interval of a mean of ``n`` values has the width of
    a ``t`` interval: ``2 Phi(-sqrt(n / (n - 1)) t_{1 - a/2, n - 1})`` (Hesterberg's expanded percentile;
    ``1 - level`` for n < 2)."""
    a = 1.0 - level
    if n < 2:
        return a
    return 2.0 * NormalDist().cdf(-math.sqrt(n / (n - 1)) * t_quantile(1.0 - a / 2.0, n - 1))


def key_means(values: Mapping[str, float], key_of: Mapping[str, str]) -> dict[str, float]:
    """content key -> the mean of its tasks' values (task -> value; ``key_of``: task -> key, a task missing
    from it being its own key)."""
    by: dict[str, list[float]] = {}
    for t, v in values.items():
        by.setdefault(key_of.get(t, t), []).append(float(v))
    return {k: float(np.mean(vs)) for k, vs in sorted(by.items())}


def cluster_bootstrap_ci(
    values: Sequence[float],
    clusters: Sequence[str],
    *,
    resamples: int = 4000,
    seed: int = 0,
    level: float = 0.95,
    expanded: bool = True,
) -> tuple[float, float]:
    """Bootstrap CI of the mean over clusters of each cluster's mean value: a resample draws *clusters* with
    replacement (all of a cluster's values with it), so values that move together within a cluster widen the
    interval as they should. ``expanded``: Hesterberg's small-sample widening (``expanded_alpha``)."""
    v = np.asarray(values, dtype=np.float64)
    if v.size != len(clusters):
        raise ValueError(f"{v.size} values but {len(clusters)} cluster labels")
    names = sorted(set(clusters))
    g = len(names)
    if g == 0:
        return (float("nan"), float("nan"))
    idx = {c: i for i, c in enumerate(names)}
    lab = np.asarray([idx[c] for c in clusters])
    means = np.bincount(lab, weights=v, minlength=g) / np.bincount(lab, minlength=g)
    if g == 1:
        return (float(means[0]), float(means[0]))
    rng = np.random.default_rng(seed)
    boot = means[rng.integers(0, g, size=(resamples, g))].mean(axis=1)
    a = expanded_alpha(g, level) if expanded else 1.0 - level
    lo, hi = np.quantile(boot, [a / 2.0, 1.0 - a / 2.0])
    return (float(lo), float(hi))


def by_key_ci(values: Mapping[str, float], key_of: Mapping[str, str], *, seed: int = 0) -> dict:
    """``{"mean", "ci95", "keys"}`` of task values (task -> value) by content key: the mean over keys of their
    tasks' mean, with ``cluster_bootstrap_ci``."""
    tasks = sorted(values)
    keys = [key_of.get(t, t) for t in tasks]
    km = key_means(values, key_of)
    lo, hi = cluster_bootstrap_ci([values[t] for t in tasks], keys, seed=seed)
    return {"mean": float(np.mean(list(km.values()))) if km else float("nan"), "ci95": [lo, hi], "keys": len(km)}


def sign_flip_p(diffs: Sequence[float], *, resamples: int = 20000, seed: int = 0) -> float:
    """Two-sided paired permutation p-value of mean(diffs) = 0: the share of sign flips of the per-key
    differences whose mean is at least as far from 0. Exact (every flip) up to 16 keys, else ``resamples``
    random flips (the observed one counted, so p > 0)."""
    d = np.asarray(diffs, dtype=np.float64)
    if d.size == 0:
        return float("nan")
    obs = abs(float(d.mean())) - 1e-12
    if d.size <= 16:
        signs = np.asarray(list(itertools.product((1.0, -1.0), repeat=d.size)))
        return float(np.mean(np.abs(signs @ d / d.size) >= obs))
    rng = np.random.default_rng(seed)
    signs = rng.choice((1.0, -1.0), size=(resamples, d.size))
    hits = int(np.sum(np.abs(signs @ d / d.size) >= obs))
    return (hits + 1) / (resamples + 1)


def paired_by_key(
    before: Mapping[str, float], after: Mapping[str, float], key_of: Mapping[str, str], *, seed: int = 0
) -> dict:
    """``after - before`` over the tasks both have (task -> value), by content key: ``{"mean", "ci95", "p",
    "keys", "tasks"}``, the mean over keys of their tasks' mean difference, its cluster bootstrap CI (keys
    resampled, each with both sides of all its tasks) and the sign-flip permutation p-value over keys."""
    common = sorted(set(before) & set(after))
    d = {t: after[t] - before[t] for t in common}
    km = key_means(d, key_of)
    ci = by_key_ci(d, key_of, seed=seed)
    return {**ci, "p": sign_flip_p(list(km.values()), seed=seed), "tasks": len(common)}
