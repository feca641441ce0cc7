"""Load test of a sampler over SGLang's native API: ``python -m bench.sampler [--url URL] ...``.

Reports what SGLang's ``bench_serving`` reports (same JSON field names): completed, request/input/output
throughput, mean/median/p99 TTFT, ITL and end-to-end latency (ms), and concurrency (sum of request
latencies / duration). Requests stream (SSE) so TTFT and ITL are measured at the client; outputs have a
fixed length (``ignore_eos``), so throughputs compare like with like.

Modes:
- default: ``--num-prompts`` random prompts of ``--input-len`` tokens, ``--concurrency`` in flight at most,
  arriving at ``--request-rate`` per second (Poisson; inf = all at once).
- ``--multi-turn T``: ``--num-prompts`` sessions of T turns, each turn's input = previous input + output +
  a new observation of ``--input-len`` tokens (a terminal agent's growing context); reports per-turn
  latency against context length and ``cached_ratio`` = cached_tokens / prompt_tokens from turn 2 on.
- ``--compare-concurrency 1,32``: the default run at each concurrency, in one process, and the ratio of
  output throughput (last level over first).
- ``--samplers 1,2,4``: multi-turn sessions through the client's sampler pool over N embedded samplers,
  pinned and unpinned (bench/_samplers.py): prefix-cache hit ratio and throughput per N.

The load and its measurements are in bench/_load.py. Without ``--url`` it starts the embedded sampler
(t1async/sampler/launch.py) and stops it afterwards. ``--json`` prints one JSON object as the last stdout line;
``--output-file`` appends it as a JSON line.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import httpx
import numpy as np

from bench._common import emit_json, print_grid, print_table
from bench._load import random_ids, run_load, run_multi_turn, stream_generate
from t1async.sampler.auth import API_KEY_ENV


@asynccontextmanager
async def sampler_url(args: argparse.Namespace, engine: str) -> AsyncIterator[str]:
    if args.url:
        yield args.url.rstrip("/")
        return
    if engine == "vllm":  # a real vLLM on the same model and dtype (t1async.sampler.vllm_launch)
        import tempfile

        from t1async.model.weights import default_model_dir
        from t1async.sampler.vllm_launch import ServeSettings, launch_vllm

        print(f"starting vLLM (dtype {args.dtype}) ...", file=sys.stderr)
        with tempfile.TemporaryDirectory(prefix="t1-bench-vllm-") as d:
            model = Path(args.model or default_model_dir())
            settings = ServeSettings(
                model=model, vllm_dtype=args.dtype, vllm_max_model_len=8192, log_file=Path(d) / "vllm.log"
            )
            async with launch_vllm(settings) as url:
                yield url
        return
    from t1async.sampler.launch import launch_sampler

    print(f"starting the embedded sampler (dtype {args.dtype}, max batch {args.max_batch}) ...", file=sys.stderr)
    async with launch_sampler(args.model, dtype=args.dtype, max_batch=args.max_batch, seed=args.seed) as url:
        yield url


def _main_rows(r: dict) -> list[tuple[str, object]]:
    return [
        ("Max request concurrency", r["max_concurrency"]),
        ("Successful requests", r["completed"]),
        ("Benchmark duration (s)", r["duration"]),
        ("Total input tokens", r["total_input_tokens"]),
        ("Total generated tokens", r["total_output_tokens"]),
        ("Request throughput (req/s)", r["request_throughput"]),
        ("Input token throughput (tok/s)", r["input_throughput"]),
        ("Output token throughput (tok/s)", r["output_throughput"]),
        ("Concurrency", r["concurrency"]),
        ("Mean E2E Latency (ms)", r["mean_e2e_latency_ms"]),
        ("Median E2E Latency (ms)", r["median_e2e_latency_ms"]),
        ("P99 E2E Latency (ms)", r["p99_e2e_latency_ms"]),
        ("Mean TTFT (ms)", r["mean_ttft_ms"]),
        ("Median TTFT (ms)", r["median_ttft_ms"]),
        ("P99 TTFT (ms)", r["p99_ttft_ms"]),
        ("Mean ITL (ms)", r["mean_itl_ms"]),
        ("Median ITL (ms)", r["median_itl_ms"]),
        ("P99 ITL (ms)", r["p99_itl_ms"]),
    ]


def _vocab(args: argparse.Namespace) -> int:
    """The model's vocabulary (vLLM's API does not say it): ``--vocab-size``, else the model dir's config."""
    if args.vocab_size is not None:
        return int(args.vocab_size)
    from t1async.model.tokenizer import assets_dir

    return int(
        json.loads(((Path(args.model) if args.model else assets_dir()) / "config.json").read_text())["vocab_size"]
    )


async def amain(args: argparse.Namespace) -> dict:
    if args.samplers:
        from bench._samplers import run_samplers

        return await run_samplers(args, [int(x) for x in args.samplers.split(",") if x.strip()])
    if args.compare_engines:  # the same load against the embedded sampler, then a real vLLM, on one model
        runs = {e: await one_engine(args, e) for e in ("embedded", "vllm")}
        base, other = runs["embedded"], runs["vllm"]
        r = dict(other)
        r.update(
            engines=runs,
            ratio_output_throughput=other["output_throughput"] / max(base["output_throughput"], 1e-9),
            ratio_mean_ttft=other["mean_ttft_ms"] / max(base["mean_ttft_ms"], 1e-9),
        )
        keys = ["completed", "output_throughput", "request_throughput", "mean_ttft_ms", "mean_itl_ms"]
        print_grid(
            ["engine", *keys, "mean_e2e_latency_ms"],
            [[e, *(x[k] for k in keys), x["mean_e2e_latency_ms"]] for e, x in runs.items()],
        )
        print(f"vLLM / embedded output throughput: {r['ratio_output_throughput']:.2f}x", flush=True)
        return r
    return await one_engine(args, args.engine)


async def one_engine(args: argparse.Namespace, engine: str) -> dict:
    """The run ``args`` ask for, against ``engine`` (``embedded``/``sglang``: SGLang's protocol; ``vllm``)."""
    proto = "vllm" if engine == "vllm" else "sglang"
    async with sampler_url(args, engine) as url:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=512)
        key = args.sampler_api_key or os.environ.get(API_KEY_ENV)
        headers = {"Authorization": f"Bearer {key}"} if key else {}  # an embedded one inherits $T1_SAMPLER_API_KEY
        async with httpx.AsyncClient(
            timeout=httpx.Timeout(args.timeout, connect=10.0), limits=limits, headers=headers
        ) as client:
            vocab = args.vocab_size
            if vocab is None and proto == "vllm":
                vocab = _vocab(args)
            elif vocab is None:
                info = (await client.get(url + "/get_model_info")).json()
                vocab = int(info.get("vocab_size") or 1000)
            common = dict(
                engine=proto,
                input_len=args.input_len,
                output_len=args.output_len,
                vocab=vocab,
                temperature=args.temperature,
                stream=not args.disable_stream,
            )
            warm = await stream_generate(
                client,
                url,
                random_ids(np.random.default_rng(0), args.input_len, vocab),
                min(args.output_len, 4),
                args.temperature,
                engine=proto,
            )
            if not warm.ok:
                raise SystemExit(f"warm-up request to {url} failed: {warm.error}")
            if args.multi_turn:
                await client.post(url + ("/reset_prefix_cache" if proto == "vllm" else "/flush_cache"))
                r = await run_multi_turn(
                    client,
                    url,
                    sessions=args.num_prompts or 8,
                    turns=args.multi_turn,
                    concurrency=args.concurrency,
                    seed=args.seed,
                    prompt_len=args.prompt_len,
                    **common,
                )
                print_table(
                    "Multi-turn Benchmark Result", _main_rows(r) + [("Cached ratio (turns 2+)", r["cached_ratio"])]
                )
                print_grid(
                    ["turn", "completed", "context_len", "e2e_ms", "ttft_ms", "cached_ratio"],
                    [
                        [
                            p["turn"],
                            p["completed"],
                            p["mean_context_len"],
                            p["mean_e2e_latency_ms"],
                            p["mean_ttft_ms"],
                            p["cached_ratio"],
                        ]
                        for p in r["per_turn"]
                    ],
                )
            elif args.compare_concurrency:
                levels = [int(x) for x in args.compare_concurrency.split(",") if x.strip()]
                runs = []
                for c in levels:
                    n = args.num_prompts or max(8, 2 * c)
                    runs.append(
                        await run_load(
                            client, url, num_prompts=n, concurrency=c, request_rate=math.inf, seed=args.seed, **common
                        )
                    )
                r = dict(runs[-1])
                ratio = runs[-1]["output_throughput"] / max(runs[0]["output_throughput"], 1e-9)
                r.update(levels=runs, ratio=ratio, compare_concurrency=levels)
                print_grid(
                    ["concurrency", "completed", "out_tok/s", "req/s", "mean_ttft_ms", "mean_itl_ms", "mean_e2e_ms"],
                    [
                        [
                            x["max_concurrency"],
                            x["completed"],
                            x["output_throughput"],
                            x["request_throughput"],
                            x["mean_ttft_ms"],
                            x["mean_itl_ms"],
                            x["mean_e2e_latency_ms"],
                        ]
                        for x in runs
                    ],
                )
                print(f"output throughput ratio, concurrency {levels[-1]} vs {levels[0]}: {ratio:.2f}x", flush=True)
            else:
                r = await run_load(
                    client,
                    url,
                    num_prompts=args.num_prompts or 64,
                    concurrency=args.concurrency,
                    request_rate=args.request_rate,
                    seed=args.seed,
                    **common,
                )
                print_table("Serving Benchmark Result", _main_rows(r))
    r["url"] = url if args.url else ("vllm" if engine == "vllm" else "embedded")  # the server this bench started
    r["backend"] = proto
    return r


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.sampler", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--url", help="sampler URL (default: start the embedded sampler, or vLLM with --engine vllm)")
    p.add_argument(
        "--engine",
        default="sglang",
        choices=("sglang", "vllm"),
        help="the protocol: sglang (SGLang, or the embedded sampler) or vllm (/inference/v1/generate; without "
        "--url, start vLLM from .venv-vllm on --model at --dtype)",
    )
    p.add_argument(
        "--compare-engines",
        action="store_true",
        help="the same load against the embedded sampler and a real vLLM, on the same --model and --dtype, one "
        "after the other; reports both and vLLM/embedded ratios",
    )
    p.add_argument("--sampler-api-key", metavar="KEY", help=f"--url's API key (default: ${API_KEY_ENV})")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight at most (default 8)")
    p.add_argument(
        "--num-prompts",
        type=int,
        default=None,
        help="requests (sessions with --multi-turn); default 64, 8 sessions, or max(8, 2x) per level",
    )
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens (per turn's new observation)")
    p.add_argument("--output-len", type=int, default=64, help="output tokens per request (ignore_eos)")
    p.add_argument(
        "--prompt-len",
        type=int,
        default=None,
        help="--multi-turn: the first turn's context (system "
        "prompt + task; default --input-len); later turns add --output-len + --input-len each",
    )
    p.add_argument("--request-rate", type=float, default=math.inf, help="requests per second (default inf)")
    p.add_argument("--multi-turn", type=int, default=0, metavar="TURNS", help="sessions of TURNS growing turns")
    p.add_argument(
        "--compare-concurrency",
        default=None,
        metavar="C1,C2",
        help="run at each concurrency and report the output-throughput ratio (e.g. 1,32)",
    )
    p.add_argument(
        "--samplers",
        default=None,
        metavar="N1,N2",
        help="sessions of --multi-turn turns (default 4) "
        "through the client's sampler pool over N embedded samplers, pinned and unpinned, for each N "
        "(e.g. 1,2,4): prefix-cache hit ratio and throughput",
    )
    p.add_argument("--load-cap", type=int, default=16, help="--samplers: the pool's load cap (default 16)")
    p.add_argument(
        "--disable-stream",
        action="store_true",
        help="plain POSTs (TTFT = latency, no ITL), as bench_serving's --disable-stream",
    )
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab-size", type=int, default=None, help="default: from /get_model_info")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout in seconds")
    p.add_argument("--model", default=None, help="embedded server: model directory (default: the tiny model)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="embedded server dtype")
    p.add_argument("--max-batch", type=int, default=64, help="embedded server batch size")
    p.add_argument("--output-file", default=None, help="append the result as a JSON line")
    p.add_argument("--json", action="store_true", help="print the result as JSON on the last stdout line")
    args = p.parse_args(argv)
    for name in ("concurrency", "input_len", "output_len"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.request_rate <= 0:
        p.error("--request-rate must be > 0")
    return args


def _finite(x: object) -> object:
    """JSON has no Infinity: a non-finite float becomes the string "inf" (as bench_serving's request_rate)."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_finite(v) for v in x]
    return x


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from t1async.log import configure

    configure("warning")  # logs to stderr; stdout is the table and the JSON line
    r = _finite(anyio.run(amain, args, backend="trio"))
    assert isinstance(r, dict)  # _finite keeps a dict a dict
    if args.output_file:
        with open(args.output_file, "a", encoding="utf-8") as f:
            f.write(json.dumps(r, sort_keys=True) + "\n")
    if args.json:
        emit_json(r)
    return 0 if r.get("completed", 0) > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
