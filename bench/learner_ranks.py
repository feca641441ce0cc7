"""Step time and memory per rank of the learner: 1 rank (the plain Trainer) vs N ranks (the model sharded
by FSDP2, learner/distributed.py), side by side, on the same segments and starting weights.

Each configuration trains ``--steps`` PPO steps on ``--segments`` synthetic segments of ``--seq-len``
tokens (random tokens, the loss on their second half, routing and log-probs recorded by a no-grad forward
of the same model, as a sampler would) and reports the median step seconds, tokens per second, the
speed-up over 1 rank, and each rank's memory: the parameter, gradient and AdamW bytes it holds (its shards)
and its peak RSS (which includes building the full model once before sharding it). ``--model 100m`` is a
~100M-parameter MoE (the default ``tiny`` is the shipped model's architecture). Each rank gets ``--threads``
torch threads; N ranks need N cores to gain speed, so on a box with fewer free cores than ranks the time
ratio measures contention (the memory does not depend on it). Rank 0 is this process; ranks 1..N-1 are
``python -m t1async.learner.ranks`` children over gloo on 127.0.0.1 (what torchrun starts for the service).

Run: ``python -m bench.learner_ranks --ranks 1,2 [--model 100m] [--json]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench._common import emit_json, model_dir, print_grid, trainable_routing


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
        lp_t = torch.log_softmax(o.logits[0, :-1].float(), -1).gather(-1, x[0, 1:, None]).squeeze(-1)
        lp = np.concatenate([[0.0], lp_t.numpy()]).astype(np.float32)
        rt = trainable_routing(o.routing[0].numpy(), model.cfg.dense_layers)
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


MODELS: dict[
    str, dict[str, Any]
] = {  # MoEConfig fields over the defaults; "100m" is bench.weights' ~100M-parameter model
    "tiny": {},
    "100m": dict(
        d_model=768, n_layers=6, n_heads=12, n_kv_heads=4, head_dim=64, n_experts=8, top_k=2, d_ff=768, max_seq_len=4096
    ),
}


def _reset_peak_rss() -> None:
    """Linux: restart this process's peak RSS (VmHWM) from its current RSS."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.learner_ranks", description=__doc__.split("\n")[0])
    p.add_argument("--ranks", default="1,2", help="rank counts to compare (default 1,2)")
    p.add_argument("--segments", type=int, default=16, help="segments per step (default 16)")
    p.add_argument("--seq-len", type=int, default=512, help="max tokens per segment (default 512)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per configuration, after one warm-up (default 3)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    p.add_argument(
        "--model",
        default="tiny",
        metavar="NAME|DIR",
        help=f"model: {' or '.join(sorted(MODELS))} (the shipped architecture at that size), or a model dir (any "
        "supported Hugging Face MoE checkpoint); default tiny",
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON on the last line")
    args = p.parse_args(argv)
    mdir = None if args.model in MODELS else model_dir(Path(args.model))
    import dataclasses
    import gc

    from t1async.learner import malloc
    from t1async.learner.ranks import Ranks, RanksConfig
    from t1async.learner.trainer import Trainer, state_bytes
    from t1async.learner.trainer_config import TrainerConfig
    from t1async.model.moe import MoETransformer
    from t1async.model.weights import default_model_dir, load_pretrained

    torch.set_num_threads(args.threads)
    counts = [int(x) for x in args.ranks.split(",")]
    if mdir is not None:
        base = load_pretrained(mdir)
    elif args.model == "tiny":
        base = load_pretrained(default_model_dir())
    else:
        base = MoETransformer(dataclasses.replace(load_pretrained(default_model_dir()).cfg, **MODELS[args.model]))
    n_params = sum(p.numel() for p in base.parameters())
    segs = _segments(base, args.segments, args.seq_len, seed=0)
    tokens = sum(len(s.tokens) for s in segs)
    base_state = {k: v.clone() for k, v in base.state_dict().items()}
    cfg = base.cfg
    del base
    gc.collect()

    def fresh() -> MoETransformer:
        m = MoETransformer(cfg)
        m.load_state_dict(base_state)
        return m

    tcfg = TrainerConfig(microbatch_tokens=4096)
    rows, result = (
        [],
        {
            "segments": args.segments,
            "tokens_per_step": tokens,
            "threads_per_rank": args.threads,
            "cpus": os.cpu_count(),
            "load_avg_1m": os.getloadavg()[0],
            "model": args.model,
            "params": n_params,
            "configs": {},
            "memory_per_rank": {},
        },
    )
    for n in counts:
        malloc.trim()
        _reset_peak_rss()  # rank 0 is this process: its peak from here on is this configuration's
        ranks = Ranks(RanksConfig(nproc=n, threads=args.threads)) if n > 1 else None
        trainer: Any = None
        try:
            trainer = ranks.start(fresh(), tcfg) if ranks is not None else Trainer(fresh(), tcfg)
            _time_steps(trainer, segs, 1)  # warm-up
            times = _time_steps(trainer, segs, args.steps)
            mem = trainer.rank_memory() if ranks is not None else [state_bytes(trainer)]
        finally:
            if ranks is not None:
                ranks.close(trainer)
        del trainer
        gc.collect()
        med = statistics.median(times)
        result["configs"][str(n)] = {"step_s": med, "steps_s": times, "tokens_per_s": tokens / med}
        result["memory_per_rank"][str(n)] = {str(r): m for r, m in enumerate(mem)}
    one = result["configs"].get("1", {}).get("step_s")
    for n in counts:
        c = result["configs"][str(n)]
        c["speedup_vs_1"] = one / c["step_s"] if one else None
        rows.append((n, c["step_s"], c["tokens_per_s"], f"{c['speedup_vs_1']:.2f}x" if one else "-"))
    print_grid(
        ["ranks", "step_s", "tok/s", "vs 1 rank"],
        rows,
        title=f"learner step, {args.model} model ({n_params / 1e6:.1f}M params), {args.segments} segments / "
        f"{tokens} tokens, {args.threads} thread(s) per rank, {os.cpu_count()} CPUs, load {result['load_avg_1m']:.1f}",
    )
    mib = 2**20
    print_grid(
        ["ranks", "rank", "params MiB", "grads MiB", "AdamW MiB", "state MiB", "peak RSS MiB"],
        [
            (
                n,
                r,
                m["param_bytes"] / mib,
                m["grad_bytes"] / mib,
                m["optim_bytes"] / mib,
                m["state_bytes"] / mib,
                m["rss_peak_bytes"] / mib,
            )
            for n in counts
            for r, m in result["memory_per_rank"][str(n)].items()
        ],
        title="memory per rank: the training state each rank holds, and its peak RSS",
    )
    if args.json:
        emit_json(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
