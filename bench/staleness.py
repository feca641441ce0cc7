"""``python -m bench.staleness``: the real loop at η = 0 (synchronous RL) and η = 1, 2, 4, side by side.

For each η it runs ``python -m t1async.cluster up`` (nats-server, the embedded sampler, actors in bubblewrap,
the learner) for ``--duration`` seconds on a fresh run dir, and measures:

- ``turns_per_s``: turns trained per second between the learner's first and last step (end to end: a turn
  is counted once it was sampled, executed, streamed, assembled and trained);
- ``max_staleness``: the largest staleness of any token trained (it must never exceed η);
- ``sampler_idle``: the fraction of time the sampler had no request running or waiting (polled from its
  ``/get_server_info`` every 0.1 s);
- ``stale_masked_tokens``: tokens the learner's safety net took out of the loss for exceeding η (0 unless
  a credit lease expired);
- the credit waits the actors felt (backpressure): ``credit_waits`` (grants), ``credit_wait_mean_s``,
  ``credit_wait_p99_s`` (the worst actor's p99 over its latest 4096 waits) and ``credit_wait_max_s``, and
  ``credit_wait_share``: credit wait over the actors' episode-slot time;
- ``mismatch`` and ``policy_shift``: the learner's mean |Δlogp| on fresh and on stale tokens (last step).

``overlap_bound`` = ``(T_sample + T_train) / max(T_sample, T_train)`` from the η = 0 run (DESIGN §11): the
most any η can gain by overlapping sampling with training. ``T_train`` is the learner's summed step time
between its first and last step, ``T_sample`` the rest of that wall time (η = 0 is synchronous, so the two
alternate).

Prints a table, writes ``staleness.json`` and ``staleness.png`` under ``--out``, and with ``--json`` prints
the JSON object as the last stdout line.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import shutil
import time
from pathlib import Path

import httpx

from bench._common import emit_json, print_grid


def run_one(eta: int, args: argparse.Namespace, root: Path) -> dict:
    run_dir = root / f"eta{eta}"
    argv = [sys.executable, "-m", "t1async.cluster", "up", "--run-dir", str(run_dir), "--max-staleness", str(eta),
            "--duration", str(args.duration), "--actors", str(args.actors), "--concurrency", str(args.concurrency),
            "--batch-turns", str(args.batch_turns), "--max-turns", str(args.max_turns),
            "--max-new-tokens", str(args.max_new_tokens), "--synth-tasks", "60", "--seed", str(args.seed),
            "--verify-every", str(args.verify_every)]  # fmt: skip
    if args.tasks:
        argv += ["--tasks", str(args.tasks)]
    log = open(run_dir.with_suffix(".log"), "w")
    env = {**os.environ, "T1_LOG_JSON": "1"}
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    idle = busy = 0
    try:
        ready = run_dir / "sampler.url"
        deadline = time.monotonic() + 120
        while not ready.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"bench.staleness: the cluster for eta={eta} did not start; see {log.name}")
            time.sleep(0.2)
        url = ready.read_text().strip()
        with httpx.Client(trust_env=False, timeout=2.0) as c:
            while proc.poll() is None:
                try:
                    info = c.get(f"{url}/get_server_info").json()
                    st = info["internal_states"][0]
                    if int(st.get("running_requests", 0)) + int(st.get("waiting", 0)) == 0:
                        idle += 1
                    else:
                        busy += 1
                except (httpx.HTTPError, ValueError, KeyError, IndexError):
                    pass
                time.sleep(0.1)
        proc.wait()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)
        log.close()
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    try:
        out = summarise(records, eta, slots=args.actors * args.concurrency)
    except ValueError as exc:
        raise SystemExit(f"bench.staleness: eta={eta}: {exc}; raise --duration (see {run_dir}/logs)") from None
    return {**out, "sampler_idle": idle / max(idle + busy, 1)}


def summarise(records: list[dict], eta: int, *, slots: int) -> dict:
    """One η's row from its ``metrics.jsonl`` records (learner and actors, in order)."""
    learner = [m for m in records if m.get("component") == "learner" and m.get("turns_trained", 0) > 0]
    if len(learner) < 2:
        raise ValueError(f"the learner trained fewer than two steps ({len(learner)} metrics records with turns)")
    first = learner[0]
    last = next(m for m in learner if m["step"] == learner[-1]["step"])  # when the last step landed, not later
    if last is first:
        raise ValueError("the learner's first and last records are of the same step")
    wall = max(last["t"] - first["t"], 1e-9)
    turns_per_s = (last["turns_trained"] - first["turns_trained"]) / wall
    step_s = {int(m["step"]): float(m["t_step_s"]) for m in learner if "t_step_s" in m}
    t_train = sum(v for k, v in step_s.items() if int(first["step"]) < k <= int(last["step"]))
    t_sample = max(wall - t_train, 0.0)
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
        "eta": eta, "turns_per_s": turns_per_s, "max_staleness": int(last["max_staleness"]),
        "stale_masked_tokens": int(last.get("stale_masked_tokens", 0)), "steps": int(last["step"]),
        "turns_trained": int(last["turns_trained"]), "staleness_hist": last.get("staleness_hist", {}),
        "credit_waits": waits, "credit_wait_s": wait_s, "credit_wait_mean_s": wait_s / waits if waits else 0.0,
        "credit_wait_p99_s": max((float(a.get("credit_wait_p99_s", 0.0)) for a in actors.values()), default=0.0),
        "credit_wait_max_s": max((float(a.get("credit_wait_max_s", 0.0)) for a in actors.values()), default=0.0),
        "credit_wait_share": min(wait_s / slot_s, 1.0),
        "mismatch": float(last.get("mismatch", 0.0)), "policy_shift": float(last.get("policy_shift", 0.0)),
        "t_train_s": t_train, "t_sample_s": t_sample,
        "overlap_bound": (t_sample + t_train) / max(t_sample, t_train, 1e-9),
    }  # fmt: skip


def plot(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.5))
    etas = [str(r["eta"]) for r in runs]
    a.bar(etas, [r["turns_per_s"] for r in runs], color="tab:blue")
    a.set_xlabel("η (max staleness)")
    a.set_ylabel("turns trained / s")
    a.set_title("end-to-end throughput")
    b.bar(etas, [r["sampler_idle"] for r in runs], color="tab:orange")
    b.set_xlabel("η (max staleness)")
    b.set_ylabel("fraction of time")
    b.set_title("sampler idle")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.staleness", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--etas", default="0,1,2,4", help="comma-separated η values (default 0,1,2,4)")
    p.add_argument("--duration", type=float, default=90.0, help="seconds per η (default 90)")
    p.add_argument("--actors", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=4, help="episodes per actor")
    p.add_argument("--batch-turns", type=int, default=32)
    p.add_argument("--max-turns", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--verify-every", type=int, default=0, help="run the verifier every N turns (dense reward; default 0)")
    p.add_argument("--tasks", type=Path, default=None, help="task dir (default: a synthetic corpus per run)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("runs/bench/staleness"), help="where the JSON and PNG go")
    p.add_argument("--json", action="store_true", help="print the JSON object as the last stdout line")
    args = p.parse_args(argv)
    try:
        etas = [int(x) for x in args.etas.split(",")]
    except ValueError:
        p.error(f"--etas must be comma-separated integers, got {args.etas!r}")
    if args.duration < 10:
        p.error("--duration must be at least 10 seconds")
    args.out.mkdir(parents=True, exist_ok=True)
    runs = []
    root = args.out / "runs"  # kept for inspection (logs, metrics.jsonl); replaced on the next run
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    for i, eta in enumerate(etas):
        print(f"[{i + 1}/{len(etas)}] η={eta}: running the loop for {args.duration:.0f} s ...", file=sys.stderr, flush=True)
        runs.append(run_one(eta, args, root))
    base = runs[0]["turns_per_s"] or 1e-9
    rows = [(r["eta"], r["turns_per_s"], r["turns_per_s"] / base, r["max_staleness"], r["stale_masked_tokens"],
             r["sampler_idle"], f"{r['credit_wait_mean_s']:.3f}", f"{r['credit_wait_p99_s']:.3f}",
             f"{r['credit_wait_share']:.0%}", r["steps"]) for r in runs]  # fmt: skip
    print_grid(["eta", "turns/s", f"x eta={runs[0]['eta']}", "max staleness", "stale masked", "sampler idle",
                "credit wait mean s", "p99 s", "wait share", "steps"], rows,
                title="bench.staleness: the real loop at each η")  # fmt: skip
    at0 = next((r for r in runs if r["eta"] == 0), None)
    if at0 is not None:
        print(f"overlap bound at η=0: (T_sample + T_train) / max = ({at0['t_sample_s']:.1f} + "
              f"{at0['t_train_s']:.1f}) / "
              f"max = {at0['overlap_bound']:.2f}x")
    ok = all(r["max_staleness"] <= r["eta"] for r in runs)
    print(f"max trained staleness <= η in every run: {ok}")
    result = {"runs": runs, "speedup_max_vs_first": runs[-1]["turns_per_s"] / base, "staleness_ok": ok,
              "overlap_bound": at0["overlap_bound"] if at0 is not None else None,
              "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}}  # fmt: skip
    (args.out / "staleness.json").write_text(json.dumps(result, indent=2))
    plot(runs, args.out / "staleness.png")
    print(f"wrote {args.out / 'staleness.json'} and {args.out / 'staleness.png'}")
    if args.json:
        emit_json(result)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
