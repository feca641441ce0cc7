"""The learner's load, steps and saves on a model no rank holds whole (learner/distributed.py build_sharded).

Reports peak RSS per rank, load time, bit-equality across rank counts, one SFT and one RL step, and the
checkpoint's bytes and time.

The model is a ~1.7 B-parameter Qwen3-MoE that transformers writes from a config (16 layers, hidden 1024,
64 experts of 512, top-8; the shipped tokenizer's vocabulary): built on the meta device, filled by a seeded
normal init in bf16 and saved by ``save_pretrained`` in 4 shards, once, into ``--cache`` (``--layers N``
builds a smaller one beside it). For each rank count N of ``--ranks``, N processes (ranks over gloo on
127.0.0.1, what torchrun starts) each build the model on meta, shard it with FSDP2, allocate their 1/N and
read only their rows of the safetensors. Each rank reports its peak RSS (VmHWM) right after the load; the
weights' digest (one hash per row, merged over the ranks in row order) must be the same at every N
(``bit_equal``). With ``--steps``: one SFT step (next-token cross-entropy, every rank its rows of a batch) and
one RL step (the learner's PPO step, rank 0 commanding), then a push-only export (the model dir, in the
training dtype) and a full checkpoint (plus DCP model and AdamW state), each with its bytes and seconds. An
fp32 AdamW step needs 4x the fp32 weights in all (weights, gradients, two moments): the steps are for a
model whose 4x fits the box (``--layers``).

Run: ``python -m bench.learner_load --ranks 1,2 [--layers 16] [--steps] [--json]``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench._common import emit_json

GB = 1e9


def _vm_hwm() -> int:
    with open("/proc/self/status") as f:
        return next(int(x.split()[1]) * 1024 for x in f if x.startswith("VmHWM:"))


def _du(d: Path) -> int:
    return sum(p.stat().st_size for p in d.rglob("*") if p.is_file())


def build_model(cache: Path, layers: int) -> Path:
    """The bench's Qwen3-MoE as transformers writes it (seeded, bf16, 4 shards), built once into ``cache``."""
    d = cache / f"qwen3moe-l{layers}-h1024-e64x512"
    if (d / "model.safetensors.index.json").is_file():
        return d
    import shutil

    import torch
    import transformers

    from t1async.model.tokenizer import ChatTokenizer
    from t1async.model.weights import default_model_dir

    tok_dir = default_model_dir()
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=ChatTokenizer.load(tok_dir).vocab_size,
        hidden_size=1024,
        intermediate_size=3072,
        moe_intermediate_size=512,
        num_experts=64,
        num_experts_per_tok=8,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=128,  # type: ignore[call-arg]  # taken by **kwargs, missing from the typed signature
        max_position_embeddings=8192,
        tie_word_embeddings=False,
        norm_topk_prob=True,
        mlp_only_layers=[],
        dtype="bfloat16",
    )
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model = model.to_empty(device="cpu")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=g)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=cache))
    try:
        model.save_pretrained(tmp, max_shard_size=f"{total // 4 // 2**20 + 8}MB")
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(tok_dir / f, tmp / f)
        tmp.rename(d)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return d


def _digest(model) -> str | None:  # noqa: ANN001
    """One hash of the weights, the same whatever the rank count: a hash per row of dim 0 (each rank its own
    rows), gathered to rank 0 and merged in name and row order. Every rank calls it; rank 0 gets the hash."""
    import torch
    import torch.distributed as dist

    from t1async.model.weights import local_rows

    mine: dict[str, tuple[int, list[bytes]]] = {}
    for name, p in sorted(model.state_dict(keep_vars=True).items()):
        local, lo = local_rows(p)
        if local.shape[0] == 0:  # this rank holds no row of it (a [1, d] head on rank 1)
            continue
        flat = local.detach().contiguous().view(torch.uint8).reshape(local.shape[0], -1).numpy()
        mine[name] = (lo, [hashlib.blake2b(row.tobytes(), digest_size=16).digest() for row in flat])
    every: list[Any] = [None] * dist.get_world_size()
    dist.gather_object(mine, every if dist.get_rank() == 0 else None, dst=0)
    if dist.get_rank() != 0:
        return None
    h = hashlib.blake2b(digest_size=16)
    for name in sorted({k for r in every for k in r}):
        for _, rows in sorted((r[name] for r in every if name in r), key=lambda x: x[0]):
            for row in rows:
                h.update(row)
    return h.hexdigest()


def _sft_step(trainer, seed: int) -> float:  # noqa: ANN001
    """Every rank: next-token cross-entropy on its rows of a fixed batch, backward, one AdamW step (FSDP sums
    the ranks' gradients; each loss is divided by the world size)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    rank, world = dist.get_rank(), dist.get_world_size()
    rng = np.random.default_rng(seed)
    toks = torch.from_numpy(rng.integers(5, trainer.mcfg.vocab_size, size=(2 * max(world, 1), 128)))
    mine = toks[rank::world]
    logits = trainer.model(mine).logits
    loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), mine[:, 1:].reshape(-1)) / world
    loss.backward()
    trainer.optimizer.step()
    trainer.optimizer.zero_grad(set_to_none=True)
    out = loss.detach().clone()
    dist.all_reduce(out)
    return float(out)


def _rl_segments(vocab: int, n: int, seq_len: int) -> list:
    from t1async.ingest.tito import Segment

    rng = np.random.default_rng(1)
    out = []
    for i in range(n):
        toks = rng.integers(5, vocab, size=seq_len).astype(np.int32)
        lm = np.zeros(seq_len, dtype=bool)
        lm[seq_len // 2 :] = True
        out.append(
            Segment(
                episode=f"b{i}",
                index=0,
                tokens=toks,
                loss_mask=lm,
                logprobs=np.where(lm, -float(np.log(vocab)), 0).astype(np.float32),
                versions=np.where(lm, 0, -1).astype(np.int32),
                turn_ids=np.where(lm, 0, -1).astype(np.int32),
                routing=None,
                turn_ends=np.array([seq_len - 1], np.int32),
                turn_rewards=np.array([float(rng.normal())], np.float32),
                done=True,
            )
        )
    return out


def worker(args: argparse.Namespace) -> int:
    """One rank (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from the environment, as torchrun sets them)."""
    import torch

    from t1async.learner import ranks
    from t1async.learner.distributed import DistributedTrainer
    from t1async.learner.trainer_config import Advantage, TrainerConfig

    torch.set_num_threads(args.threads)
    ranks.join(backend="gloo")
    rank = int(os.environ["RANK"])
    tcfg = TrainerConfig(
        lr=1e-5, microbatch_tokens=512, replay=False, advantage=Advantage.TURN, train_dtype=args.train_dtype
    )
    t0 = time.perf_counter()
    trainer = DistributedTrainer.from_dir(args.model, tcfg)
    load_s = time.perf_counter() - t0
    out: dict[str, Any] = {"rank": rank, "load_s": load_s, "rss_after_load": _vm_hwm(), "read": trainer.read_bytes}
    out["digest"] = _digest(trainer.model)
    if args.steps:
        t = time.perf_counter()
        out["sft_loss"] = _sft_step(trainer, seed=0)
        out["sft_s"] = time.perf_counter() - t
    if rank == 0:
        if args.steps:
            t = time.perf_counter()
            m = trainer.step(_rl_segments(trainer.mcfg.vocab_size, 4, 128), 0)
            out["rl_s"], out["rl_loss"] = time.perf_counter() - t, m.loss
        root = Path(args.ckpt)
        for kind, full in (("export", False), ("checkpoint", True)):
            t = time.perf_counter()
            info = trainer.save(root, 1 if not full else 2, full=full, keep=0)
            out[f"{kind}_s"], out[f"{kind}_bytes"] = time.perf_counter() - t, _du(info.path)
            dcp = info.path / "dcp"
            out[f"{kind}_dcp_bytes"] = _du(dcp) if dcp.is_dir() else 0
        out["ranks_memory"] = trainer.rank_memory()
        trainer.stop_ranks()
    else:
        trainer.serve_rank()
    out["rss_end"] = _vm_hwm()
    Path(args.out).write_text(json.dumps(out))
    return 0


def run_ranks(n: int, model: Path, args: argparse.Namespace, scratch: Path) -> list[dict]:
    from t1async.transport.natsd import free_port

    port = free_port("127.0.0.1")
    procs = []
    for r in range(n):
        env = {
            **os.environ,
            "RANK": str(r),
            "LOCAL_RANK": str(r),
            "WORLD_SIZE": str(n),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
        argv = [sys.executable, "-m", "bench.learner_load", "--worker", "--model", str(model)]
        argv += ["--out", str(scratch / f"r{n}-{r}.json"), "--ckpt", str(scratch / f"ck{n}")]
        argv += ["--threads", str(args.threads), "--train-dtype", args.train_dtype] + (
            ["--steps"] if args.steps else []
        )
        procs.append(subprocess.Popen(argv, env=env))
    codes = [p.wait() for p in procs]
    if any(codes):
        raise SystemExit(f"bench.learner_load: {n} ranks exited with codes {codes}")
    return [json.loads((scratch / f"r{n}-{r}.json").read_text()) for r in range(n)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.learner_load", description=__doc__.split("\n")[0])
    p.add_argument("--ranks", default="1,2", help="rank counts, comma-separated")
    p.add_argument("--layers", type=int, default=16, help="layers of the bench model (16: ~1.7 B parameters)")
    p.add_argument("--steps", action="store_true", help="one SFT and one RL step per rank count (needs 4x fp32)")
    p.add_argument("--train-dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--cache", type=Path, default=None, help="where the bench model is built once")
    p.add_argument("--json", action="store_true")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--ckpt", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)
    from t1async.model.config import MoEConfig
    from t1async.model.weights import default_cache_root

    cache = args.cache or default_cache_root() / "bench"
    cache.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    model = build_model(cache, args.layers)
    build_s = time.perf_counter() - t
    cfg = MoEConfig.load(model)
    import torch

    from t1async.model.moe import MoETransformer

    with torch.device("meta"):
        params = sum(q.numel() for q in MoETransformer(cfg, init=False).parameters())
    res: dict[str, Any] = {
        "params": params,
        "layers": args.layers,
        "model_dir": str(model),
        "model_bytes": sum(f.stat().st_size for f in model.glob("*.safetensors")),
        "build_s": round(build_s, 1),
        "train_dtype": args.train_dtype,
        "peak_rss_gb_per_rank": {},
        "peak_rss_gb_per_rank_end": {},
        "load_s": {},
        "read_gb_per_rank": {},
    }
    digests = {}
    for n in [int(x) for x in args.ranks.split(",")]:
        with tempfile.TemporaryDirectory(prefix="t1-learner-load-") as scratch:
            outs = run_ranks(n, model, args, Path(scratch))
        k = str(n)
        res["peak_rss_gb_per_rank"][k] = [round(o["rss_after_load"] / GB, 3) for o in outs]
        res["peak_rss_gb_per_rank_end"][k] = [round(o["rss_end"] / GB, 3) for o in outs]
        res["load_s"][k] = round(max(o["load_s"] for o in outs), 2)
        res["read_gb_per_rank"][k] = [round(o["read"] / GB, 3) for o in outs]
        digests[k] = outs[0]["digest"]
        r0 = outs[0]
        for f in ("export_s", "export_bytes", "checkpoint_s", "checkpoint_bytes", "checkpoint_dcp_bytes"):
            res.setdefault(f, {})[k] = round(r0[f], 2) if f.endswith("_s") else r0[f]
        if args.steps:
            res.setdefault("sft_step_s", {})[k] = round(max(o["sft_s"] for o in outs), 2)
            res.setdefault("sft_loss", {})[k] = round(r0["sft_loss"], 5)
            res.setdefault("rl_step_s", {})[k] = round(r0["rl_s"], 2)
            res.setdefault("rl_loss", {})[k] = round(r0["rl_loss"], 5)
    res["bit_equal"] = len(set(digests.values())) == 1
    res["digests"] = digests
    fp32 = params * 4
    res["target_gb_at_2"] = round((fp32 / 2 + 1.5e9) / GB, 3)
    if "2" in res["peak_rss_gb_per_rank"]:
        res["target_met"] = max(res["peak_rss_gb_per_rank"]["2"]) <= res["target_gb_at_2"]
    if args.json:
        emit_json(res)
    else:
        for k, v in res.items():
            print(f"{k}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
