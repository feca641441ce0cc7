"""Step time of the distributed learner: 1 rank (the plain Trainer) vs N ranks (learner/distributed.py),
side by side, on the same segments and starting weights.

Each configuration trains ``--steps`` PPO steps on ``--segments`` synthetic segments of ``--seq-len``
tokens (random tokens, the loss on their second half, routing and log-probs recorded by a no-grad forward
of the same model, as a sampler would) and reports the median step seconds, tokens per second, and the
speed-up over 1 rank. Each rank gets ``--threads`` torch threads; N ranks need N cores to gain anything, so
on a box with fewer free cores than ranks the ratio measures contention. Rank 0 is this process; ranks
1..N-1 are ``python -m t1async.learner.ranks`` children over gloo on 127.0.0.1.

Run: ``python -m bench.learner_ranks --ranks 1,2 [--json]``.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

import numpy as np
import torch

from bench._common import emit_json, print_grid


def _segments(model, n: int, seq_len: int, seed: int) -> list:  # noqa: ANN001
    from t1async.ingest.tito import Segment

    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        t = int(rng.integers(seq_len // 2, seq_len + 1))
        toks = rng.integers(5, model.cfg.vocab_size, size=t).astype(np.int32)
        x = torch.from_numpy(toks[None].astype(np.int64))
        with torch.no_grad():
            o = model(x)
        lp = torch.log_softmax(o.logits[0, :-1].float(), -1).gather(-1, x[0, 1:, None]).squeeze(-1)
        lp = np.concatenate([[0.0], lp.numpy()]).astype(np.float32)
        rt = o.routing[0].numpy().astype(np.int16)
        rt[-1] = -1
        lm = np.zeros(t, dtype=bool)
        lm[t // 2 :] = True
        out.append(
            Segment(
                episode=f"b{i}",
                index=0,
                tokens=toks,
                loss_mask=lm,
                logprobs=np.where(lm, lp, 0).astype(np.float32),
                versions=np.where(lm, 0, -1).astype(np.int32),
                turn_ids=np.where(lm, 0, -1).astype(np.int32),
                routing=rt,
                turn_ends=np.array([t - 1], np.int32),
                turn_rewards=np.array([float(rng.normal())], np.float32),
                done=True,
            )
        )
    return out


def _time_steps(trainer, segs: list, steps: int) -> list[float]:  # noqa: ANN001
    times = []
    for v in range(steps):
        t0 = time.perf_counter()
        trainer.step(segs, v)
        times.append(time.perf_counter() - t0)
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.learner_ranks", description=__doc__.split("\n")[0])
    p.add_argument("--ranks", default="1,2", help="rank counts to compare (default 1,2)")
    p.add_argument("--segments", type=int, default=16, help="segments per step (default 16)")
    p.add_argument("--seq-len", type=int, default=512, help="max tokens per segment (default 512)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per configuration, after one warm-up (default 3)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    p.add_argument("--json", action="store_true", help="print the result as JSON on the last line")
    args = p.parse_args(argv)
    from t1async.learner.ranks import Ranks, RanksConfig
    from t1async.learner.trainer import Trainer
    from t1async.learner.trainer_config import TrainerConfig
    from t1async.model.weights import default_model_dir, load_pretrained

    torch.set_num_threads(args.threads)
    counts = [int(x) for x in args.ranks.split(",")]
    base = load_pretrained(default_model_dir())
    segs = _segments(base, args.segments, args.seq_len, seed=0)
    tokens = sum(len(s.tokens) for s in segs)
    tcfg = TrainerConfig(microbatch_tokens=4096)
    rows, result = (
        [],
        {
            "segments": args.segments,
            "tokens_per_step": tokens,
            "threads_per_rank": args.threads,
            "cpus": os.cpu_count(),
            "load_avg_1m": os.getloadavg()[0],
            "configs": {},
        },
    )
    for n in counts:
        trainer = Trainer(copy.deepcopy(base), tcfg)
        ranks = Ranks(RanksConfig(nproc=n, threads=args.threads)) if n > 1 else None
        try:
            if ranks is not None:
                trainer = ranks.start(trainer)
            _time_steps(trainer, segs, 1)  # warm-up
            times = _time_steps(trainer, segs, args.steps)
        finally:
            if ranks is not None:
                ranks.close(trainer)
        med = statistics.median(times)
        result["configs"][str(n)] = {"step_s": med, "steps_s": times, "tokens_per_s": tokens / med}
    one = result["configs"].get("1", {}).get("step_s")
    for n in counts:
        c = result["configs"][str(n)]
        c["speedup_vs_1"] = one / c["step_s"] if one else None
        rows.append((n, c["step_s"], c["tokens_per_s"], f"{c['speedup_vs_1']:.2f}x" if one else "-"))
    print_grid(
        ["ranks", "step_s", "tok/s", "vs 1 rank"],
        rows,
        title=f"learner step, {args.segments} segments / {tokens} tokens, {args.threads} thread(s) per rank, "
        f"{os.cpu_count()} CPUs, load {result['load_avg_1m']:.1f}",
    )
    if args.json:
        emit_json(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
