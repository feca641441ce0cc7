"""bench.transport: the t1async NATS transport under trio vs raw nats-py JetStream under asyncio.

    python -m bench.transport [--records N] [--window W] [--rounds R] [--json]

One embedded nats-server (JetStream, file store, max_payload large enough for one turn, or the 1 MB
default with ``--chunked``), one stream (T1_TRAJ). Each round publishes the same realistic turn records
both ways, alternating which side goes first, purging the stream before each side:

- t1: ``NatsTransport.publish`` from W concurrent trio tasks (so W publishes are in flight), which
  includes ``wire.encode`` of every record and awaiting every JetStream ack;
- raw: the same encoded bytes through ``js.publish_async`` under plain asyncio with at most W acks
  pending, then ``publish_async_completed()``, every ack checked.

Both set ``Nats-Msg-Id``. Reported: records/s and MB/s (payload bytes, 1 MB = 1e6 B) per side (median of
rounds), and ratio = t1 / raw. ``--json`` prints {t1_mb_per_s, raw_mb_per_s, ratio, records, ...} last.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time

import anyio
import nats
import numpy as np

from bench._common import emit_json, print_grid
from t1async.log import configure
from t1async.protocol import wire
from t1async.transport import TRAJ_STREAM, NatsConfig, NatsTransport, chunking
from t1async.transport.natsd import NatsServer


def make_records(
    n: int, *, output_tokens: int, delta: int, layers: int, topk: int, seed: int = 0
) -> list[wire.TurnRecord]:
    """Turns like an actor's: a few hundred new input tokens, ``output_tokens`` sampled, routing for both."""
    rng = np.random.default_rng(seed)
    out = rng.integers(0, 50_000, size=output_tokens, dtype=np.int32)
    lps = -rng.random(output_tokens, dtype=np.float32)
    dlt = rng.integers(0, 50_000, size=delta, dtype=np.int32)
    records = []
    for i in range(n):
        keep = 1000 + i
        rows = delta + output_tokens  # routing covers [keep - 1, keep + delta + output - 1)
        routing = wire.Routing(keep - 1, rng.integers(0, 64, size=(rows, layers, topk), dtype=np.uint8))
        records.append(
            wire.TurnRecord(
                episode=f"bench-{i % 16}",
                turn=i,
                policy_version=1,
                keep=keep,
                input_delta=dlt,
                input_len=keep + delta,
                input_digest=wire.digest_ids(dlt),
                output_ids=out,
                output_logprobs=lps,
                finish=wire.Finish.STOP,
                routing=routing,
                reward=0.0,
                tests_passed=-1,
                t_sample_s=0.5,
                t_exec_s=0.1,
                action="ls",
                observation="x",
            )
        )
    return records


async def t1_round(url: str, records: list[wire.TurnRecord], window: int, tag: str) -> float:
    async with NatsTransport(config=NatsConfig(url=url)) as t:
        await t.publish("t1.traj.warmup", records[0], msg_id=f"{tag}/warmup")
        todo = iter(enumerate(records))

        async def worker() -> None:
            for i, rec in todo:
                await t.publish(f"t1.traj.{rec.episode}", rec, msg_id=f"{tag}/{i}")

        t0 = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for _ in range(window):
                tg.start_soon(worker)
        dt = time.perf_counter() - t0
        if t.stats.published != len(records) + 1:
            raise RuntimeError(f"t1 published {t.stats.published - 1} of {len(records)}")
        return dt


async def raw_round(url: str, payloads: list[tuple[str, bytes]], window: int, tag: str, max_payload: int) -> float:
    """Records larger than max_payload go as the same chunks t1 sends (split before the clock starts)."""
    pieces = [
        (s, h, d) for i, (s, data) in enumerate(payloads) for h, d in chunking.split(data, f"{tag}/{i}", max_payload)
    ]
    nc = await nats.connect(url)
    try:
        js = nc.jetstream(publish_async_max_pending=window)
        await js.publish("t1.traj.warmup", pieces[0][2], headers={"Nats-Msg-Id": f"{tag}/warmup"})
        t0 = time.perf_counter()
        futs = [await js.publish_async(s, d, headers=h) for s, h, d in pieces]
        await js.publish_async_completed()
        dt = time.perf_counter() - t0
        errors = [f.exception() for f in futs if f.cancelled() or f.exception() is not None]
        if errors:
            raise RuntimeError(f"raw: {len(errors)} publishes failed, first: {errors[0]!r}")
        return dt
    finally:
        await nc.close()


async def purge(url: str) -> None:
    nc = await nats.connect(url)
    try:
        await nc.jetstream().purge_stream(TRAJ_STREAM)
    finally:
        await nc.close()


async def run(args: argparse.Namespace) -> dict:
    records = make_records(
        args.records, output_tokens=args.output_tokens, delta=args.delta, layers=args.layers, topk=args.topk
    )
    payloads = [(f"t1.traj.{r.episode}", wire.encode(r)) for r in records]
    total_mb = sum(len(d) for _, d in payloads) / 1e6
    max_payload = (1 << 20) if args.chunked else max(1 << 20, 2 * max(len(d) for _, d in payloads))
    with tempfile.TemporaryDirectory(prefix="bench-transport-") as store:
        async with NatsServer.start(store, max_payload=max_payload) as srv:
            async with NatsTransport(srv.url):  # creates the stream both sides publish into
                pass
            t1_s, raw_s = [], []
            for r in range(args.rounds):
                for side in ("raw", "t1") if r % 2 == 0 else ("t1", "raw"):
                    await anyio.to_thread.run_sync(asyncio.run, purge(srv.url))
                    if side == "t1":
                        t1_s.append(await t1_round(srv.url, records, args.window, f"t1-{r}"))
                    else:
                        raw_s.append(
                            await anyio.to_thread.run_sync(
                                asyncio.run, raw_round(srv.url, payloads, args.window, f"raw-{r}", max_payload)
                            )
                        )
    t1_mb, raw_mb = total_mb / statistics.median(t1_s), total_mb / statistics.median(raw_s)
    return {
        "t1_mb_per_s": round(t1_mb, 2),
        "raw_mb_per_s": round(raw_mb, 2),
        "ratio": round(t1_mb / raw_mb, 3),
        "records": args.records,
        "record_bytes": len(payloads[0][1]),
        "window": args.window,
        "rounds": args.rounds,
        "chunked": max(len(d) for _, d in payloads) > chunking.chunk_size(max_payload, "raw-0/0"),
        "t1_records_per_s": round(args.records / statistics.median(t1_s), 1),
        "raw_records_per_s": round(args.records / statistics.median(raw_s), 1),
        "t1_round_s": [round(x, 3) for x in t1_s],
        "raw_round_s": [round(x, 3) for x in raw_s],
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m bench.transport", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--records", type=int, default=300, help="turn records per side per round (default 300)")
    p.add_argument("--window", type=int, default=64, help="publishes in flight on each side (default 64)")
    p.add_argument("--rounds", type=int, default=3, help="rounds; each side's median is reported (default 3)")
    p.add_argument("--output-tokens", type=int, default=2000, help="sampled tokens per turn (default 2000)")
    p.add_argument("--delta", type=int, default=300, help="new input tokens per turn (default 300)")
    p.add_argument("--layers", type=int, default=48, help="MoE layers in the routing trace (default 48)")
    p.add_argument("--topk", type=int, default=8, help="experts per token in the routing trace (default 8)")
    p.add_argument(
        "--chunked",
        action="store_true",
        help="keep the server's 1 MB max_payload: records larger than that are chunked (both sides)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object as the last stdout line")
    args = p.parse_args(argv)
    if args.records < 1 or args.window < 1 or args.rounds < 1:
        p.error("--records, --window and --rounds must be >= 1")
    configure(level="warning")
    res = anyio.run(run, args, backend="trio")
    print_grid(
        ["side", "records/s", "MB/s", "rounds (s)"],
        [
            ["t1 (trio)", res["t1_records_per_s"], res["t1_mb_per_s"], " ".join(map(str, res["t1_round_s"]))],
            ["raw (asyncio)", res["raw_records_per_s"], res["raw_mb_per_s"], " ".join(map(str, res["raw_round_s"]))],
        ],
        title=f"bench.transport: {res['records']} records of {res['record_bytes'] / 1e6:.2f} MB, "
        f"window {res['window']}",
    )
    print(f"ratio t1/raw = {res['ratio']:.3f} (target >= 0.8)", flush=True)
    if args.json:
        emit_json(res)


if __name__ == "__main__":
    main()
