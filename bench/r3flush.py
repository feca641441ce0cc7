"""``python -m bench.r3flush``: R3 across weight updates, the sampler's logprobs against the learner's replay.

Every turn of ``--episodes`` episodes is sampled by the real engine (the shipped model, fp32, prefix cache on)
after a weight update (the weights perturbed by ``--noise`` of each tensor's std), as a learner pushing a new
version between turns does. Each update flushes the prefix cache, so the sampler re-routes every turn's
context with the new weights. The turns are streamed as an actor encodes them and assembled by the learner's
``Assembler``; every loss token is then replayed (full forward with the recorded routing) with the weights
that sampled it, and compared with its sampled logprob, two ways:

- ``exact``: what the sampler returns now, every row it recomputed (from 0 after a flush), and the learner's
  route forks: each turn is replayed with the routes the sampler used for it;
- ``old``: rows only from ``routed_experts_start_len`` (what the sampler returned before), so the learner
  replays the context with routes recorded under older weights.

Same engine run, same tokens: only the routing rows given to the learner differ. fp32 on both sides, so
``exact`` should be ~1e-7 (the reordering of float sums), and anything above is a replay that is not exact.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
import torch
import trio

from actors.records import TurnEncoder
from bench._common import emit_json, print_grid
from sandbox_agent.agent.types import TurnResult
from t1async.ingest.assembly import Assembler
from t1async.model.engine import Engine
from t1async.model.modeldir import check_model_dir
from t1async.model.records import EngineConfig, GenRequest
from t1async.model.tokenizer import ChatTokenizer
from t1async.model.weights import default_model_dir, load_pretrained, save_pretrained
from t1async.protocol import wire
from t1async.protocol.errors import ConfigError

NEW_TOKENS = 24


def versions_of_weights(n: int, noise: float, out: Path, tok: ChatTokenizer, base: Path) -> list[Path]:
    """``n`` policy versions: the ``base`` model, then each the previous one plus relative Gaussian noise."""
    g = torch.Generator().manual_seed(0)
    m = load_pretrained(base)
    dirs = []
    for v in range(n):
        if v:
            with torch.no_grad():
                for p in m.parameters():
                    p.add_(torch.randn(p.shape, generator=g) * noise * (float(p.std()) if p.numel() > 1 else 1.0))
        dirs.append(save_pretrained(m, out / f"w{v}", tok))
    return dirs


def turn_result(k: int, ids: list[int], r, rows: np.ndarray, start: int) -> TurnResult:
    return TurnResult(
        turn=k,
        input_ids=np.asarray(ids, np.int32),
        output_ids=np.asarray(r.output_ids, np.int32),
        logprobs=np.asarray(r.logprobs, np.float32),
        finish=wire.Finish.LENGTH,
        policy_version=int(r.weight_version),
        routing=rows.astype(np.uint8),
        routing_start=start,
        action_kind="none",
        action_text="",
        observation="",
        exit_code=None,
        timed_out=False,
        truncated=False,
        tests_passed=None,
        reward=0.0,
        t_sample_s=0.0,
        t_exec_s=0.0,
        output_versions=np.asarray([int(v) for v in r.versions], np.int32),
    )


async def sample(dirs: list[Path], episodes: int, tok: ChatTokenizer) -> dict[str, list[list[wire.TurnRecord]]]:
    """Records of every episode, as streamed with the rows the sampler returns (``exact``) and with only the
    rows from the requested start (``old``)."""
    recs: dict[str, list[list[wire.TurnRecord]]] = {name: [[] for _ in range(episodes)] for name in ("exact", "old")}
    encs = {name: [TurnEncoder(f"e{e}") for e in range(episodes)] for name in recs}
    state = {
        e: (tok.render([{"role": "user", "content": f"task {e}: count the lines of /etc/passwd"}]), 0)
        for e in range(episodes)
    }
    engine = Engine(dirs[0], EngineConfig(max_batch=max(episodes, 1)))
    async with trio.open_nursery() as n:
        await n.start(engine.run)
        for k in range(len(dirs)):
            if k:
                await engine.update_weights_from_disk(dirs[k], str(k))

            async def one(e: int, k: int = k) -> None:  # this policy version, bound at definition
                ids, start = state[e]
                r = await engine.collect(
                    GenRequest(
                        rid=f"{e}/{k}",
                        input_ids=tuple(ids),
                        max_new_tokens=NEW_TOKENS,
                        temperature=1.0,
                        seed=1000 * e + k,
                        ignore_eos=True,
                        return_routing=True,
                        routing_start=start,
                    )
                )
                assert r.routing is not None  # asked for (return_routing)
                given = {"exact": (r.routing, r.routing_start), "old": (r.routing[start - r.routing_start :], start)}
                for name, (rows, at) in given.items():
                    recs[name][e].append(encs[name][e].encode(turn_result(k, ids, r, rows, at)))
                seq = list(ids) + r.output_ids
                obs = tok.message_ids("tool", f"out {k}")
                state[e] = (seq + tok.bridge_ids(r.output_ids) + obs + tok.generation_prompt_ids(), len(seq) - 1)

            async with trio.open_nursery() as inner:
                for e in range(episodes):
                    inner.start_soon(one, e)
        n.cancel_scope.cancel()
    return recs


def replay(records: list[wire.TurnRecord], models: list) -> tuple[np.ndarray, Assembler, int]:
    """|replayed - sampled logprob| of every loss token, each with the weights that sampled it."""
    asm = Assembler()
    segs = [s for r in records for s in asm.feed(wire.decode(wire.encode(r)))]
    segs += asm.end(wire.EndRecord(records[0].episode, len(records), wire.EndReason.MAX_TURNS, 0, 1, False))
    diffs = []
    for s in segs:
        x = torch.from_numpy(s.tokens[None].astype(np.int64))
        assert s.routing is not None  # every turn was recorded with its routing
        for v in np.unique(s.versions[s.loss_mask]):
            with torch.no_grad():
                out = models[int(v)](x, replay=torch.from_numpy(s.routing[None].astype(np.int64)))
            lp = torch.log_softmax(out.logits[0, :-1].float(), -1).gather(-1, x[0, 1:, None]).squeeze(-1).numpy()
            sel = s.loss_mask & (s.versions == v)
            diffs.append(np.abs(np.concatenate([[0.0], lp])[sel] - s.logprobs[sel]))
    return np.concatenate(diffs), asm, len(segs)


def run(episodes: int, turns: int, noise: float, model: Path | None = None) -> dict:
    torch.set_num_threads(1)
    base = model or default_model_dir()
    tok = ChatTokenizer.load(base)
    with tempfile.TemporaryDirectory() as tmp:
        dirs = versions_of_weights(turns, noise, Path(tmp), tok, base)
        models = [load_pretrained(d) for d in dirs]
        recs = trio.run(sample, dirs, episodes, tok)
    result: dict = {"episodes": episodes, "turns": turns, "noise": noise}
    for name, eps in recs.items():
        parts = [replay(r, models) for r in eps]
        d = np.concatenate([p[0] for p in parts])
        result[name] = {
            "mean_abs_dlogp": float(d.mean()),
            "max_abs_dlogp": float(d.max()),
            "tokens": int(d.size),
            "route_forks": sum(p[1].stats().route_forks for p in parts),
            "rerouted_rows": sum(p[1].stats().rerouted_rows for p in parts),
            "segments": sum(p[2] for p in parts),
            "stale_context_routes": sum(p[1].stats().stale_context_routes for p in parts),
        }
    return result


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.r3flush", description=__doc__.split("\n\n")[0])
    ap.add_argument("--episodes", type=int, default=8)
    ap.add_argument("--turns", type=int, default=6, help="turns per episode; a weight update before each but the first")
    ap.add_argument("--noise", type=float, default=0.02, help="each update adds this fraction of a tensor's std")
    ap.add_argument("--json", action="store_true", help="print the result as JSON on the last line")
    ap.add_argument("--model", type=Path, default=None, help="model dir (default: the shipped tiny model)")
    args = ap.parse_args(argv)
    if args.episodes < 1 or args.turns < 2:
        ap.error("--episodes must be >= 1 and --turns >= 2 (a weight update needs a turn after it)")
    if args.model is not None:
        try:
            check_model_dir(args.model, "--model")
        except ConfigError as exc:
            ap.error(str(exc))
    res = run(args.episodes, args.turns, args.noise, args.model)
    rows = [
        (
            name,
            r["tokens"],
            f"{r['mean_abs_dlogp']:.2e}",
            f"{r['max_abs_dlogp']:.2e}",
            r["route_forks"],
            r["rerouted_rows"],
            r["stale_context_routes"],
            r["segments"],
        )
        for name, r in ((n, res[n]) for n in ("exact", "old"))
    ]
    header = [
        "rows given",
        "loss tokens",
        "mean |dlogp|",
        "max |dlogp|",
        "route forks",
        "rerouted rows",
        "stale-context turns",
        "segments",
    ]
    title = f"R3 replay vs sampler, {args.episodes} episodes x {args.turns} turns, an update before each turn"
    print_grid(header, rows, title=title)
    if args.json:
        emit_json(res)


if __name__ == "__main__":
    main()
