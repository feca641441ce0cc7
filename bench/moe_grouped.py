"""The training MoE's experts, grouped vs the per-expert loop, side by side in one run.

For each expert count (``--experts 8,64``) it builds one MoE model, copies it, sets the copy to the loop
(``ExpertPath.LOOP``, the reference) and times one training step of each on the same tokens: the forward
without logits, the chunked log-probs, the backward (the trainer's path, ``moe.MoETransformer``). Reported
per path: the median seconds of ``--repeats`` steps and the ops one MoE layer's forward dispatches from
Python (the profiler's root events). The two paths alternate within each repeat, so machine noise lands on
both. ``--adamw`` also times one AdamW step over the same model, foreach vs fused (the trainer's choice).

On CPU, torch's ``_grouped_mm`` still loops over the experts inside C++ (one ``mm`` each): what the grouped
path removes here is the Python loop, its ~8 dispatched ops an expert and the ``tolist()``; on an H100 in
bf16 it is one CUTLASS kernel a projection. Run: ``python -m bench.moe_grouped [--json]``.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from typing import Any

import torch

from bench._common import emit_json, print_grid


def _config(args: argparse.Namespace, experts: int):
    from t1async.model.config import MoEConfig

    return MoEConfig(
        vocab_size=args.vocab,
        d_model=args.d_model,
        n_layers=args.layers,
        n_heads=args.d_model // 64,
        head_dim=64,
        n_experts=experts,
        top_k=args.top_k,
        d_ff=args.d_ff,
        max_seq_len=max(4096, args.tokens),
        seed=0,
    )


def _step(model, tokens: torch.Tensor, bf16: bool) -> None:
    """One training forward and backward, as the trainer runs it."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        out = model(tokens, logits=False)
        lp, _ = model.token_logprobs(out.hidden, tokens)
        loss = -lp.mean() + out.values.square().mean()
    loss.backward()
    model.zero_grad(set_to_none=True)


def _layer_ops(model, tokens: torch.Tensor) -> int:
    """Ops one MoE layer's forward dispatches from Python (profiler root events)."""
    from torch.profiler import ProfilerActivity, profile

    layer = model.blocks[0].moe
    x = torch.randn(tokens.numel(), model.cfg.d_model)
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
        layer(x)
    return sum(1 for e in prof.events() if e.cpu_parent is None)


def _adamw_ms(model, repeats: int) -> dict[str, float]:
    """Median ms of one AdamW step over ``model``'s parameters (random gradients), foreach vs fused."""
    out = {}
    for name, foreach, fused in (("foreach", True, None), ("fused", None, True)):
        params = [p.detach().clone().requires_grad_() for p in model.parameters()]
        for p in params:
            p.grad = torch.randn_like(p)
        opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, foreach=foreach, fused=fused)
        opt.step()  # state allocation, outside the timing
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - t0)
        out[name] = 1e3 * statistics.median(times)
    return out


def main(argv: list[str] | None = None) -> None:
    from t1async.model.moe import ExpertPath, MoETransformer

    p = argparse.ArgumentParser(prog="python -m bench.moe_grouped", description=__doc__.splitlines()[0])
    p.add_argument("--experts", default="8,64", help="comma-separated expert counts (default 8,64)")
    p.add_argument("--tokens", type=int, default=1024, help="tokens a step (one row; default 1024)")
    p.add_argument("--d-model", type=int, default=256, help="hidden width (default 256)")
    p.add_argument("--d-ff", type=int, default=128, help="each expert's width (default 128)")
    p.add_argument("--top-k", type=int, default=4, help="experts a token (default 4)")
    p.add_argument("--layers", type=int, default=2, help="MoE layers (default 2)")
    p.add_argument("--vocab", type=int, default=4096, help="vocabulary (default 4096)")
    p.add_argument("--repeats", type=int, default=5, help="timed steps a path (default 5, after one warm-up)")
    p.add_argument("--bf16", action="store_true", help="under bf16 autocast (--train-dtype bfloat16)")
    p.add_argument("--adamw", action="store_true", help="also time one AdamW step, foreach vs fused")
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    p.add_argument("--json", action="store_true", help="print the results as one JSON line last")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    rows, result = [], {"tokens": args.tokens, "bf16": args.bf16, "threads": torch.get_num_threads(), "runs": {}}
    for experts in (int(e) for e in args.experts.split(",")):
        grouped = MoETransformer(_config(args, experts))
        loop = copy.deepcopy(grouped)
        loop.set_expert_path(ExpertPath.LOOP)
        tokens = torch.randint(0, args.vocab, (1, args.tokens), generator=torch.Generator().manual_seed(experts))
        times: dict[str, list[float]] = {"loop": [], "grouped": []}
        for i in range(args.repeats + 1):
            for name, model in (("loop", loop), ("grouped", grouped)):
                t0 = time.perf_counter()
                _step(model, tokens, args.bf16)
                if i:  # the first is a warm-up
                    times[name].append(time.perf_counter() - t0)
        run: dict[str, Any] = {
            "params": sum(p.numel() for p in grouped.parameters()),
            "loop_s": statistics.median(times["loop"]),
            "grouped_s": statistics.median(times["grouped"]),
            "loop_ops_per_layer": _layer_ops(loop, tokens),
            "grouped_ops_per_layer": _layer_ops(grouped, tokens),
        }
        run["speedup"] = run["loop_s"] / run["grouped_s"]
        if args.adamw:
            run["adamw_ms"] = _adamw_ms(grouped, args.repeats)
        result["runs"][str(experts)] = run
        rows.append(
            [
                experts,
                f"{run['params'] / 1e6:.1f}M",
                run["loop_s"],
                run["grouped_s"],
                run["speedup"],
                run["loop_ops_per_layer"],
                run["grouped_ops_per_layer"],
            ]
        )
    print_grid(
        ["experts", "params", "loop_s", "grouped_s", "speedup", "loop_ops/layer", "grouped_ops/layer"],
        rows,
        title=f"one training step, {args.tokens} tokens, {'bf16 autocast' if args.bf16 else 'fp32'}",
    )
    if args.adamw:
        for e, run in result["runs"].items():
            print(
                f"AdamW step at {e} experts: foreach {run['adamw_ms']['foreach']:.1f} ms, "
                f"fused {run['adamw_ms']['fused']:.1f} ms"
            )
    if args.json:
        emit_json(result)


if __name__ == "__main__":
    main()
