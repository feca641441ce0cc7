"""``python -m bench.sampler --samplers 1,2,4``: the same multi-turn sessions (a terminal agent's growing
context) through ``SGLangClient``'s sampler pool over N embedded samplers, for each N.

Each N runs twice on the same samplers (caches flushed between): **pinned** (every turn of a session carries
the agent's ``rid`` ``<session>/<turn>``; between turns a session waits 0-100 ms, its command running, so the
pool keeps the session on one sampler under its load cap) and **unpinned** (no episode key: each turn goes
to the least-loaded sampler, as before the pool). Reported
per run: ``cached_ratio`` (cached_tokens / prompt_tokens over turns 2+, the prefix-cache hit ratio), output
tokens/s and turns/s, and how the sessions' turns spread over the samplers. On one CPU box N samplers share
the same cores, so throughput measures contention, not scale-out; the cache ratio is what pinning buys.
"""

from __future__ import annotations

import time
from contextlib import AsyncExitStack

import anyio
import numpy as np

from bench._common import print_grid


async def _sessions(
    client,
    *,
    pinned: bool,
    sessions: int,
    turns: int,
    prompt_len: int,
    input_len: int,
    output_len: int,
    vocab: int,
    seed: int,
    temperature: float,
) -> dict:
    from t1async.protocol.sampling import SamplingParams

    params = SamplingParams(max_new_tokens=output_len, temperature=temperature)
    prompt = cached = out_tokens = done = 0
    per_url: dict[str, int] = {}

    async def session(s: int) -> None:
        nonlocal prompt, cached, out_tokens, done
        rng = np.random.default_rng([seed, s])
        ctx = rng.integers(16, vocab, size=prompt_len).tolist()
        for t in range(turns):
            g = await client.generate(ctx, params, rid=f"bench-s{s}/{t}" if pinned else f"bench-s{s}-t{t}")
            per_url[g.extra["url"]] = per_url.get(g.extra["url"], 0) + 1
            out_tokens += len(g.output_ids)
            done += 1
            if t > 0:
                prompt += g.prompt_tokens
                cached += g.cached_tokens
            ctx = ctx + g.output_ids.tolist() + rng.integers(16, vocab, size=input_len).tolist()
            await anyio.sleep(rng.uniform(0, 0.1))  # the command runs: sessions drift apart, as real episodes do

    t0 = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for s in range(sessions):
            tg.start_soon(session, s)
    dt = time.perf_counter() - t0
    return {
        "pinned": pinned,
        "cached_ratio": cached / max(prompt, 1),
        "output_throughput": out_tokens / dt,
        "turns_per_s": done / dt,
        "duration": dt,
        "turns": done,
        "turns_per_sampler": sorted(per_url.values()),
    }


async def run_samplers(args, levels: list[int]) -> dict:
    from t1async.sampler.client import SGLangClient
    from t1async.sampler.launch import launch_sampler
    from t1async.sampler.pool import PoolConfig

    runs = []
    for n in levels:
        async with AsyncExitStack() as stack:
            urls = [
                await stack.enter_async_context(
                    launch_sampler(args.model, dtype=args.dtype, max_batch=args.max_batch, seed=args.seed)
                )
                for _ in range(n)
            ]
            async with SGLangClient(urls, pool=PoolConfig(load_cap=args.load_cap)) as c:
                info = await c.model_info()
                vocab = args.vocab_size or int(info.get("vocab_size") or 1000)
                for u in urls:  # warm-up, not measured: the first request of a process pays for allocations
                    resp = await c.post_once(
                        u, "/generate", {"input_ids": list(range(16, 80)), "sampling_params": {"max_new_tokens": 8}}
                    )
                    resp.raise_for_status()
                for pinned in (True, False) if n > 1 else (True,):
                    await c.flush_cache()
                    r = await _sessions(
                        c,
                        pinned=pinned,
                        sessions=args.num_prompts or 8,
                        turns=args.multi_turn or 4,
                        prompt_len=args.prompt_len or args.input_len,
                        input_len=args.input_len,
                        output_len=args.output_len,
                        vocab=vocab,
                        seed=args.seed,
                        temperature=args.temperature,
                    )
                    runs.append({"samplers": n, **r})
                    print(
                        f"  {n} sampler(s), {'pinned' if pinned else 'unpinned'}: cached_ratio "
                        f"{r['cached_ratio']:.3f}, {r['output_throughput']:.1f} out tok/s",
                        flush=True,
                    )
    print_grid(
        ["samplers", "pinned", "cached_ratio", "out_tok/s", "turns/s", "turns_per_sampler"],
        [
            [
                x["samplers"],
                x["pinned"],
                x["cached_ratio"],
                x["output_throughput"],
                x["turns_per_s"],
                str(x["turns_per_sampler"]),
            ]
            for x in runs
        ],
    )
    return {
        "samplers": levels,
        "runs": runs,
        "completed": sum(x["turns"] for x in runs),
        "load_cap": args.load_cap,
        "sessions": args.num_prompts or 8,
        "turns": args.multi_turn or 4,
    }
