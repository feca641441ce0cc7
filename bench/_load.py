"""The load that ``python -m bench.sampler`` puts on a sampler, and what it measures: streaming
``/generate`` requests (TTFT and ITL at the client), open-loop load at a request rate and a concurrency, and
multi-turn sessions whose context grows each turn. ``summarize`` reports in bench_serving's field names."""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field

import anyio
import httpx
import numpy as np

from bench._common import Progress, stats_ms


@dataclass
class Outcome:
    prompt_len: int
    ok: bool = False
    error: str = ""
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0


async def stream_generate(
    client: httpx.AsyncClient,
    url: str,
    ids: list[int],
    output_len: int,
    temperature: float,
    stream: bool = True,
    engine: str = "sglang",
) -> Outcome:
    """One streaming /generate; TTFT at the first chunk carrying tokens, ITL between token-carrying chunks.
    With ``stream=False`` one plain POST, and TTFT = latency (as bench_serving's --disable-stream).
    ``engine="vllm"``: vLLM's ``/inference/v1/generate`` (delta chunks of token ids) instead of SGLang's."""
    if engine == "vllm":
        return await _vllm_generate(client, url, ids, output_len, temperature, stream)
    body = {
        "input_ids": ids,
        "stream": stream,
        "sampling_params": {"max_new_tokens": output_len, "temperature": temperature, "ignore_eos": True},
    }
    out = Outcome(prompt_len=len(ids))
    t0 = last = time.perf_counter()
    seen = 0
    if not stream:
        return await _plain_generate(client, url, body, out, t0)
    try:
        async with client.stream("POST", url + "/generate", json=body) as resp:
            if resp.status_code != 200:
                out.error = f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}"
                return out
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    out.error = str(chunk["error"])
                    return out
                meta = chunk.get("meta_info", {})
                n = int(meta.get("completion_tokens", len(chunk.get("output_ids", []))))
                now = time.perf_counter()
                if n > seen:
                    if seen == 0:
                        out.ttft = now - t0
                    else:
                        out.itl.append(now - last)
                    last, seen = now, n
                ids_now = chunk.get("output_ids") or []
                out.output_ids = list(ids_now) if len(ids_now) == n else out.output_ids + list(ids_now)
                out.prompt_tokens = int(meta.get("prompt_tokens", len(ids)))
                out.cached_tokens = int(meta.get("cached_tokens", 0) or 0)
    except httpx.HTTPError as exc:
        out.error = f"{type(exc).__name__}: {exc}"
        return out
    out.latency = time.perf_counter() - t0
    out.ok = seen > 0
    if not out.ok:
        out.error = "no tokens returned"
    return out


async def _vllm_generate(
    client: httpx.AsyncClient, url: str, ids: list[int], output_len: int, temperature: float, stream: bool
) -> Outcome:
    """vLLM's token-in/token-out generate: streamed, each SSE chunk carries the new token ids (``DELTA``)."""
    sp = {"max_tokens": output_len, "temperature": temperature, "ignore_eos": True, "detokenize": False}
    body = {"token_ids": ids, "stream": stream, "sampling_params": sp}
    out = Outcome(prompt_len=len(ids))
    t0 = last = time.perf_counter()
    path = url + "/inference/v1/generate"
    try:
        if not stream:
            resp = await client.post(path, json=body)
            if resp.status_code != 200:
                out.error = f"HTTP {resp.status_code}: {resp.text[:300]!r}"
                return out
            out.output_ids = list(resp.json()["choices"][0].get("token_ids") or [])
            out.latency = out.ttft = time.perf_counter() - t0
        else:
            async with client.stream("POST", path, json=body) as resp:
                if resp.status_code != 200:
                    out.error = f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}"
                    return out
                async for line in resp.aiter_lines():
                    if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                        continue
                    chunk = json.loads(line[5:])
                    if "error" in chunk:
                        out.error = str(chunk["error"])
                        return out
                    delta = (chunk.get("choices") or [{}])[0].get("token_ids") or []
                    now = time.perf_counter()
                    if delta:
                        if not out.output_ids:
                            out.ttft = now - t0
                        else:
                            out.itl.append(now - last)
                        last = now
                        out.output_ids += list(delta)
            out.latency = time.perf_counter() - t0
    except httpx.HTTPError as exc:
        out.error = f"{type(exc).__name__}: {exc}"
        return out
    out.prompt_tokens = len(ids)
    out.ok = bool(out.output_ids)
    out.error = "" if out.ok else "no tokens returned"
    return out


async def _plain_generate(client: httpx.AsyncClient, url: str, body: dict, out: Outcome, t0: float) -> Outcome:
    try:
        resp = await client.post(url + "/generate", json=body)
    except httpx.HTTPError as exc:
        out.error = f"{type(exc).__name__}: {exc}"
        return out
    if resp.status_code != 200:
        out.error = f"HTTP {resp.status_code}: {resp.text[:300]!r}"
        return out
    r = resp.json()
    out.latency = out.ttft = time.perf_counter() - t0
    out.output_ids = list(r.get("output_ids") or [])
    out.prompt_tokens = int(r["meta_info"].get("prompt_tokens", out.prompt_len))
    out.cached_tokens = int(r["meta_info"].get("cached_tokens", 0) or 0)
    out.ok = bool(out.output_ids)
    out.error = "" if out.ok else "no tokens returned"
    return out


def summarize(
    outcomes: list[Outcome], duration: float, *, concurrency: int, request_rate: float, input_len: int, output_len: int
) -> dict:
    ok = [o for o in outcomes if o.ok]
    tin = sum(o.prompt_len for o in ok)
    tout = sum(len(o.output_ids) for o in ok)
    tpot = [(o.latency - o.ttft) / (len(o.output_ids) - 1) for o in ok if len(o.output_ids) > 1]
    d = max(duration, 1e-9)
    r = {
        "backend": "sglang",
        "dataset_name": "random",
        "request_rate": request_rate,
        "max_concurrency": concurrency,
        "random_input_len": input_len,
        "random_output_len": output_len,
        "duration": duration,
        "completed": len(ok),
        "failed": len(outcomes) - len(ok),
        "total_input_tokens": tin,
        "total_output_tokens": tout,
        "request_throughput": len(ok) / d,
        "input_throughput": tin / d,
        "output_throughput": tout / d,
        "total_throughput": (tin + tout) / d,
        **stats_ms([o.latency for o in ok], "e2e_latency"),
        **stats_ms([o.ttft for o in ok], "ttft"),
        **stats_ms(tpot, "tpot"),
        **stats_ms([x for o in ok for x in o.itl], "itl", pcts=(95, 99)),
        "concurrency": sum(o.latency for o in ok) / d,
    }
    errors = [o.error for o in outcomes if not o.ok]
    if errors:
        r["first_error"] = errors[0]
    return r


def random_ids(rng: np.random.Generator, n: int, vocab: int) -> list[int]:
    return rng.integers(min(16, vocab - 1), vocab, size=n).tolist()


async def run_load(
    client: httpx.AsyncClient,
    url: str,
    *,
    num_prompts: int,
    concurrency: int,
    request_rate: float,
    input_len: int,
    output_len: int,
    vocab: int,
    seed: int,
    temperature: float,
    stream: bool = True,
    label: str = "",
    engine: str = "sglang",
) -> dict:
    rng = np.random.default_rng(seed)
    prompts = [random_ids(rng, input_len, vocab) for _ in range(num_prompts)]
    limiter = anyio.CapacityLimiter(concurrency)
    outcomes: list[Outcome] = []
    bar = Progress(num_prompts, label or f"c={concurrency}")

    async def one(ids: list[int]) -> None:
        async with limiter:
            outcomes.append(await stream_generate(client, url, ids, output_len, temperature, stream, engine))
        bar.advance()

    t0 = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for ids in prompts:
            tg.start_soon(one, ids)
            if math.isfinite(request_rate):
                await anyio.sleep(rng.exponential(1.0 / request_rate))
    bar.close()
    return summarize(
        outcomes,
        time.perf_counter() - t0,
        concurrency=concurrency,
        request_rate=request_rate,
        input_len=input_len,
        output_len=output_len,
    )


async def run_multi_turn(
    client: httpx.AsyncClient,
    url: str,
    *,
    sessions: int,
    turns: int,
    concurrency: int,
    input_len: int,
    output_len: int,
    vocab: int,
    seed: int,
    temperature: float,
    stream: bool = True,
    prompt_len: int | None = None,
    engine: str = "sglang",
) -> dict:
    rng = np.random.default_rng(seed)
    per_turn: list[list[Outcome]] = [[] for _ in range(turns)]
    limiter = anyio.CapacityLimiter(concurrency)
    bar = Progress(sessions * turns, "multi-turn")

    async def session(s: int) -> None:
        ctx = random_ids(np.random.default_rng([seed, s]), prompt_len or input_len, vocab)
        for t in range(turns):
            async with limiter:
                o = await stream_generate(client, url, ctx, output_len, temperature, stream, engine)
            per_turn[t].append(o)
            bar.advance()
            if not o.ok:
                return
            ctx = ctx + o.output_ids + random_ids(rng, input_len, vocab)

    t0 = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for s in range(sessions):
            tg.start_soon(session, s)
    bar.close()
    duration = time.perf_counter() - t0
    everything = [o for turn in per_turn for o in turn]
    r = summarize(
        everything, duration, concurrency=concurrency, request_rate=math.inf, input_len=input_len, output_len=output_len
    )
    rows = []
    for t, outs in enumerate(per_turn):
        ok = [o for o in outs if o.ok]
        if not ok:
            continue
        prompt = sum(o.prompt_tokens for o in ok)
        rows.append(
            {
                "turn": t + 1,
                "completed": len(ok),
                "mean_context_len": prompt / len(ok),
                "mean_e2e_latency_ms": 1000 * float(np.mean([o.latency for o in ok])),
                "mean_ttft_ms": 1000 * float(np.mean([o.ttft for o in ok])),
                "cached_ratio": sum(o.cached_tokens for o in ok) / max(prompt, 1),
            }
        )
    later = [o for turn in per_turn[1:] for o in turn if o.ok]
    r.update(
        multi_turn=turns,
        sessions=sessions,
        per_turn=rows,
        cached_ratio=sum(o.cached_tokens for o in later) / max(sum(o.prompt_tokens for o in later), 1),
    )
    return r
