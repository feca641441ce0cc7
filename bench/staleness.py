"""``python -m bench.staleness``: the real loop at η = 0 (synchronous RL) and η = 1, 2, 4, side by side.

For each η it runs ``python -m t1async.cluster up`` (nats-server, the embedded sampler, actors in bubblewrap,
the learner) for ``--duration`` seconds on a fresh run dir, and measures:

- ``turns_per_s``: turns trained per second in the timed window (below) (end to end: a turn
  is counted once it was sampled, executed, streamed, assembled and trained);
- ``max_staleness``: the largest staleness of any token trained (it must never exceed η);
- ``sampler_idle``: the fraction of the timed window the sampler spent outside its
  scheduler steps, from the sampler's own accounting (``busy_s`` and ``uptime_s`` in ``/get_server_info``,
  read every 0.5 s: ``1 - Δbusy_s / Δuptime_s``);
- ``stale_masked_tokens``: tokens the learner's safety net took out of the loss for exceeding η (0 unless
  a credit lease expired);
- the credit waits the actors felt (backpressure): ``credit_waits`` (grants), ``credit_wait_mean_s``,
  ``credit_wait_p99_s`` (the worst actor's p99 over its latest 4096 waits) and ``credit_wait_max_s``, and
  ``credit_wait_share``: credit wait over the actors' episode-slot time;
- ``mismatch`` and ``policy_shift``: the learner's mean |Δlogp| on fresh and on stale tokens (last step).
- ``tokens_per_turn`` (tokens the learner's passes covered per trained turn: a turn deep in its episode
  trains its whole history), ``train_s_per_ktok`` (T_train per 1000 of those tokens: the learner's speed)
  and ``learner_cpu_share`` (the learner's CPU seconds over T_train, from ``/proc/<pid>/stat``: near 1 when
  its one torch thread had its core; well below 1 when something else ran there).

``overlap_bound`` = ``(T_sample + T_train) / max(T_sample, T_train)`` from the η = 0 run (design §11): the
most any η can gain by overlapping sampling with training. ``T_train`` is the learner's summed step wall time
(train, checkpoint, weight push) in the timed window, ``T_sample`` the rest of that wall time (η
= 0 is synchronous, so the two alternate). ``async_over_sync`` is turns/s at the largest η over turns/s at η
= 0, and ``of_bound`` that ratio over the bound (target >= 0.85, with the sampler idle <= 15% at that η).
``sampler_idle_floor`` = ``max(0, 1 - T_sample / T_train)``: when training is the slower side the sampler can
only run η versions ahead and then wait, so at any η it idles at least that share.

The timed window runs from the end of learner step ``--warmup-steps`` to the end of the last step. By default
the learner runs on one CPU and everything else (the sampler, actors, their sandboxes, nats-server) on
another (``taskset -c 0 cluster up --sampler-cpus 0 --learner-cpus 1``): the sampling side and the training
side, each on its own core, as the bound assumes. ``--no-pin`` lets them share every CPU.

Prints a table, writes ``staleness.json`` and ``staleness.png`` under ``--out``, and with ``--json`` prints
the JSON object as the last stdout line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from bench._common import add_model_arg, emit_json, model_dir, print_grid
from bench._overlap import component_pid, cpu_s, overlap, sampler_idle, summarise, why


def run_one(eta: int, args: argparse.Namespace, root: Path) -> dict:
    run_dir = root / f"eta{eta}"
    argv = [
        sys.executable,
        "-m",
        "t1async.cluster",
        "up",
        "--run-dir",
        str(run_dir),
        "--preset",
        "none",  # the bare model's multi-turn workload, not the learn recipe's 4-turn episodes
        "--max-staleness",
        str(eta),
        "--duration",
        str(args.duration),
        "--actors",
        str(args.actors),
        "--concurrency",
        str(args.concurrency),
        "--batch-turns",
        str(args.batch_turns),
        "--max-turns",
        str(args.max_turns),
        "--max-new-tokens",
        str(args.max_new_tokens),
        "--synth-tasks",
        "60",
        "--seed",
        str(args.seed),
        "--verify-every",
        str(args.verify_every),
    ]
    if args.engine == "vllm":  # a real vLLM samples (cluster up starts it); it reports no busy time: idle unmeasured
        argv += ["--engine", "vllm"]
    if args.tasks:
        argv += ["--tasks", str(args.tasks)]
    if args.model:
        argv += ["--model", str(args.model)]
    if args.pin:
        # everything but the learner (the supervisor, nats-server, actors, their sandboxes) shares the sampler's
        # CPU: the sampling side on one core, the training side on the other, as the bound assumes
        argv = [
            "taskset",
            "-c",
            str(args.pin[0]),
            *argv,
            "--sampler-cpus",
            str(args.pin[0]),
            "--learner-cpus",
            str(args.pin[1]),
        ]
    log = open(run_dir.with_suffix(".log"), "w")
    env = {**os.environ, "T1_LOG_JSON": "1"}
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    samples: list[tuple[float, float, float]] = []  # (time.time(), busy_s, uptime_s) of the sampler
    cpu: list[tuple[float, float]] = []  # (time.time(), the learner's CPU seconds so far)
    learner_pid = None
    try:
        ready = run_dir / "sampler.url"
        deadline = time.monotonic() + (600 if args.engine == "vllm" else 120)  # vLLM's start takes a minute
        while not ready.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"bench.staleness: the cluster for eta={eta} did not start; see {log.name}")
            time.sleep(0.2)
        url = ready.read_text().strip()
        key = (run_dir / "secrets" / "sampler.key").read_text().strip()  # cluster up keys its sampler (design §4)
        info = "/get_server_info" if args.engine != "vllm" else ""  # vLLM's has no busy_s: sampler_idle stays None
        with httpx.Client(trust_env=False, timeout=2.0, headers={"Authorization": f"Bearer {key}"}) as c:
            while proc.poll() is None:
                try:
                    if info:
                        st = c.get(f"{url}{info}").json()["internal_states"][0]
                        samples.append((time.time(), float(st["busy_s"]), float(st["uptime_s"])))
                except (httpx.HTTPError, ValueError, KeyError, IndexError):
                    pass
                learner_pid = learner_pid or component_pid(run_dir, "learner")
                used = cpu_s(learner_pid) if learner_pid else None
                if used is not None:
                    cpu.append((time.time(), used))
                time.sleep(0.5)
        proc.wait()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)
        log.close()
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    try:
        out = summarise(records, eta, slots=args.actors * args.concurrency, warmup_steps=args.warmup_steps)
    except ValueError as exc:
        raise SystemExit(f"bench.staleness: eta={eta}: {exc}; raise --duration (see {run_dir}/logs)") from None
    inside = [x for x in cpu if out["t_first"] <= x[0] <= out["t_last"]]
    share = (inside[-1][1] - inside[0][1]) / out["t_train_s"] if len(inside) >= 2 and out["t_train_s"] > 0 else None
    return {**out, "sampler_idle": sampler_idle(samples, out["t_first"], out["t_last"]), "learner_cpu_share": share}


def _fmt(v: float | None, spec: str) -> str:
    return "–" if v is None else format(v, spec)


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
    b.bar(etas, [float("nan") if r["sampler_idle"] is None else r["sampler_idle"] for r in runs], color="tab:orange")
    b.set_xlabel("η (max staleness)")
    b.set_ylabel("fraction of time")
    b.set_title("sampler idle")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.staleness", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--etas", default="0,1,2,4", help="comma-separated η values (default 0,1,2,4)")
    p.add_argument("--duration", type=float, default=90.0, help="seconds per η (default 90)")
    p.add_argument("--actors", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=4, help="episodes per actor")
    p.add_argument("--batch-turns", type=int, default=32)
    p.add_argument("--max-turns", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument(
        "--verify-every", type=int, default=0, help="run the verifier every N turns (dense reward; default 0)"
    )
    p.add_argument("--tasks", type=Path, default=None, help="task dir (default: a synthetic corpus per run)")
    p.add_argument(
        "--engine",
        default="embedded",
        choices=("embedded", "vllm"),
        help="vllm: cluster up --engine vllm (a real vLLM samples; its idle share is not measured)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("runs/bench/staleness"), help="where the JSON and PNG go")
    p.add_argument(
        "--no-pin",
        action="store_true",
        help="let the sampler and the learner share every CPU "
        "(default: the sampler, actors and NATS on the first CPU we may use, the learner on the "
        "second)",
    )
    p.add_argument("--warmup-steps", type=int, default=2, help="learner steps left out of the timing (default 2)")
    p.add_argument("--json", action="store_true", help="print the JSON object as the last stdout line")
    add_model_arg(p)
    args = p.parse_args(argv)
    if args.model:
        model_dir(args.model)  # checked here, in one line, before any cluster starts
    cpus = sorted(os.sched_getaffinity(0))
    args.pin = None if args.no_pin or len(cpus) < 2 else (cpus[0], cpus[1])
    try:
        etas = [int(x) for x in args.etas.split(",")]
    except ValueError:
        p.error(f"--etas must be comma-separated integers, got {args.etas!r}")
    if args.warmup_steps < 1:
        p.error("--warmup-steps must be >= 1 (the window starts when a step ends)")
    if args.duration < 10:
        p.error("--duration must be at least 10 seconds")
    args.out.mkdir(parents=True, exist_ok=True)
    runs = []
    root = args.out / "runs"  # kept for inspection (logs, metrics.jsonl); replaced on the next run
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    for i, eta in enumerate(etas):
        print(
            f"[{i + 1}/{len(etas)}] η={eta}: running the loop for {args.duration:.0f} s ...",
            file=sys.stderr,
            flush=True,
        )
        runs.append(run_one(eta, args, root))
    base = runs[0]["turns_per_s"] or 1e-9
    rows = [
        (
            r["eta"],
            r["turns_per_s"],
            r["turns_per_s"] / base,
            r["max_staleness"],
            r["stale_masked_tokens"],
            "–" if r["sampler_idle"] is None else f"{r['sampler_idle']:.0%}",
            f"{r['credit_wait_mean_s']:.3f}",
            f"{r['credit_wait_p99_s']:.3f}",
            f"{r['credit_wait_share']:.0%}",
            r["steps"],
            f"{r['tokens_per_turn']:.0f}",
            _fmt(r["train_s_per_ktok"], ".2f"),
            _fmt(r["learner_cpu_share"], ".0%"),
        )
        for r in runs
    ]
    print_grid(
        [
            "eta",
            "turns/s",
            f"x eta={runs[0]['eta']}",
            "max staleness",
            "stale masked",
            "sampler idle",
            "credit wait mean s",
            "p99 s",
            "wait share",
            "steps",
            "tokens/turn",
            "train s/ktok",
            "learner CPU/step wall",
        ],
        rows,
        title="bench.staleness: the real loop at each η",
    )
    ov = overlap(runs)
    if ov:
        idle = ov["sampler_idle_async"]
        print_grid(
            [
                "T_sample s (η=0)",
                "T_train s (η=0)",
                "overlap bound",
                f"async/sync (η={ov['eta_async']}/0)",
                "of bound (>= 0.85)",
                f"sampler idle η={ov['eta_async']} (<= 15%)",
                "idle floor",
                "targets met",
            ],
            [
                (
                    ov["t_sample_s"],
                    ov["t_train_s"],
                    f"{ov['overlap_bound']:.2f}x",
                    f"{ov['async_over_sync']:.2f}x",
                    ov["of_bound"],
                    "–" if idle is None else f"{idle:.0%}",
                    f"{ov['sampler_idle_floor']:.0%}",
                    ov["targets_met"],
                )
            ],
            title="overlap: what async can gain at most on these cores, and what it got"
            + (f" (learner on CPU {args.pin[1]}, the rest on CPU {args.pin[0]})" if args.pin else " (unpinned)"),
        )
    reasons = why(runs, ov)
    for line in reasons:
        print(f"why not: {line}")
    ok = all(r["max_staleness"] <= r["eta"] for r in runs)
    print(f"max trained staleness <= η in every run: {ok}")
    result = {
        "runs": runs,
        "speedup_max_vs_first": runs[-1]["turns_per_s"] / base,
        "staleness_ok": ok,
        **ov,
        "why": reasons,
        "pinned": list(args.pin) if args.pin else None,
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
    }
    (args.out / "staleness.json").write_text(json.dumps(result, indent=2))
    plot(runs, args.out / "staleness.png")
    print(f"wrote {args.out / 'staleness.json'} and {args.out / 'staleness.png'}")
    if args.json:
        emit_json(result)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
