"""One CUDA learner step in bf16 on ``bench.learner_load``'s ~1.7 B Qwen3-MoE, for ``bench/gpu_check.sh``.

**Untested until a GPU runs it** (no GPU has been lent to this project yet). Prints one JSON line per figure:

- ``{"check": "cuda", ...}``: the device, torch's version, bf16 support;
- ``{"check": "learner_step", ...}``: a forward and backward of the learner's loss path (``token_logprobs`` under
  bf16 autocast over fp32 weights, grouped experts) plus an AdamW step on ``--tokens`` tokens: seconds (after a
  warm-up step), peak GPU memory, parameters, and which SDPA kernel ran (read from the profiler's kernel names:
  flash, mem-efficient, cuDNN or math).

    python -m bench.gpu_step [--layers 16] [--tokens 4096]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path


def emit(**fields: object) -> None:
    print(json.dumps(fields, sort_keys=True), flush=True)


def sdpa_kernel(names: list[str]) -> str:
    """Which scaled-dot-product-attention kernel the profiled step launched, from CUDA kernel names: cuDNN's
    (``cudnn..sdpa..``), flash (``flash_fwd``), mem-efficient (``fmha_cutlass``, ``MemEffAttention``), else math
    (batched matmuls and a softmax)."""
    low = [n.lower() for n in names]
    if any("cudnn" in n and ("sdpa" in n or "attention" in n or "fmha" in n) for n in low):
        return "cudnn"
    if any("flash" in n for n in low):
        return "flash"
    if any("memeff" in n or "efficient" in n or "fmha" in n for n in low):
        return "mem_efficient"
    return "math" if any("gemm" in n or "bmm" in n for n in low) else "unknown"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_step", description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=16, help="layers of the bench model (16: ~1.7 B parameters)")
    p.add_argument("--tokens", type=int, default=4096, help="tokens in the step's one sequence")
    p.add_argument("--cache", type=Path, default=None, help="where the bench model is built (default: a temp dir)")
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        emit(check="cuda", ok=False, why="torch sees no CUDA device")
        return 1
    emit(
        check="cuda",
        ok=True,
        device=torch.cuda.get_device_name(0),
        torch=torch.__version__,
        bf16=torch.cuda.is_bf16_supported(),
    )
    from bench.learner_load import build_model
    from t1async.model.weights import load_pretrained

    cache = args.cache or Path(tempfile.mkdtemp(prefix="t1-gpu-"))
    t0 = time.perf_counter()
    d = build_model(cache, args.layers)
    model = load_pretrained(d).to("cuda")
    load_s = time.perf_counter() - t0
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True)
    ids = torch.randint(0, model.cfg.vocab_size, (1, args.tokens), device="cuda", generator=None)

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(ids, logits=False)
            lp, _ = model.token_logprobs(out.hidden, ids)
        (-lp.mean()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # warm-up: allocations, autotuning
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        t1 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        step_s = time.perf_counter() - t1
    kernels = [e.name for e in prof.key_averages()]
    emit(
        check="learner_step",
        ok=True,
        params=params,
        tokens=args.tokens,
        load_s=round(load_s, 2),
        step_s=round(step_s, 3),
        peak_gb=round(torch.cuda.max_memory_allocated() / 2**30, 2),
        sdpa_kernel=sdpa_kernel(kernels),
        cuda_kernels=len(kernels),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
