"""Weight push to a real embedded sampler: /update_weights_from_disk vs SGLang's distributed path.

For each model config (the shipped tiny model, and a ~100M-parameter one) it starts a sampler process,
then pushes perturbed weights ``--repeats`` times each way and reports the median seconds:

- ``disk``: what ``--weight-sync disk`` puts between a trained step and the sampler serving it: write the
  weights (save_pretrained: safetensors + config) and POST /update_weights_from_disk (the sampler reads them);
  ``disk_load_s`` is the POST alone (as if the checkpoint were free);
- ``distributed``: DistributedPusher.push (pause, /update_weights_from_distributed per bucket with the
  tensors broadcast over a gloo group on 127.0.0.1, continue). The group is made once, before timing, as
  the learner does.

Both sides run on this machine's CPUs; the learner with ``--weight-sync distributed`` still writes a
checkpoint each step for resume, but off the sampler's path. Run: ``python -m bench.weights [--json]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import torch

from bench._common import add_model_arg, emit_json, model_dir, print_grid

if TYPE_CHECKING:
    from t1async.model.moe import MoETransformer

CONFIGS: dict[str, dict[str, Any] | None] = {
    "tiny": None,  # the shipped model
    "100m": dict(
        d_model=768, n_layers=6, n_heads=12, n_kv_heads=4, head_dim=64, n_experts=8, top_k=2, d_ff=768, max_seq_len=4096
    ),
}


def _model(name: str, work: Path) -> tuple[MoETransformer, Path]:
    """The model of a config name, or of a model dir (``--model``), and its directory."""
    from t1async.model.moe import MoETransformer
    from t1async.model.tokenizer import ChatTokenizer
    from t1async.model.weights import default_config, default_model_dir, load_pretrained, save_pretrained

    if name not in CONFIGS:  # --model DIR
        return load_pretrained(Path(name)), Path(name)
    fields = CONFIGS[name]
    if fields is None:
        return load_pretrained(default_model_dir()), Path(default_model_dir())
    tok = ChatTokenizer.load()
    # the shipped default's architecture (Qwen3-MoE) at this size
    model = MoETransformer(dataclasses.replace(default_config(), dense_d_ff=0, **fields))
    d = save_pretrained(model, work / f"{name}-init", tok)
    return model, d


def _perturb(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 1e-3)


async def _run(name: str, repeats: int, bucket_mb: float, work: Path) -> dict:
    from t1async.learner.weightpush import DistributedPusher, WeightPushConfig
    from t1async.model.weights import save_pretrained
    from t1async.sampler.client import SGLangClient
    from t1async.sampler.launch import SamplerProcess

    model, init_dir = _model(name, work)
    params = sum(p.numel() for p in model.parameters())
    proc = SamplerProcess(init_dir, max_batch=4, start_timeout_s=300.0)
    url = proc.start()
    disk, disk_load, dist = [], [], []
    policy_version = 0
    try:
        async with SGLangClient([url], timeout=600.0) as client:
            pusher = DistributedPusher(client, WeightPushConfig(bucket_mb=bucket_mb))
            await pusher.connect()
            try:
                for r in range(repeats):
                    _perturb(model, r)
                    policy_version += 1
                    t0 = time.perf_counter()
                    path = save_pretrained(model, work / f"{name}-v{policy_version}")
                    t1 = time.perf_counter()
                    await client.update_weights_from_disk(str(path), policy_version)
                    t2 = time.perf_counter()
                    disk.append(t2 - t0)
                    disk_load.append(t2 - t1)
                    policy_version += 1
                    t0 = time.perf_counter()
                    out = await pusher.push(model, policy_version)
                    dist.append(time.perf_counter() - t0)
            finally:
                await pusher.aclose()
    finally:
        proc.stop()
    d, dl, ds = statistics.median(disk), statistics.median(disk_load), statistics.median(dist)
    return {
        "params": params,
        "mb": round(out["mb"], 1),
        "buckets": out["buckets"],
        "disk_s": round(d, 4),
        "disk_load_s": round(dl, 4),
        "distributed_s": round(ds, 4),
        "speedup": round(d / ds, 2),
        "speedup_vs_load": round(dl / ds, 2),
        "repeats": repeats,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.weights", description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default="tiny,100m", help="comma-separated, of: " + ", ".join(CONFIGS))
    ap.add_argument("--repeats", type=int, default=3, help="pushes each way per config (median reported)")
    ap.add_argument("--bucket-mb", type=float, default=64.0, help="MiB per /update_weights_from_distributed")
    ap.add_argument("--json", action="store_true", help="print the result as JSON on the last line")
    add_model_arg(ap)
    args = ap.parse_args(argv)
    names = [n for n in args.configs.split(",") if n]
    if args.model is not None:  # that checkpoint instead of the built-in configs
        names = [str(model_dir(args.model))]
    bad = [n for n in names if n not in CONFIGS and args.model is None]
    if bad or args.repeats < 1:
        raise SystemExit(f"bench.weights: unknown config {bad} (use {', '.join(CONFIGS)}) or --repeats < 1")
    torch.set_num_threads(1)
    res: dict = {}
    with tempfile.TemporaryDirectory(prefix="t1-bench-weights-") as tmp:
        for n in names:
            res[n] = anyio.run(_run, n, args.repeats, args.bucket_mb, Path(tmp), backend="trio")
            # each disk version is a full copy on disk: drop them as we go
    keys = ["params", "mb", "buckets", "disk_s", "disk_load_s", "distributed_s", "speedup", "speedup_vs_load"]
    print_grid(
        ["config", *keys],
        [[n, *(r[k] for k in keys)] for n, r in res.items()],
        title=f"weight push to one embedded sampler, median of {args.repeats}",
    )
    if args.json:
        main_cfg = res.get("100m") or next(iter(res.values()))  # or --model's
        emit_json(
            {
                "disk_s": main_cfg["disk_s"],
                "distributed_s": main_cfg["distributed_s"],
                "params": main_cfg["params"],
                "configs": res,
            }
        )


if __name__ == "__main__":
    main()
