"""``python -m bench.staleness``: the real loop at η = 0 (synchronous RL) and η = 1, 2, 4, side by side.

For each η it runs ``python -m t1async.cluster up`` (nats-server, the embedded sampler, actors in bubblewrap,
the learner) for ``--duration`` seconds on a fresh run dir, and measures:

- ``turns_per_s``: turns trained per second between the learner's first and last step (end to end: a turn
  is counted once it was sampled, executed, streamed, assembled and trained);
- ``max_staleness``: the largest staleness of any token trained (it must never exceed η);
- ``sampler_idle``: the fraction of time the sampler had no request running or waiting (polled from its
  ``/get_server_info`` every 0.1 s).

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
    learner = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    learner = [m for m in learner if m["component"] == "learner" and m.get("turns_trained", 0) > 0]
    if len(learner) < 2:
        raise SystemExit(f"bench.staleness: eta={eta} trained fewer than two steps in {args.duration} s; "
                         f"raise --duration (see {run_dir}/logs)")  # fmt: skip
    first, last = learner[0], learner[-1]
    turns_per_s = (last["turns_trained"] - first["turns_trained"]) / max(last["t"] - first["t"], 1e-9)
    return {"eta": eta, "turns_per_s": turns_per_s, "max_staleness": int(last["max_staleness"]),
            "sampler_idle": idle / max(idle + busy, 1), "steps": int(last["step"]),
            "turns_trained": int(last["turns_trained"]), "staleness_hist": last.get("staleness_hist", {})}  # fmt: skip


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
    rows = [(r["eta"], r["turns_per_s"], r["turns_per_s"] / base, r["max_staleness"], r["sampler_idle"], r["steps"]) for r in runs]
    print_grid(["eta", "turns/s", f"x eta={runs[0]['eta']}", "max staleness", "sampler idle", "steps"], rows,
                title="bench.staleness: the real loop at each η")  # fmt: skip
    ok = all(r["max_staleness"] <= r["eta"] for r in runs)
    print(f"max trained staleness <= η in every run: {ok}")
    result = {"runs": runs, "speedup_max_vs_first": runs[-1]["turns_per_s"] / base, "staleness_ok": ok,
              "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}}  # fmt: skip
    (args.out / "staleness.json").write_text(json.dumps(result, indent=2))
    plot(runs, args.out / "staleness.png")
    print(f"wrote {args.out / 'staleness.json'} and {args.out / 'staleness.png'}")
    if args.json:
        emit_json(result)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
