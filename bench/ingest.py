"""Ingest throughput: wire bytes -> TurnRecord -> drift check and repair -> routing alignment -> Segments.

Measures, on one core and in one run, t1async's vectorised path (``wire.decode`` + ``Assembler``) and a
per-token Python implementation of the same logic (``LoopAssembler`` below), asserts that both produce the
same segments, and reports tokens per second (input delta + output tokens of every turn record) and wire
bytes per second for each.

The comparison is meant to be fair: the loop decodes every array with ``np.frombuffer`` (no element-wise
unpacking), checks ids and all-zero routing layers with numpy, and hashes arrays as bytes; what it does one
token at a time is the drift check's longest common prefix and building the segment. Both sides are warmed
and timed best of ``--repeat`` (process CPU time), on the same records.

    python -m bench.ingest [--json] [--turns 300] [--layers 8] [--topk 8] [--experts 128]
"""

from __future__ import annotations

import os

for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):  # before numpy: one core
    os.environ[_v] = "1"

import argparse  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import msgpack  # noqa: E402
import numpy as np  # noqa: E402

from t1async.ingest.assembly import Assembler  # noqa: E402
from t1async.protocol import wire  # noqa: E402
from t1async.testing.episodes import REALISTIC, make_episode  # noqa: E402

# ------------------------------------------------------------------------------------------ the loop version


def _ids(m: dict) -> list[int]:
    vals = np.frombuffer(m["data"], "<i4")
    if len(vals) and vals.min() < 0:
        raise ValueError("negative token id")
    return vals.tolist()


def _pack(ids) -> bytes:
    return np.asarray(ids, "<i4").tobytes()


class LoopAssembler:
    """The same assembly, one token (and one routing entry) at a time, in-order delivery with redeliveries."""

    def __init__(self) -> None:
        self.eps: dict[str, dict] = {}
        self.segments: list[dict] = []

    def _new(self, ep: dict) -> dict:
        return {
            "tokens": [],
            "loss": [],
            "lps": [],
            "ver": [],
            "tid": [],
            "routes": [],
            "spans": [],
            "covered": 0,
            "h": hashlib.sha256(),
            "index": ep["index"],
        }

    def _emit(self, ep_name: str, ep: dict, seg: dict, done: bool) -> None:
        if seg["spans"]:
            self.segments.append({"episode": ep_name, "index": ep["index"], "done": done, **seg})
            ep["index"] += 1

    def feed(self, data: bytes) -> None:
        m = msgpack.unpackb(data, raw=False)
        name = m["episode"]
        if m["kind"] == "end":
            ep = self.eps.pop(name)
            self._emit(name, ep, ep["seg"], True)
            return
        ep = self.eps.setdefault(name, {"next": 0, "index": 0, "seg": None})
        if m["turn"] < ep["next"]:
            return  # redelivery
        ep["next"] += 1
        delta, out = _ids(m["input_delta"]), _ids(m["output_ids"])
        lps = np.frombuffer(m["output_logprobs"]["data"], "<f4").tolist()
        keep, seg = m["keep"], ep["seg"]
        prev = seg["tokens"] if seg else []
        n = len(prev)
        h = seg["h"].copy() if seg and keep == n else hashlib.sha256()
        if keep < n:
            h.update(_pack(prev[:keep]))
        h.update(_pack(delta))
        assert h.digest()[:16] == m["input_digest"]
        lcp = keep
        while lcp < n and lcp - keep < len(delta) and delta[lcp - keep] == prev[lcp]:
            lcp += 1
        if seg is None:
            seg = ep["seg"] = self._new(ep)
        elif lcp < n and lcp < seg["spans"][-1][1]:  # FORK
            old = seg
            seg = self._new(ep)
            for p in range(lcp):
                seg["tokens"].append(old["tokens"][p])
                seg["loss"].append(False)
                seg["lps"].append(0.0)
                seg["ver"].append(-1)
                seg["tid"].append(old["tid"][p])
                seg["routes"].append(old["routes"][p])
            seg["covered"] = min(old["covered"], lcp)
            self._emit(name, ep, old, False)
            seg["index"] = ep["index"]
            ep["seg"] = seg
        elif lcp < n:  # REALIGN
            for key in ("tokens", "loss", "lps", "ver", "tid", "routes"):
                del seg[key][lcp:]
            last = seg["spans"][-1]
            last[2] = max(last[1], lcp)
            if last[2] == last[1]:
                seg["spans"].pop()
            seg["covered"] = min(seg["covered"], lcp)
        for t in delta[len(seg["tokens"]) - keep :]:
            seg["tokens"].append(t)
            seg["loss"].append(False)
            seg["lps"].append(0.0)
            seg["ver"].append(-1)
            seg["tid"].append(-1)
            seg["routes"].append(None)
        start_out = len(seg["tokens"])
        for t, lp in zip(out, lps):
            seg["tokens"].append(t)
            seg["loss"].append(True)
            seg["lps"].append(lp)
            seg["ver"].append(m["policy_version"])
            seg["tid"].append(m["turn"])
            seg["routes"].append(None)
        seg["spans"].append([m["turn"], start_out, len(seg["tokens"]), m["reward"]])
        h.update(_pack(out))
        seg["h"] = h
        self._routing(seg, m["routing"], m["input_len"], len(out))

    def _routing(self, seg: dict, rm: dict, input_len: int, n_out: int) -> None:
        rows, layers, topk = rm["shape"]
        start, end = rm["start"], input_len + n_out - 1
        assert rows == end - start, "row count"
        raw = np.frombuffer(rm["data"], np.uint8 if rm["dtype"] == "u1" else "<u2").reshape(rows, layers, topk)
        ex = raw.astype(np.int16)
        if rows and (topk >= 2 or rows >= 32):  # a layer whose every entry is 0 is a broken capture
            ex[:, ~raw.any(axis=(0, 2))] = -1
        flat = ex.reshape(rows, layers * topk)
        for r in range(rows):
            seg["routes"][start + r] = flat[r]
        seg["covered"] = end


def _loop_segments_equal(loop: list[dict], segs: list) -> None:
    assert len(loop) == len(segs), (len(loop), len(segs))
    for a, b in zip(loop, segs):
        assert (a["episode"], a["index"], a["done"]) == (b.episode, b.index, b.done)
        assert a["tokens"] == b.tokens.tolist() and a["loss"] == b.loss_mask.tolist()
        assert np.array_equal(np.array(a["lps"], np.float32), b.logprobs) and a["ver"] == b.versions.tolist()
        assert a["tid"] == b.turn_ids.tolist()
        layers, topk = b.routing.shape[1:]
        want = np.array([r if r is not None else np.full(layers * topk, -1) for r in a["routes"]], np.int16)
        assert np.array_equal(want.reshape(b.routing.shape), b.routing)
        assert [s[2] - 1 for s in a["spans"]] == b.turn_ends.tolist()


# ------------------------------------------------------------------------------------------ bench


def build_payloads(
    turns: int, layers: int, topk: int, experts: int, seed: int, realign: float = 0.03, fork: float = 0.01
) -> tuple[list[bytes], int]:
    rng = np.random.default_rng(seed)
    payloads, tokens, e = [], 0, 0
    while turns > 0:
        n = min(turns, 300)
        kinds = list(rng.choice(["clean", "realign", "fork"], p=[1 - realign - fork, realign, fork], size=n - 1))
        case = make_episode(
            rng,
            kinds,
            episode=f"bench{e}",
            sizes=REALISTIC,
            layers=layers,
            topk=topk,
            num_experts=experts,
            fork_window=64,
            duplicate=0.02,
        )
        for r in case.records:
            payloads.append(wire.encode(r))
            if isinstance(r, wire.TurnRecord):
                tokens += len(r.input_delta) + len(r.output_ids)
        turns -= n
        e += 1
    return payloads, tokens


def run_vectorised(payloads: list[bytes]) -> tuple[float, list, Assembler]:
    asm = Assembler()
    segs = []
    t0 = time.process_time()
    for p in payloads:
        segs += asm.feed(wire.decode(p))
    return time.process_time() - t0, segs, asm


def run_loop(payloads: list[bytes]) -> tuple[float, LoopAssembler]:
    loop = LoopAssembler()
    t0 = time.process_time()
    for p in payloads:
        loop.feed(p)
    return time.process_time() - t0, loop


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.ingest", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last stdout line")
    ap.add_argument("--turns", type=int, default=300, help="turns to ingest (episodes of up to 300 turns)")
    ap.add_argument("--layers", type=int, default=8, help="MoE layers in the routing traces")
    ap.add_argument("--topk", type=int, default=8, help="experts per token per layer")
    ap.add_argument("--experts", type=int, default=128, help="experts per layer (<= 256: u1 traces)")
    ap.add_argument("--loop-turns", type=int, default=0, help="turns the loop version runs over (0: all)")
    ap.add_argument(
        "--repeat", type=int, default=3, help="timed runs of each side after a warm-up; the best is reported"
    )
    ap.add_argument("--realign-rate", type=float, default=0.03, help="share of boundaries that are REALIGN")
    ap.add_argument("--fork-rate", type=float, default=0.01, help="share of boundaries that are FORK")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.turns < 1 or args.repeat < 1 or args.loop_turns < 0:
        ap.error("--turns and --repeat must be >= 1, --loop-turns >= 0")
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    mix = (args.realign_rate, args.fork_rate)
    payloads, tokens = build_payloads(args.turns, args.layers, args.topk, args.experts, args.seed, *mix)
    nbytes = sum(map(len, payloads))
    run_vectorised(payloads)  # warm-up: the first run also pays the kernel for fresh pages
    vec_s = min(run_vectorised(payloads)[0] for _ in range(args.repeat))
    # the loop version over the same records (or a prefix of the stream), checked segment by segment
    lt = args.loop_turns or args.turns
    small, small_tokens = (
        (payloads, tokens)
        if lt >= args.turns
        else build_payloads(lt, args.layers, args.topk, args.experts, args.seed, *mix)
    )
    small_bytes = sum(map(len, small))
    _, loop = run_loop(small)  # warm-up, and the output to check
    _, segs, _ = run_vectorised(small)
    _loop_segments_equal(loop.segments, segs)
    loop_s = min(run_loop(small)[0] for _ in range(args.repeat))
    vec_small_s = vec_s if small is payloads else min(run_vectorised(small)[0] for _ in range(args.repeat))
    tps, loop_tps = tokens / vec_s, small_tokens / loop_s
    speedup = (small_tokens / vec_small_s) / loop_tps
    _, _, asm = run_vectorised(payloads)
    d = asm.stats()
    rows = [
        ("turn records", f"{d.turns:,}", f"{len(payloads):,} messages (with redeliveries and ends)"),
        ("tokens (input delta + output)", f"{tokens:,}", f"{nbytes / 1e6:,.1f} MB on the wire"),
        ("routing", f"[tokens, {args.layers}, {args.topk}]", f"{args.experts} experts"),
        ("drift clean/realign/fork", f"{d.clean}/{d.realign}/{d.fork}", f"{d.tokens_dropped:,} dropped"),
        (
            "vectorised tokens/s",
            f"{tps / 1e6:,.2f} M",
            f"{nbytes / vec_s / 1e6:,.0f} MB/s; best of {args.repeat}: {vec_s * 1e3:,.0f} ms for {args.turns} turns",
        ),
        (
            "per-token loop tokens/s",
            f"{loop_tps / 1e6:,.3f} M",
            f"{small_bytes / loop_s / 1e6:,.0f} MB/s; best of {args.repeat}: {loop_s * 1e3:,.0f} ms for "
            f"{len(small)} records",
        ),
        ("speedup (same records)", f"{speedup:,.1f}x", "outputs checked equal"),
    ]
    w = max(len(r[0]) for r in rows)
    print("bench.ingest: decode + drift check/repair + routing alignment, one core (process CPU time, warmed,")
    print("best of N); the loop decodes arrays with np.frombuffer and walks tokens one at a time\n")
    for a, b, c in rows:
        print(f"  {a:<{w}}  {b:>16}  {c}")
    if args.json:
        print(
            json.dumps(
                {
                    "tokens_per_s": round(tps),
                    "loop_tokens_per_s": round(loop_tps),
                    "bytes_per_s": round(nbytes / vec_s),
                    "loop_bytes_per_s": round(small_bytes / loop_s),
                    "speedup": round(speedup, 2),
                    "tokens": tokens,
                    "bytes": nbytes,
                    "turns": args.turns,
                    "repeat": args.repeat,
                    "layers": args.layers,
                    "topk": args.topk,
                }
            )
        )


if __name__ == "__main__":
    main()
