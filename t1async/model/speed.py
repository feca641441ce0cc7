"""Measure the engine's decode speed at several batch sizes (a quick check, not a bench table).

    python -m t1async.model.speed [--model DIR] [--batch 1 32] [--prompt 128] [--new 128] [--repeat 3]

For each batch size B, B concurrent requests with a ``--prompt``-token prompt each generate ``--new``
tokens (ignore_eos, temperature 1). Reports output tokens per second over the whole run (prefill included)
and over the decode steps only, with the model's default directory unless ``--model`` is given. The batch
sizes are measured in interleaved rounds (``--repeat``), each round with fresh random prompts (no prefix
cache hits), after a warm-up at the largest batch; the table shows each batch size's median round, and
the last line the ratio of the last batch size's throughput to the first's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import anyio
import numpy as np

from t1async.model.engine import Engine
from t1async.model.records import EngineConfig, GenRequest
from t1async.model.weights import default_model_dir

KEYS = ("tokens_per_s", "decode_tokens_per_s", "step_ms", "wall_s")


async def measure(engine: Engine, batch: int, prompt: int, new: int, tag: str, seed: int = 0) -> dict:
    rng = np.random.default_rng([batch, seed])
    first: dict[int, float] = {}
    last: dict[int, float] = {}

    async def one(i: int) -> None:
        ids = tuple(int(x) for x in rng.integers(3, engine.model_cfg.vocab_size, prompt))
        r = GenRequest(rid=f"{tag}-{i}", input_ids=ids, max_new_tokens=new, ignore_eos=True, seed=i)
        async with engine.submit(r) as events:
            async for _ in events:
                first.setdefault(i, time.perf_counter())
        last[i] = time.perf_counter()

    t0 = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for i in range(batch):
            tg.start_soon(one, i)
    t1 = time.perf_counter()
    decode_s = max(last.values()) - max(first.values())
    return {
        "batch": batch,
        "tokens_per_s": batch * new / (t1 - t0),
        "decode_tokens_per_s": batch * (new - 1) / decode_s if decode_s > 0 else float("nan"),
        "step_ms": 1000 * decode_s / max(1, new - 1),
        "wall_s": t1 - t0,
    }


async def main_async(a: argparse.Namespace) -> list[dict]:
    engine = Engine(a.model or default_model_dir(), EngineConfig(max_batch=max(a.batch), dtype=a.dtype))
    rounds: dict[int, list[dict]] = {b: [] for b in a.batch}
    async with anyio.create_task_group() as tg:
        await tg.start(engine.run)
        await measure(engine, max(a.batch), a.prompt, 4, "warmup")  # sizes the KV slab as the runs need it
        for r in range(a.repeat):
            for b in a.batch:
                rounds[b].append(await measure(engine, b, a.prompt, a.new, f"b{b}r{r}", seed=r + 1))
        tg.cancel_scope.cancel()
    return [{"batch": b, **{k: statistics.median(x[k] for x in rounds[b]) for k in KEYS}} for b in a.batch]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m t1async.model.speed", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model directory (default: the shipped tiny model)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32], help="batch sizes (default 1 32)")
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens per request (default 128)")
    ap.add_argument("--new", type=int, default=128, help="new tokens per request (default 128)")
    ap.add_argument("--repeat", type=int, default=3, help="interleaved rounds; the median is shown (default 3)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--json", action="store_true", help="also print the rows as JSON on the last line")
    a = ap.parse_args(argv)
    if a.repeat < 1 or a.new < 2 or a.prompt < 1 or min(a.batch) < 1:
        ap.error("--repeat, --prompt and --batch must be >= 1 and --new >= 2")
    rows = anyio.run(main_async, a, backend="trio")
    print(f"{'batch':>5} {'tok/s':>10} {'decode tok/s':>13} {'step ms':>8} {'wall s':>7}")
    for r in rows:
        print(
            f"{r['batch']:>5} {r['tokens_per_s']:>10.1f} {r['decode_tokens_per_s']:>13.1f} "
            f"{r['step_ms']:>8.2f} {r['wall_s']:>7.2f}"
        )
    ratio = rows[-1]["tokens_per_s"] / rows[0]["tokens_per_s"]
    decode_ratio = rows[-1]["decode_tokens_per_s"] / rows[0]["decode_tokens_per_s"]
    print(
        f"batch {rows[-1]['batch']} vs {rows[0]['batch']}: {ratio:.2f}x tokens/s, {decode_ratio:.2f}x decode tokens/s"
    )
    if a.json:
        print(json.dumps({"rows": rows, "ratio": ratio, "decode_ratio": decode_ratio}))


if __name__ == "__main__":
    main()
