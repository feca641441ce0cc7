"""``bench.learning --folds N --baselines ...``: RL against the baselines a reviewer would run, per fold.

    python -m bench.learning --preset learn-choresn --folds 3 --baselines sweep,passk,mask,sft,rft,contentfree --json

Pre-registered folds (``sandbox_agent.synth.split.split_of``): fold f of N salts the content-key split with f;
fold N is the untouched one, whose test keys (``UNTOUCHED_PERCENT`` of all keys) are in no split of the other
folds, so nothing run on folds 0..N-1 ever read them; it is reported apart (``"untouched": true``), and
should be run last, once (``--only-folds N``). Each fold gets its own corpus, its own warm start (the recipe's
demonstrations from that fold's train split, its init and SFT seeds shifted by f), and its own RL seed.

Per fold, everything is scored on the same test tasks, greedy unless said (the temperature sweep and the full
SFT's decoding are chosen on eval, never on test): RL after ``--rl-steps``; each baseline of ``--baselines``
(``bench.baselines``). The best baseline is the one with the highest pass@1; ``ci95_diff_by_key`` is RL minus
it, paired by content key (``t1async.eval.stats.paired_by_key``: keys resampled, widened for their number;
``p_by_key`` its sign-flip p), on the in-distribution test keys. OOD: the test keys ``split.OOD_PREFIXES``
names (``choresn``'s held-out n, ``observe``'s held-out variant) are scored apart (``ood``: RL vs the policy it
started from, ``before``: the sweep's warm start or, under ``--rl-init sft``, the sft model; and vs the best
baseline, by key).

RL, and the RL baselines (``contentfree``, ``binary``), start from the fold's warm start, or with ``--rl-init sft``
from the ``sft`` baseline's model: does RL add anything to the best model SFT gives? ``--reuse DIR`` takes each
arm's test rows from an earlier run of the same folds (the same split, and the same warm start by its weights'
digest; for the RL arms the same ``--rl-init``, ``--rl-steps``, ``--cluster-arg`` and preset values:
``fold.json`` says how a fold made them) and runs only the rest: a baseline added to a finished run, RL from
another init against the same baselines, or a crashed run resumed (``--reuse`` its own ``--run-dir``). The
summary lists what was ``reused``.

What each policy learned is in ``by_group``: per group of keys (``choresn``: the number of chores asked), its
pass@1, share of tests passed and turns taken, for RL and every baseline.

The last stdout line is JSON: ``folds`` [{fold, untouched, pass1_after, best_baseline, best_baseline_pass1,
ci95_diff_by_key, p_by_key, baselines {name: {mean, ci95, keys}}, by_group {policy: {group: ...}}, pass_at_k
{k: ...}, ood, split_disjoint, rl {rev, init, steps, cluster_arg, preset}, eval_pass1 {policy: {mean, ci95,
keys}}, reused, minutes}], ``targets``. ``eval_pass1`` is greedy pass@1 on the eval split (RL is scored there
too): choose RL's settings (``--cluster-arg``) on it, never on test. ``fold.json`` also names the ``machine``.

    python -m bench.learning --rescore --run-dir DIR     # score DIR's folds again from their rows, running nothing
    python -m bench.learning --preset learn-choresn --folds 3 --baselines sft --rl-init sft --reuse OLD --run-dir NEW
"""

from __future__ import annotations

import argparse
import functools
import json
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from bench._common import emit_json, print_grid
from bench.baselines import (
    BASELINES,
    RL_BASELINES,
    best_of,
    eval_masked,
    pass1_by_key,
    pass_at_ks,
    rft_demos,
    rft_model,
)
from bench.learning_runs import ensure_corpus, eval_policy, held_tasks, run_rl
from bench.learning_stats import best_decoding, keys_of, pass1, per_task, split_check
from t1async.eval.stats import paired_by_key, split_errors
from t1async.log import configure


def _task_pass1(rows: list) -> dict[str, float]:
    return {t: s[0] for t, s in per_task(split_errors(rows)[0]).items()}


def group_of(content_key: str) -> str:
    """A content key's group: its family and first field (``choresn:n3:2+6+7`` -> ``choresn:n3``)."""
    return ":".join(str(content_key).split(":")[:2])


def by_group(rows: list) -> dict[str, dict]:
    """What a policy does per group of content keys (``group_of``): ``keys``, ``pass1`` (mean over the group's
    keys of their share resolved), ``tests`` (mean share of the tests passed), ``turns`` (mean turns taken)."""
    groups: dict[str, list] = {}
    for r in split_errors(rows)[0]:
        groups.setdefault(group_of(r.get("content_key") or r["task"]), []).append(r)
    out: dict[str, dict] = {}
    for g, rs in sorted(groups.items()):
        keys = per_task(rs, by_key="content_key")
        out[g] = {
            "keys": len(keys),
            "pass1": sum(v[0] for v in keys.values()) / len(keys),
            "tests": sum(r["tests_passed"] / max(int(r.get("tests_total") or 1), 1) for r in rs) / len(rs),
            "turns": sum(int(r.get("turns") or 0) for r in rs) / len(rs),
        }
    return out


def fold_entry(
    *,
    fold: int | None,
    folds: int,
    after: list,
    baselines: dict[str, list],
    ood_prefixes: tuple[str, ...],
    init: str = "sweep",
) -> dict:
    """One fold's figures from its eval rows (pure: tested without running anything). ``after``: RL's test rows;
    ``baselines``: name -> its test rows (for ``passk``, the pass@1 of its many samples). The main figures are
    on the in-distribution test keys; the OOD ones (``ood_prefixes``) are scored apart (``ood``: RL against the
    policy it started from, the arm ``init`` names: ``sweep``, the warm start, or ``sft`` under ``--rl-init
    sft``; and against the best baseline)."""

    def ood(r: dict) -> bool:
        return bool(ood_prefixes) and str(r.get("content_key", "")).startswith(ood_prefixes)

    all_after, all_base = after, baselines
    after = [r for r in all_after if not ood(r)]
    baselines = {n: [r for r in rows if not ood(r)] for n, rows in all_base.items()}
    figures = {n: pass1(r) for n, r in baselines.items()}
    best, best_p = best_of(figures)
    key_of = keys_of(after, *baselines.values())
    entry: dict = {
        "fold": fold,
        "untouched": fold is not None and fold == folds,
        "pass1_after": pass1_by_key(after)["mean"],
        "pass1_after_ci95": pass1_by_key(after)["ci95"],
        "best_baseline": best,
        "best_baseline_pass1": best_p,
        "baselines": {n: pass1_by_key(r) for n, r in baselines.items()},
        # per group of keys (choresn: the number of chores asked), every split the rows hold (OOD too)
        "by_group": {"rl": by_group(all_after), **{n: by_group(r) for n, r in all_base.items()}},
    }
    if best in baselines:
        d = paired_by_key(_task_pass1(baselines[best]), _task_pass1(after), key_of)
        entry.update(ci95_diff_by_key=d["ci95"], diff_by_key=d["mean"], p_by_key=d["p"], keys=d["keys"])
    else:
        entry.update(ci95_diff_by_key=[float("nan")] * 2, diff_by_key=float("nan"), p_by_key=float("nan"), keys=0)
    ood_after = [r for r in all_after if ood(r)]
    ref = all_base.get(init)
    if ref is not None and ood_after:
        ood_before = [r for r in ref if ood(r)]
        d = paired_by_key(_task_pass1(ood_before), _task_pass1(ood_after), key_of)
        entry["ood"] = {
            "before": init,  # the arm RL started from: "rises" is against it
            "pass1_before": pass1(ood_before),
            "pass1_after": pass1(ood_after),
            "ci95_diff_by_key": d["ci95"],
            "p_by_key": d["p"],
            "keys": d["keys"],
        }
        if best in all_base:
            ood_best = [r for r in all_base[best] if ood(r)]
            d = paired_by_key(_task_pass1(ood_best), _task_pass1(ood_after), key_of)
            entry["ood"].update(best_baseline_pass1=pass1(ood_best), ci95_diff_vs_best_by_key=d["ci95"])
    return entry


def run_folds(args: argparse.Namespace, p: argparse.ArgumentParser) -> int:
    from t1async.recipes.presets import preset_values
    from t1async.recipes.warmstart import get_recipe

    wanted = [b for b in args.baselines.split(",") if b]
    bad = [b for b in wanted if b not in BASELINES]
    if bad:
        p.error(f"--baselines {','.join(bad)}: unknown; known: {','.join(BASELINES)}")
    if args.folds < 0:
        p.error(f"--folds {args.folds}: give 0 or more")
    configure(level="warning")
    pv = preset_values(args.preset)
    train_t = float(pv["temperature"])
    temps = sorted({float(x) for x in args.temperatures.split(",") if x.strip()})
    ev = {
        "max_turns": pv["max_turns"],
        "max_new_tokens": pv["max_new_tokens"],
        "max_context": pv["max_context"],
        "concurrency": args.concurrency,
        "seed": args.seed,
    }
    families = tuple(pv["synth_families"])
    name = str(pv.get("warm_start") or args.recipe) if args.recipe == "learn" else args.recipe
    base = get_recipe(name)

    def shrink(r):  # noqa: ANN001, ANN202 - a Recipe; the smoke-run overrides
        if args.warm_tasks:
            r = replace(r, tasks=args.warm_tasks)
        if args.warm_sft_steps:
            r = replace(r, sft=replace(r.sft, steps=args.warm_sft_steps, warmup_steps=min(10, args.warm_sft_steps)))
        return r

    def for_fold(r, f: int | None):  # noqa: ANN001, ANN202
        k = f or 0
        return shrink(
            replace(
                r,
                fold=f,
                folds=args.folds,
                model=replace(r.model, seed=r.model.seed + k),
                sft=replace(r.sft, seed=r.sft.seed + k),
            )
        )

    folds: list[int | None] = list(range(args.folds + 1)) if args.folds else [None]
    if args.only_folds:
        only = {int(x) for x in args.only_folds.split(",") if x.strip()}
        folds = [f for f in folds if f in only]
    args.run_dir.mkdir(parents=True, exist_ok=True)
    plan = _Plan(
        args=args,
        wanted=wanted,
        temps=temps,
        train_t=train_t,
        ev=ev,
        families=families,
        recipe=lambda f: for_fold(base, f),
        full_recipe=lambda f: for_fold(get_recipe(f"{base.name}-full"), f),
    )
    out = [_run_fold(f, plan) for f in folds]
    return finish(args.run_dir, out)


@dataclass(frozen=True)
class _Plan:
    """What every fold of a ``run_folds`` run shares: its flags, and how a fold's warm start and full SFT model
    are made (the recipe for fold f)."""

    args: argparse.Namespace
    wanted: list[str]
    temps: list[float]
    train_t: float
    ev: dict
    families: tuple[str, ...]
    recipe: Callable[[int | None], Any]
    full_recipe: Callable[[int | None], Any]


def _run_fold(f: int | None, plan: _Plan) -> dict:
    """Fold f: its corpus and split, then each arm of ``--baselines`` and RL, reused from ``--reuse`` where that
    run made it the same way, else run here; its summary entry (also written to the fold's ``summary.json``)."""
    from sandbox_agent.synth import corpus_entries
    from sandbox_agent.synth.split import OOD_PREFIXES
    from t1async.model.weights import weights_digest
    from t1async.recipes.warmstart import build, system_prompt_of

    args, wanted, train_t = plan.args, plan.wanted, plan.train_t
    t0 = time.perf_counter()
    run = args.run_dir
    fr = run / ("fold-default" if f is None else f"fold{f}")
    fr.mkdir(parents=True, exist_ok=True)
    rec = plan.recipe(f)
    warm = build(rec)
    ev = {**plan.ev, "system_prompt": system_prompt_of(warm)}
    tasks_dir = fr / ("tasks-" + "-".join(plan.families))
    table = ensure_corpus(tasks_dir, args.eval_corpus, args.seed, plan.families, fold=f, folds=args.folds)
    sft_entries = corpus_entries(rec.tasks, rec.task_seed, list(rec.families), fold=f, folds=args.folds)
    check = split_check(table, sft_entries, fold=f, folds=args.folds)
    (fr / "split.json").write_text(json.dumps({**check, "tasks": table}, indent=1) + "\n")
    evals, tests, train = (held_tasks(tasks_dir, table, s) for s in ("eval", "test", "train"))
    if not evals or not tests:
        raise SystemExit(f"fold {f}: no eval or no test task in {tasks_dir}; give a larger --eval-corpus")
    print(f"fold {f}: split {check['task_counts']} tasks, disjoint {check['split_disjoint']}", flush=True)
    rl_rec = rl_record(args)
    warm_w = weights_digest(warm)  # the recipe names the warm start; its weights say which build it is
    if stale := stale_rows(fr, table, warm, rl_rec, weights=warm_w):
        raise SystemExit(
            f"--run-dir {run}: {fr.name} holds test rows of another run ({', '.join(stale)}: another split, "
            "warm start or RL), which this run would mix with its own; give a new --run-dir, with --reuse "
            f"{run} to take what is comparable"
        )
    prev_rec, prev = reusable(args.reuse, fr.name, table, warm, rl_rec, weights=warm_w) if args.reuse else ({}, {})
    record = {"warm_start": str(warm), "warm_weights": warm_w, "rl": rl_rec, "machine": machine()}
    (fr / "fold.json").write_text(json.dumps(record, indent=1) + "\n")
    built: list[Path] = []
    used: list[str] = []
    rows: dict[str, list] = {}

    def full() -> Path:  # the sft baseline's model, built once
        if not built:
            built.append(build(plan.full_recipe(f)))
            record.update(sft_model=str(built[0]), sft_weights=weights_digest(built[0]))  # said, not compared
            (fr / "fold.json").write_text(json.dumps(record, indent=1) + "\n")
        return built[0]

    def arm(name: str, make: Callable[[], list | None]) -> list | None:
        """The arm's test rows: from ``--reuse`` (copied into this fold's dir) where that run made them the same
        way, else ``make()`` (None: none made, e.g. RFT kept no episode). Kept in ``rows`` unless it is RL."""
        src = prev.get(name)
        if src is not None:
            take_arm(src, name, fr)
            print(f"fold {f} {name}: {src.name} reused from {src.parent}", flush=True)
            used.append(name)
            got: list | None = rows_of(src)
        else:
            got = make()
        if got is not None and name != "rl":
            rows[name] = got
        return got

    def ev_(model: Path, tasks: list, temp: float, tag: str, samples: int | None = None) -> list:
        k = 1 if temp == 0 else (samples or args.samples)
        got = eval_policy(model, tasks, samples=k, out=fr / f"{tag}.jsonl", temperature=temp, **ev)
        print(f"fold {f} {tag}: {len(got)} episodes", flush=True)
        return got

    def sweep() -> list:  # the warm start's decoding, chosen on eval
        best_t, _ = best_decoding({t: pass1(ev_(warm, evals, t, f"eval-warm-T{t:g}")) for t in plan.temps})
        return ev_(warm, tests, best_t, f"test-warm-T{best_t:g}")

    def sft() -> list:
        t_sft, _ = best_decoding({t: pass1(ev_(full(), evals, t, f"eval-sft-T{t:g}")) for t in sorted({0.0, train_t})})
        return ev_(full(), tests, t_sft, f"test-sft-T{t_sft:g}")

    def rft() -> list | None:
        pool = train[: args.rft_tasks] if args.rft_tasks else train
        sampled = ev_(warm, pool, train_t, "train-warm-rft", samples=args.rft_samples)
        demos = rft_demos(sampled, {t.id: t for t in pool})
        print(f"fold {f} rft: {len(demos)} resolved episodes kept of {len(sampled)}", flush=True)
        if not demos:
            return None
        model = rft_model(warm, demos, fr / "rft-model", steps=args.rft_steps, system_prompt=ev["system_prompt"])
        return ev_(model, tests, 0.0, "test-rft-T0")

    rl_model = full() if args.rl_init == "sft" else warm
    rl_extra = ["--seed", str(args.seed + (f or 0)), "--warm-start=", "--model", str(rl_model), *args.cluster_arg]
    ck = Path(str(prev_rec.get("checkpoint") or ""))  # RL's, when its rows are reused

    def rl(name: str, extra: list[str]) -> list:  # RL at RL's budget, from RL's init
        nonlocal ck
        d = fr / name
        if d.exists():
            shutil.rmtree(d)
        model = run_rl(d, tasks_dir, args.rl_steps, [*rl_extra, *extra], args.rl_timeout, preset=args.preset)
        if name == "rl":
            ck = model
        tag = name.removeprefix("rl-")
        ev_(model, evals, 0.0, f"eval-{tag}-T0")  # what its settings are tuned on (eval_pass1), never test
        return ev_(model, tests, 0.0, f"test-{tag}-T0")

    if "sweep" in wanted or "passk" in wanted:
        arm("sweep", sweep)
    passk: dict = {}
    if "passk" in wanted:
        got = arm("passk", lambda: ev_(warm, tests, train_t, "test-warm-passk", samples=args.passk))
        passk = pass_at_ks(got or [], range(1, args.passk + 1))
    if "mask" in wanted:
        arm(
            "mask",
            lambda: eval_masked(
                warm, tests, samples=args.samples, out=fr / "test-warm-mask.jsonl", ev=ev, temperature=train_t
            ),
        )
    if "sft" in wanted:
        arm("sft", sft)
    if "rft" in wanted:
        arm("rft", rft)
    for name, reward in RL_BASELINES.items():  # another reward, at RL's budget and from RL's init
        if name in wanted:
            arm(name, functools.partial(rl, f"rl-{name}", ["--reward", reward]))
    after = arm("rl", lambda: rl("rl", [])) or []
    entry = fold_entry(
        fold=f, folds=args.folds, after=after, baselines=rows, ood_prefixes=OOD_PREFIXES, init=init_arm(rl_rec)
    )
    entry.update(
        rl=rl_rec,
        reused=sorted(used),
        reused_from=str(args.reuse) if used else None,
        pass_at_k={str(k): v for k, v in passk.items()},
        split_disjoint=bool(check["split_disjoint"]),
        test_tasks=len(tests),
        minutes=(time.perf_counter() - t0) / 60.0,
        warm_start=str(warm),
        checkpoint=str(ck),
        eval_pass1=eval_pass1(fr),
    )
    (fr / "summary.json").write_text(json.dumps(entry, indent=2) + "\n")
    return entry


# a baseline's test rows, as run_folds names them (the sweep's file is the one test-warm-T* that is not passk/mask)
RESCORE_FILES = {
    "sweep": "test-warm-T*.jsonl",
    "passk": "test-warm-passk.jsonl",
    "mask": "test-warm-mask.jsonl",
    "sft": "test-sft-T*.jsonl",
    "rft": "test-rft-T0.jsonl",
    "contentfree": "test-contentfree-T0.jsonl",
    "binary": "test-binary-T0.jsonl",
}


ARM_FILES = {**RESCORE_FILES, "rl": "test-rl-T0.jsonl"}  # every arm's test rows
RL_ARMS = ("rl", *RL_BASELINES)  # made by RL from RL's init: reused only from a run of the same RL
# how the RL arms are made; 2: their actors prompt the policy as it was trained (e2749a2). An RL arm of an
# earlier revision sampled under the default system prompt, and is never reused
RL_REV = 2
# what an RL arm must share with this run's to be reused; ``preset``: the values of --preset the RL ran under (a
# fold recorded before them has none: its RL ran under an older preset, e.g. learn-choresn's ``turn``)
RL_SAME = ("rev", "init", "steps", "cluster_arg", "preset")


def init_arm(rl: dict) -> str:
    """The arm whose test rows are RL's starting policy: the ``sft`` baseline under ``--rl-init sft``, else the
    warm start (``sweep``). A record without ``init`` (a fold run before ``--rl-init``) started from the warm
    start."""
    return "sft" if rl.get("init") == "sft" else "sweep"


EVAL_TAGS = {"sweep": "warm"}  # an arm's eval rows are eval-<tag>-T*.jsonl, its tag its name unless said here


def take_arm(src: Path, name: str, fr: Path) -> list[str]:
    """Copy a reused arm's test rows ``src`` into the fold dir ``fr`` with the eval rows its run scored beside
    them (``eval-<tag>-T*.jsonl``: the sweep's and sft's decodings, an RL arm's greedy eval), so that the fold's
    ``eval_pass1`` holds it; the names copied."""
    tag = EVAL_TAGS.get(name, name)
    copied: list[str] = []
    for path in [src, *sorted(src.parent.glob(f"eval-{tag}-T*.jsonl"))]:
        if path.resolve() != (fr / path.name).resolve():
            shutil.copy2(path, fr / path.name)
            copied.append(path.name)
    return copied


def eval_pass1(fr: Path) -> dict[str, dict]:
    """Greedy pass@1 by key on the fold's eval split, per policy scored there at T 0 (``eval-<tag>-T0.jsonl``:
    ``warm`` the warm start's, ``sft`` the SFT model's, each RL arm's): what RL's settings are chosen on, as the
    baselines' decodings are; never test."""
    out: dict[str, dict] = {}
    for path in sorted(fr.glob("eval-*-T0.jsonl")):
        if rows := split_errors(rows_of(path))[0]:
            out[path.name.removeprefix("eval-").removesuffix("-T0.jsonl")] = pass1_by_key(rows)
    return out


def machine() -> dict:
    """The machine a fold ran on (``fold.json``): one recipe, built and scored on two machines, gave figures up
    to 9 points apart (docs/results.md, 2026-12-06 13:16 UTC), so a fold says where its rows came from."""
    import hashlib
    import platform

    import torch

    cpu: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            k, _, v = line.partition(":")
            if k.strip() in ("model name", "flags") and k.strip() not in cpu:
                cpu[k.strip()] = v.strip()
    except OSError:
        pass
    return {
        "host": platform.node(),
        "cpu": cpu.get("model name", platform.processor()),
        "cpu_flags": hashlib.sha256(cpu.get("flags", "").encode()).hexdigest()[:16],
        "isa": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }


def rows_of(path: Path) -> list:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def rl_record(args: argparse.Namespace) -> dict:
    """How this run makes its RL arms (``fold.json`` and the fold's summary say it; ``--reuse`` compares it)."""
    from t1async.recipes.presets import preset_values

    preset = {k: str(v) for k, v in sorted(preset_values(args.preset).items())}  # what the flags add to
    return {
        "rev": RL_REV,
        "init": args.rl_init,
        "steps": args.rl_steps,
        "cluster_arg": list(args.cluster_arg),
        "preset": preset,
    }


def reusable(
    src: Path, fold_dir: str, table: object, warm: Path, rl: dict, *, weights: str | None = None
) -> tuple[dict, dict[str, Path]]:
    """``--reuse SRC``: the earlier fold's record and the test-row files (arm -> path) in ``SRC/<fold_dir>`` that
    this run would make the same way: the same split (``split.json``'s tasks) and warm start; for the RL arms
    also the same ``RL_SAME``, so never from a fold of an earlier ``RL_REV`` (one written before ``fold.json``
    existed, its ``summary.json`` alone, is of none). A different split or warm start is an error: nothing there
    is comparable. ``weights`` (``weights_digest`` of this run's warm start) must match the fold's
    ``warm_weights`` where it recorded one: one recipe built and scored on two machines gave SFT figures up to 9
    points of pass@1 apart on a fold (docs/results.md, 2026-12-06 13:16 UTC)."""
    d = src / fold_dir
    split = d / "split.json"
    if not split.is_file():
        raise SystemExit(f"--reuse {src}: no {split}; give the --run-dir of an earlier folds run of this fold")
    if json.loads(split.read_text()).get("tasks") != json.loads(json.dumps(table)):
        raise SystemExit(
            f"--reuse {src}: {fold_dir}'s split is not this run's (another --eval-corpus, --seed or --folds?); "
            "its rows are not comparable, so nothing is reused"
        )
    rec: dict = {}
    for name in ("summary.json", "fold.json"):  # fold.json, written first, is the newer record when both are
        if (d / name).is_file():
            rec.update(json.loads((d / name).read_text()))
    if rec.get("warm_start") != str(warm):
        raise SystemExit(
            f"--reuse {src}: {fold_dir} was run from warm start {rec.get('warm_start')!r}, this run's is {warm}; "
            "nothing there is comparable"
        )
    if weights and rec.get("warm_weights") and rec["warm_weights"] != weights:
        raise SystemExit(
            f"--reuse {src}: {fold_dir}'s warm start {warm.name} had weights {rec['warm_weights']}, this run's has "
            f"{weights}: the same recipe built elsewhere (another machine's CPU kernels, or other code) is another "
            "model, so nothing there is comparable; rerun those arms here"
        )
    old_rl = rec.get("rl") or {}
    same_rl = all(old_rl.get(k) == rl.get(k) for k in RL_SAME)
    found: dict[str, Path] = {}
    for name, pattern in ARM_FILES.items():
        if name in RL_ARMS and not same_rl:
            continue
        files = sorted(d.glob(pattern))
        if len(files) == 1:
            found[name] = files[0]
    return rec, found


def stale_rows(fr: Path, table: object, warm: Path, rl: dict, *, weights: str | None = None) -> list[str]:
    """The test-row files already in the fold dir ``fr`` that this run would not make the same way (``reusable``'s
    rules, on ``fr`` itself): all of them under another split or warm start, or with no ``split.json``; an RL
    arm's under another RL. A run writing into ``fr`` would otherwise leave them there under its own
    ``fold.json``, and a later ``--reuse`` of it would take them as this run's."""
    present = {name: sorted(fr.glob(pattern)) for name, pattern in ARM_FILES.items()}
    names = sorted(p.name for files in present.values() for p in files)
    if not names:
        return []
    try:
        _, found = reusable(fr.parent, fr.name, table, warm, rl, weights=weights)
    except SystemExit:
        return names
    return sorted(p.name for name, files in present.items() for p in files if found.get(name) != p)


def rescore(run: Path, p: argparse.ArgumentParser) -> int:
    """``--rescore``: every ``fold*`` dir of ``run`` scored again from its episode rows, nothing run."""
    from sandbox_agent.synth.split import OOD_PREFIXES

    dirs = sorted(d for d in run.glob("fold*") if d.is_dir() and (d / "test-rl-T0.jsonl").is_file())
    if not dirs:
        p.error(f"--rescore: no fold dir with a test-rl-T0.jsonl under {run}; give the --run-dir of a folds run")
    out: list[dict] = []
    for fr in dirs:
        old = json.loads((fr / "summary.json").read_text()) if (fr / "summary.json").is_file() else {}
        rows: dict[str, list] = {}
        for name, pattern in RESCORE_FILES.items():
            found = sorted(fr.glob(pattern))
            if len(found) > 1:
                raise SystemExit(f"--rescore: {fr} has {len(found)} files for {name} ({pattern}); expected one")
            if found:
                rows[name] = rows_of(found[0])
        f = old.get("fold", None if fr.name == "fold-default" else int(fr.name.removeprefix("fold")))
        after = rows_of(fr / "test-rl-T0.jsonl")
        # folds=-1: no fold is taken for the untouched one here; its summary.json says whether it is
        init = init_arm(old.get("rl") or {})
        new = fold_entry(fold=f, folds=-1, after=after, baselines=rows, ood_prefixes=OOD_PREFIXES, init=init)
        entry = {**old, **new, "untouched": bool(old.get("untouched", False)), "eval_pass1": eval_pass1(fr)}
        entry.setdefault("minutes", float("nan"))
        out.append(entry)
        (fr / "summary.json").write_text(json.dumps(entry, indent=2) + "\n")
    return finish(run, out)


def finish(run: Path, out: list[dict]) -> int:
    """The folds' tables, ``<run>/summary.json`` and the JSON line."""
    report(out)
    summary = {"folds": out, "targets": targets(out)}
    (run / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    emit_json(summary)
    return 0


def targets(folds: list[dict]) -> dict:
    """The issue's targets over the folds run: RL beats the best baseline by >= 10 points with the key-level
    interval above 0, on each fold and the untouched one; OOD's interval above 0; <= 45 minutes a fold (of the
    folds that ran every arm themselves; None when none did)."""
    whole = [f for f in folds if not f.get("reused")]
    return {
        "each_fold_beats_best_baseline_by_10": bool(folds)
        and all(f["pass1_after"] >= f["best_baseline_pass1"] + 0.10 for f in folds),
        "each_fold_ci_by_key_above_0": bool(folds) and all(f["ci95_diff_by_key"][0] > 0 for f in folds),
        "ood_ci_by_key_above_0": bool(folds)
        and all(f.get("ood", {}).get("ci95_diff_by_key", [0])[0] > 0 for f in folds),
        # a fold that reused arms (--reuse) did not pay for them: its minutes say nothing of a fold's cost
        "minutes_per_fold_le_45": all(f["minutes"] <= 45 for f in whole) if whole else None,
    }


def report(folds: list[dict]) -> None:
    rows = []
    for f in folds:
        lo, hi = f["ci95_diff_by_key"]
        base = ", ".join(f"{n} {v['mean']:.1%}" for n, v in f["baselines"].items())
        rows.append(
            [
                f"{f['fold']}{' (untouched)' if f['untouched'] else ''}"
                + ("" if f.get("rl", {}).get("init", "warm") == "warm" else f" (RL from {f['rl']['init']})"),
                f"{f['pass1_after']:.1%}",
                f"{f['best_baseline']} {f['best_baseline_pass1']:.1%}",
                f"[{lo:+.1%}, {hi:+.1%}] p {f['p_by_key']:.3f}",
                base,
                ", ".join(f"{n} {v['mean']:.1%}" for n, v in (f.get("eval_pass1") or {}).items()) or "-",
            ]
        )
    print_grid(
        ["fold", "RL pass@1", "best baseline", "RL - best, 95% CI by key", "every baseline (pass@1)", "on eval (T 0)"],
        rows,
        title="\nTEST split of each fold (greedy unless the baseline says; CIs over content keys)",
    )
    for f in folds:
        groups = f.get("by_group") or {}
        names = sorted({g for per in groups.values() for g in per})
        if not names:
            continue
        print_grid(
            ["policy", *names],
            [[pol, *(_cell(per.get(g)) for g in names)] for pol, per in groups.items()],
            title=f"\nfold {f['fold']} by group of keys: pass@1 / share of tests passed / turns (keys)",
        )


def _cell(g: dict | None) -> str:
    return "-" if not g else f"{g['pass1']:.0%} / {g['tests']:.0%} / {g['turns']:.1f} ({g['keys']})"
