"""The arithmetic of ``bench.staleness`` (its docstring defines every field): one η's row from a run's
``metrics.jsonl``, the sampler's idle share from its own busy accounting, the overlap bound beside async/sync,
and the measured reasons a run fell short. Also the two process reads the bench polls."""

from __future__ import annotations

import json
from pathlib import Path

import psutil


def component_pid(run_dir: Path, name: str) -> int | None:
    """The PID `cluster up` recorded for one of its components (None until it is started)."""
    try:
        return int(json.loads((run_dir / "cluster.json").read_text())["components"][name]["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def cpu_s(pid: int) -> float | None:
    """CPU seconds (user + system) a process has used, all its threads, those gone included."""
    try:
        t = psutil.Process(pid).cpu_times()
    except psutil.Error:
        return None
    return float(t.user + t.system)


def sampler_idle(samples: list[tuple[float, float, float]], t0: float, t1: float) -> float | None:
    """The sampler's idle fraction between wall times ``t0`` and ``t1``, from ``(t, busy_s, uptime_s)`` samples
    (the first and last taken inside the window); None with fewer than two there."""
    inside = [x for x in samples if t0 <= x[0] <= t1]
    if len(inside) < 2 or inside[-1][2] <= inside[0][2]:
        return None
    (_, b0, u0), (_, b1, u1) = inside[0], inside[-1]
    return min(max(1.0 - (b1 - b0) / (u1 - u0), 0.0), 1.0)


def overlap(runs: list[dict]) -> dict:
    """The η = 0 run's bound beside what the largest η got: async/sync and its share of the bound."""
    at0 = next((r for r in runs if r["eta"] == 0), None)
    top = max(runs, key=lambda r: r["eta"])
    if at0 is None or top is at0:
        return {}
    ratio = top["turns_per_s"] / max(at0["turns_per_s"], 1e-9)
    # when training is the slower side, the sampler can only keep up and wait: it idles at least this share
    floor = max(0.0, 1.0 - at0["t_sample_s"] / max(at0["t_train_s"], 1e-9))
    return {
        "eta_async": top["eta"],
        "t_sample_s": at0["t_sample_s"],
        "t_train_s": at0["t_train_s"],
        "overlap_bound": at0["overlap_bound"],
        "async_over_sync": ratio,
        "of_bound": ratio / at0["overlap_bound"],
        "sampler_idle_async": top["sampler_idle"],
        "sampler_idle_floor": floor,
        "sampler_idle_sync": at0["sampler_idle"],
        "target_of_bound": 0.85,
        "target_sampler_idle": 0.15,
        "targets_met": ratio >= 0.85 * at0["overlap_bound"]
        and top["sampler_idle"] is not None
        and top["sampler_idle"] <= 0.15,
    }


def summarise(records: list[dict], eta: int, *, slots: int, warmup_steps: int = 1) -> dict:
    """One η's row from its ``metrics.jsonl`` records (learner and actors, in order). Throughput, T_train and
    T_sample count from the end of step ``warmup_steps`` (the first steps train the shortest contexts) to the
    end of the last step."""
    learner = [m for m in records if m.get("component") == "learner" and m.get("turns_trained", 0) > 0]
    if len(learner) < 2:
        raise ValueError(f"the learner trained fewer than two steps ({len(learner)} metrics records with turns)")
    first = next((m for m in learner if int(m["step"]) >= warmup_steps), learner[-1])
    last = next(m for m in learner if m["step"] == learner[-1]["step"])  # when the last step landed, not later
    if int(last["step"]) <= int(first["step"]):
        raise ValueError(
            f"the learner's first and last records are of the same step ({last['step']}, with "
            f"{warmup_steps} warm-up steps)"
        )
    wall = max(last["t"] - first["t"], 1e-9)
    turns_per_s = (last["turns_trained"] - first["turns_trained"]) / wall
    # the step's whole wall time (train, checkpoint, weight push) where the learner reports it
    step_s = {int(m["step"]): float(m.get("t_step_wall_s", m["t_step_s"])) for m in learner if "t_step_s" in m}
    t_train = sum(v for k, v in step_s.items() if int(first["step"]) < k <= int(last["step"]))
    t_sample = max(wall - t_train, 0.0)
    # tokens the learner's forward passes covered per trained turn (a turn deep in its episode costs more: its
    # segment holds the whole history), so two windows can be seen to train the same mix
    step_tok = {int(m["step"]): int(m.get("tokens", 0)) for m in learner}
    window = [k for k in step_s if int(first["step"]) < k <= int(last["step"])]
    turns_in = last["turns_trained"] - first["turns_trained"]
    tokens_in = sum(step_tok.get(k, 0) for k in window)
    actors: dict[str, dict] = {}
    t_actor: dict[str, tuple[float, float]] = {}
    for m in records:
        if m.get("component") == "actor":
            actors[m["subject"]] = m
            t0 = t_actor.get(m["subject"], (m["t"], m["t"]))[0]
            t_actor[m["subject"]] = (t0, m["t"])
    waits = sum(int(a.get("credit_waits", a.get("turns", 0))) for a in actors.values())
    wait_s = sum(float(a.get("credit_wait_s", 0.0)) for a in actors.values())
    span = (max(b for _, b in t_actor.values()) - min(a for a, _ in t_actor.values())) if t_actor else 0.0
    slot_s = slots * max(span, 1e-9)
    return {
        "eta": eta,
        "turns_per_s": turns_per_s,
        "max_staleness": int(last["max_staleness"]),
        "stale_masked_tokens": int(last.get("stale_masked_tokens", 0)),
        "steps": int(last["step"]),
        "turns_trained": int(last["turns_trained"]),
        "staleness_hist": last.get("staleness_hist", {}),
        "credit_waits": waits,
        "credit_wait_s": wait_s,
        "credit_wait_mean_s": wait_s / waits if waits else 0.0,
        "credit_wait_p99_s": max((float(a.get("credit_wait_p99_s", 0.0)) for a in actors.values()), default=0.0),
        "credit_wait_max_s": max((float(a.get("credit_wait_max_s", 0.0)) for a in actors.values()), default=0.0),
        "credit_wait_share": min(wait_s / slot_s, 1.0),
        "mismatch": float(last.get("mismatch", 0.0)),
        "policy_shift": float(last.get("policy_shift", 0.0)),
        "tokens_per_turn": tokens_in / max(turns_in, 1),
        "train_s_per_ktok": t_train / tokens_in * 1000 if tokens_in else None,
        "t_train_s": t_train,
        "t_sample_s": t_sample,
        "t_first": float(first["t"]),
        "t_last": float(last["t"]),
        "overlap_bound": (t_sample + t_train) / max(t_sample, t_train, 1e-9),
    }


def why(runs: list[dict], ov: dict) -> list[str]:
    """One line per measured reason async fell short of the bound or left the sampler idle (docs/results.md: Overlap,
    measured); empty when the targets were met."""
    if not ov or ov["targets_met"]:
        return []
    at0 = next(r for r in runs if r["eta"] == 0)
    top = next(r for r in runs if r["eta"] == ov["eta_async"])
    out = []
    if ov["sampler_idle_floor"] > ov["target_sampler_idle"]:
        out.append(
            f"training is the slower side at η=0 (T_train {ov['t_train_s']:.0f} s vs T_sample "
            f"{ov['t_sample_s']:.0f} s): the sampler must idle >= {ov['sampler_idle_floor']:.0%} at any η"
        )
    tok = top["tokens_per_turn"] / max(at0["tokens_per_turn"], 1e-9)
    if tok > 1.1:
        out.append(
            f"at η={top['eta']} the learner trained {tok:.2f}x the tokens per turn of η=0 (episodes cut "
            "across steps have their history trained again)"
        )
    if top["train_s_per_ktok"] and at0["train_s_per_ktok"]:
        slow = top["train_s_per_ktok"] / at0["train_s_per_ktok"]
        if slow > 1.1:
            out.append(f"at η={top['eta']} each 1000 tokens took the learner {slow:.2f}x as long as at η=0")
    for r in (at0, top):
        if r["learner_cpu_share"] is not None and r["learner_cpu_share"] < 0.8:
            out.append(
                f"at η={r['eta']} the learner ran only {r['learner_cpu_share']:.0%} of its step time: "
                "something else ran on its CPU"
            )
    return out
