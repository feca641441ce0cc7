"""Synthetic episodes with injected drift, for tests and benches (reusable: ``t1async.testing.episodes``).

``make_episode`` plays a token-in actor against a fake sampler whose routing is a deterministic function of
the whole causal prefix (``route_rows``), so a row taken from the wrong context is detected. Each boundary
is built with a chosen drift kind:

- ``clean``   ``I_{k+1} = S_k + observation``
- ``realign`` a trailing run of turn k's output is discarded before the observation
- ``fork``    a token of the prefix (before turn k's output) is re-rendered: substituted, or two tokens merged

and the actor's ``keep`` claim is exact, understated, or 0 (a text-level agent). Delivery can be shuffled
and duplicated. ``check_segments`` asserts the TITO invariant against the ground truth.

``episodes()`` is the hypothesis strategy over all of that.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from t1async.ingest.tito import Segment
from t1async.protocol import wire

KINDS = ("clean", "realign", "fork")
KEEP_MODES = ("exact", "under", "zero")

# ------------------------------------------------------------------------------------------ fake routing

_W = np.zeros(0, np.int64)
_LAYER_MULT = np.array(
    [
        0x9E3779B97F4A7C15 & 0x7FFFFFFFFFFFFFFF,
        0x632BE59BD9B4E019,
        0x3C6EF372FE94F82B,
        0x1B873593CC9E2D51,
        0x5851F42D4C957F2D,
        0x2545F4914F6CDD1D,
        0x14057B7EF767814F,
        0x4F1BBCDCBFA53E0B,
    ],
    dtype=np.int64,
)


def _weights(n: int) -> np.ndarray:
    global _W
    if len(_W) < n:
        _W = np.random.default_rng(0xC0FFEE).integers(1, 2**61, size=max(n, 2 * len(_W), 1 << 16), dtype=np.int64)
    return _W[:n]


def prefix_hash(tokens: np.ndarray, prev: np.ndarray | None = None, lcp: int = 0) -> np.ndarray:
    """int64 [T]: a hash of ``tokens[0..p]`` for each p. With ``prev`` (the hash of a sequence sharing the first
    ``lcp`` tokens) only the new part is computed."""
    w = _weights(len(tokens))
    with np.errstate(over="ignore"):
        tail = np.cumsum((tokens[lcp:].astype(np.int64) + 1) * w[lcp:], dtype=np.int64)
        if lcp:
            assert prev is not None
            tail += prev[lcp - 1]
            return np.concatenate([prev[:lcp], tail])
    return tail


def rows_from_hash(h: np.ndarray, layers: int, topk: int, num_experts: int) -> np.ndarray:
    with np.errstate(over="ignore"):
        mult = np.resize(_LAYER_MULT, layers) + np.arange(layers, dtype=np.int64)
        base = ((h[:, None] * mult[None, :]) >> 23) % num_experts
    rows = (base[:, :, None] + np.arange(topk)[None, None, :]) % num_experts
    return rows.astype(np.uint8 if num_experts <= 256 else np.uint16)


def route_rows(tokens: np.ndarray, layers: int, topk: int, num_experts: int) -> np.ndarray:
    """Fake sampler routing: row p depends on every token ``0..p`` (a prefix hash), distinct experts per row."""
    return rows_from_hash(prefix_hash(tokens), layers, topk, num_experts)


# ------------------------------------------------------------------------------------------ episodes


@dataclass(frozen=True, eq=False)
class TruthTurn:
    turn: int
    input_ids: np.ndarray  # the sampler's full input I_k
    output_ids: np.ndarray
    logprobs: np.ndarray
    policy_version: int
    reward: float
    kind: str  # the drift injected at the boundary before this turn ('' for turn 0)


@dataclass(eq=False)
class EpisodeCase:
    episode: str
    truth: list[TruthTurn]
    records: list[wire.TurnRecord | wire.EndRecord]  # in delivery order (maybe shuffled, duplicated)
    layers: int
    topk: int
    num_experts: int
    duplicates: int = 0
    expected: dict[str, int] = field(default_factory=dict)  # clean/realign/fork boundary counts
    dropped: int = 0  # tokens a REALIGN must drop


@dataclass(frozen=True)
class Sizes:
    """Token counts drawn uniformly from [lo, hi]."""

    prompt: tuple[int, int] = (5, 40)
    output: tuple[int, int] = (1, 30)
    observation: tuple[int, int] = (1, 20)
    vocab: int = 4096


SMALL = Sizes()
REALISTIC = Sizes(prompt=(400, 1500), output=(200, 2000), observation=(30, 600), vocab=150_000)


def make_episode(
    rng: np.random.Generator,
    kinds: Sequence[str],
    *,
    episode: str = "ep",
    keep_modes: Sequence[str] | None = None,
    sizes: Sizes = SMALL,
    layers: int = 3,
    topk: int = 2,
    num_experts: int = 16,
    routing: bool = True,
    shuffle: float = 0.0,
    duplicate: float = 0.0,
    with_end: bool = True,
    fork_window: int | None = None,
    no_routing: Collection[int] = (),
) -> EpisodeCase:
    """An episode of ``len(kinds) + 1`` turns; ``kinds[i]`` is the drift at the boundary before turn i+1.
    A FORK's first difference is anywhere in the prefix, or within ``fork_window`` tokens before turn k's
    output (re-rendering usually differs near the boundary). Turns in ``no_routing`` are sent without a trace
    (a sampler that did not return one), e.g. right after a FORK."""

    def draw(lo_hi: tuple[int, int]) -> int:
        return int(rng.integers(lo_hi[0], lo_hi[1] + 1))

    def ids(n: int) -> np.ndarray:
        return rng.integers(0, sizes.vocab, size=n, dtype=np.int32)

    truth: list[TruthTurn] = []
    turns: list[wire.TurnRecord] = []
    expected = {k: 0 for k in KINDS}
    dropped = 0
    seq = np.zeros(0, np.int32)  # S_k as the actor (and the learner) see it
    hseq = np.zeros(0, np.int64)  # its prefix hash (routing is generated incrementally)
    out_start = 0
    policy_version = 0
    for t in range(len(kinds) + 1):
        kind = "" if t == 0 else kinds[t - 1]
        obs = ids(draw(sizes.observation if t else sizes.prompt))
        if t == 0:
            inp = obs
        elif kind == "clean":
            inp = np.concatenate([seq, obs])
        elif kind == "realign":
            run = int(rng.integers(1, len(seq) - out_start + 1))
            dropped += run
            if obs[0] == seq[len(seq) - run]:  # keep the boundary a true REALIGN at exactly this point
                obs[0] = (obs[0] + 1) % sizes.vocab
            inp = np.concatenate([seq[: len(seq) - run], obs])
        elif kind == "fork":
            lo = 0 if fork_window is None else max(0, out_start - fork_window)
            q = int(rng.integers(lo, out_start))  # out_start >= 1: every input has at least one token
            tail = seq[q:].copy()
            if len(tail) >= 2 and rng.random() < 0.5:  # two tokens merged into one
                tail = np.concatenate([[(int(tail[0]) + int(tail[1]) + 1) % sizes.vocab], tail[2:]]).astype(np.int32)
                if tail[0] == seq[q]:
                    tail[0] = (tail[0] + 1) % sizes.vocab
            else:  # one token re-rendered differently
                tail[0] = (int(tail[0]) + 1 + int(rng.integers(0, sizes.vocab - 1))) % sizes.vocab
            inp = np.concatenate([seq[:q], tail, obs]).astype(np.int32)
        else:
            raise ValueError(f"unknown drift kind {kind!r}; use one of {KINDS}")
        if t:
            expected[kind] += 1
        inp = inp.astype(np.int32)
        n = len(seq)
        lcp = _lcp(seq, inp)
        mode = (keep_modes[t - 1] if keep_modes else "exact") if t else "exact"
        keep = {"exact": lcp, "under": int(rng.integers(0, lcp + 1)), "zero": 0}[mode]
        out = ids(draw(sizes.output))
        lps = -rng.exponential(1.0, size=len(out)).astype(np.float32)
        if rng.random() < 0.2:
            policy_version += 1
        full = np.concatenate([inp, out])
        hfull = prefix_hash(full, hseq, lcp)
        rt = None
        if routing and t not in no_routing:
            start = 0 if t == 0 else min(keep, n - 1)
            rt = wire.Routing(start, rows_from_hash(hfull[start : len(full) - 1], layers, topk, num_experts))
        reward = float(rng.integers(-1, 3))
        turns.append(
            wire.TurnRecord(
                episode=episode,
                turn=t,
                policy_version=policy_version,
                keep=keep,
                input_delta=inp[keep:].copy(),
                input_len=len(inp),
                input_digest=wire.digest_ids(inp),
                output_ids=out,
                output_logprobs=lps,
                finish=wire.Finish.STOP,
                routing=rt,
                reward=reward,
                tests_passed=-1,
                t_sample_s=0.0,
                t_exec_s=0.0,
            )
        )
        truth.append(TruthTurn(t, inp, out, lps, policy_version, reward, kind))
        seq, hseq, out_start = full, hfull, len(inp)
    records: list[wire.TurnRecord | wire.EndRecord] = list(turns)
    if with_end:
        records.append(wire.EndRecord(episode, len(turns), wire.EndReason.MAX_TURNS, 0, 1, False))
    records, dups = deliver(rng, records, shuffle=shuffle, duplicate=duplicate)
    return EpisodeCase(episode, truth, records, layers, topk, num_experts, dups, expected, dropped)


def _lcp(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    d = np.flatnonzero(a[:n] != b[:n])
    return int(d[0]) if len(d) else n


def deliver(rng: np.random.Generator, records: list, *, shuffle: float, duplicate: float) -> tuple[list, int]:
    """At-least-once delivery: each record may be repeated; ``shuffle`` is the fraction of local swaps."""
    out = []
    dups = 0
    for r in records:
        out.append(r)
        if rng.random() < duplicate:
            out.append(r)
            dups += 1
    for _ in range(int(shuffle * len(out))):
        i = int(rng.integers(0, len(out)))
        j = min(len(out) - 1, i + int(rng.integers(1, 6)))
        out[i], out[j] = out[j], out[i]
    return out, dups


# ------------------------------------------------------------------------------------------ invariant


def check_segments(case: EpisodeCase, segments: Iterable[Segment], *, full_routing: bool = True) -> dict[str, int]:
    """Assert the TITO invariant of ``segments`` against ``case``'s ground truth; returns counts.

    Every loss token is the exact sampled ID at a position whose preceding tokens equal the sampler's input
    for its turn (and the turn's earlier outputs), with its sampled logprob and version; every present
    routing row equals the sampler's routing for that row's own causal prefix; with ``full_routing`` only a
    segment's last position may be missing. Each sampled token is trained at most once.
    """
    truth = {t.turn: t for t in case.truth}
    trained = {t: np.zeros(len(tr.output_ids), bool) for t, tr in truth.items()}
    n_loss = 0
    for seg in segments:
        assert seg.episode == case.episode
        toks, lm = seg.tokens, seg.loss_mask
        assert not lm[0], "a loss token at position 0 has no context"
        for t in np.unique(seg.turn_ids[lm]):
            tr = truth[int(t)]
            pos = np.flatnonzero(lm & (seg.turn_ids == t))
            start = len(tr.input_ids)
            assert np.array_equal(toks[:start], tr.input_ids), f"turn {t}: context differs from the sampler's input"
            k = pos - start
            assert k.min() >= 0 and np.array_equal(k, np.arange(len(k))), (
                f"turn {t}: loss positions not its output prefix"
            )
            assert np.array_equal(toks[pos], tr.output_ids[k]), f"turn {t}: loss tokens are not the sampled ids"
            assert np.array_equal(seg.logprobs[pos], tr.logprobs[k]), f"turn {t}: logprobs not paired"
            assert np.all(seg.versions[pos] == tr.policy_version), f"turn {t}: versions not paired"
            assert not trained[int(t)][k].any(), f"turn {t}: a token is trained twice"
            trained[int(t)][k] = True
            n_loss += len(pos)
        assert np.all(seg.logprobs[~lm] == 0) and np.all(seg.versions[~lm] == -1)
        assert seg.turn_numbers is not None, "a segment with loss tokens has turn numbers"
        assert set(seg.turn_numbers.tolist()) == set(np.unique(seg.turn_ids[lm]).tolist())
        if seg.routing is not None:
            want = route_rows(toks, case.layers, case.topk, case.num_experts).astype(np.int16)
            ok = seg.routing >= 0
            assert np.array_equal(seg.routing[ok], want[ok]), "a routing row is from another context"
            present = ok.all(axis=(1, 2))
            if full_routing:
                missing = np.flatnonzero(~present)
                assert missing.size == 0 or missing.tolist() == [len(toks) - 1], f"routing missing at {missing[:10]}"
    return {"loss_tokens": n_loss, "trained_tokens": int(sum(m.sum() for m in trained.values()))}


def episodes_strategy(max_turns: int = 12):  # pragma: no cover - thin hypothesis wrapper
    """Hypothesis strategy of ``EpisodeCase`` with every drift kind, keep mode, shuffle and duplicates."""
    from hypothesis import strategies as st

    @st.composite
    def build(draw):
        kinds = draw(st.lists(st.sampled_from(KINDS), max_size=max_turns))
        modes = draw(st.lists(st.sampled_from(KEEP_MODES), min_size=len(kinds), max_size=len(kinds)))
        seed = draw(st.integers(0, 2**32 - 1))
        shuffle = draw(st.sampled_from([0.0, 0.5, 2.0]))
        dup = draw(st.sampled_from([0.0, 0.3]))
        return make_episode(np.random.default_rng(seed), kinds, keep_modes=modes, shuffle=shuffle, duplicate=dup)

    return build()


episodes = episodes_strategy
