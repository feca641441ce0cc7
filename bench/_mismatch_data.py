"""Episodes for ``bench.mismatch``: a scripted token-in multi-turn driver, and the text-level view of them.

The driver samples real multi-turn episodes from a sampler (the embedded server, over HTTP): turn k's input
is built from exact IDs like the agent does (previous input + sampled output + ``bridge_ids`` + the
observation message encoded on its own + the generation prompt), with routing asked only for rows not yet
covered (``routed_experts_start_len``). Observations are the real output of shell commands run on synthetic
task work dirs (files from ``sandbox_agent.synth`` task families written to a temp dir; read-only commands
such as ``ls -la``, ``cat``, ``grep -n``, ``wc``), formatted by the agent's ``format_observation``: columns,
runs of spaces, tabs, and newlines followed by indentation are exactly where text-level retokenization
drifts.

``retokenize`` is what a text-level pipeline does with the same episode: keep the chat as text (assistant
turns decoded with ``skip_special_tokens=True``, as SGLang's ``text`` field is), re-render it with the chat
template, encode it once, and zip each assistant turn's tokens with that turn's sampled logprobs by
position.
"""

from __future__ import annotations

import dataclasses
import difflib
import random
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import anyio
import numpy as np

from sandbox_agent.agent.actions import SYSTEM_PROMPT, format_observation
from t1async.model.tokenizer import ChatTokenizer
from t1async.protocol.sampling import Sampler, SamplingParams

# read-only commands; {f} is a file of the work dir, {w} a word that occurs in the files
COMMANDS = (
    "ls -la",
    "ls -la {d}",
    "find . -type f | LC_ALL=C sort",
    "cat {f}",
    "head -n 12 {f}",
    "wc -l {f}",
    "grep -rn {w} . | head -n 15",
    "stat -c '%A %8s  %n' {f}",
    "du -a . | LC_ALL=C sort -k2",
    "awk '{{print NR\": \"$0}}' {f} | head -n 10",
    "cat -A {f} | head -n 8",
    "od -c {f} | head -n 6",
    "nl -ba {f} | tail -n 8",
)


def _families():
    from sandbox_agent.synth import data, fsops, textproc

    return (
        textproc.text_family,
        textproc.csv_family,
        textproc.logs_family,
        data.json_family,
        fsops.files_family,
        fsops.find_family,
    )


@dataclass(frozen=True)
class Script:
    """What the driver feeds one episode: the task instruction and an observation per turn but the last."""

    instruction: str
    observations: tuple[str, ...]


def make_scripts(n: int, turns: int, *, seed: int = 0, max_obs_chars: int = 1200) -> list[Script]:
    """``n`` scripts of ``turns`` turns, each from a synthetic task's files and real command outputs."""
    rng = random.Random(seed)
    fams = _families()
    out = []
    for i in range(n):
        spec = fams[i % len(fams)](rng)
        with tempfile.TemporaryDirectory(prefix="t1-mismatch-") as tmp:
            work = Path(tmp)
            for rel, content in spec.files.items():
                p = work / rel
                p.parent.mkdir(parents=True, exist_ok=True)
                if isinstance(content, bytes):
                    p.write_bytes(content)
                else:
                    p.write_text(content)
            files = sorted(str(p.relative_to(work)) for p in work.rglob("*") if p.is_file())
            dirs = sorted({str(Path(f).parent) for f in files if "/" in f}) or ["."]
            words = [w for w in spec.instruction.replace("`", " ").split() if w.isalpha() and len(w) > 4] or ["the"]
            obs = []
            for _ in range(turns - 1):
                cmd = rng.choice(COMMANDS).format(f=rng.choice(files), d=rng.choice(dirs), w=rng.choice(words))
                res = subprocess.run(
                    cmd,
                    shell=True,
                    cwd=work,
                    capture_output=True,
                    timeout=10,
                    env={"PATH": "/usr/local/bin:/usr/bin:/bin", "LC_ALL": "C.UTF-8", "HOME": tmp},
                )
                text = (res.stdout + res.stderr).decode("utf-8", errors="replace")
                obs.append(format_observation(text, res.returncode, max_chars=max_obs_chars))
        out.append(Script(spec.instruction, tuple(obs)))
    return out


@dataclass(frozen=True)
class SampledTurn:
    input_ids: np.ndarray  # int32, the full input of the turn
    output_ids: np.ndarray  # int32
    logprobs: np.ndarray  # float32
    finish: str
    routing: np.ndarray  # the sampler's rows [routing_start, input_len + len(output) - 1)
    routing_start: int


@dataclass(frozen=True)
class SampledEpisode:
    """One episode as the sampler produced it (exact IDs) plus the chat as text."""

    tokens: np.ndarray  # int32 [S], the full sequence (inputs and outputs)
    loss_mask: np.ndarray  # bool [S]: sampled output tokens
    logprobs: np.ndarray  # float32 [S]: the sampler's logprob at sampled tokens, 0 elsewhere
    routing: np.ndarray  # int16 [S, L, K], the sampler's experts; the last position -1 (never routed)
    turn_spans: tuple[tuple[int, int], ...]  # [start, end) of each turn's output in ``tokens``
    messages: tuple[dict, ...]  # system, user, assistant, user, ..., assistant (text level)
    turns: tuple[SampledTurn, ...] = ()  # what an actor streams, turn by turn


async def sample_episode(
    sampler: Sampler, tok: ChatTokenizer, script: Script, params: SamplingParams, *, rid: str
) -> SampledEpisode:
    messages: list[dict] = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": script.instruction},
    ]
    input_ids = list(tok.render(messages))
    rows: list[np.ndarray] = []
    spans: list[tuple[int, int]] = []
    lps: list[np.ndarray] = []
    turns: list[SampledTurn] = []
    routed = 0
    n_turns = len(script.observations) + 1
    for k in range(n_turns):
        gen = await sampler.generate(input_ids, params, routed_experts_start_len=routed, rid=f"{rid}/{k}")
        out = [int(t) for t in gen.output_ids]
        shape = getattr(sampler, "routing_shape", None)
        if gen.routing is None and shape is not None:  # an engine without routes (vLLM-CPU): rows of -1, R3 is off
            gen = dataclasses.replace(
                gen, routing=np.full((len(input_ids) + len(out) - 1 - routed, *shape[:2]), -1), routing_start=routed
            )
        if gen.routing is None or gen.routing_start != routed:
            raise RuntimeError(f"{rid} turn {k}: sampler returned routing from {gen.routing_start}, asked {routed}")
        rows.append(np.asarray(gen.routing, dtype=np.int16))
        spans.append((len(input_ids), len(input_ids) + len(out)))
        lps.append(np.asarray(gen.logprobs, dtype=np.float32))
        turns.append(
            SampledTurn(
                np.asarray(input_ids, np.int32), np.asarray(out, np.int32), lps[-1], gen.finish, rows[-1], routed
            )
        )
        messages.append({"role": "assistant", "content": tok.decode(out, skip_special_tokens=True)})
        seq = input_ids + out
        if k == n_turns - 1:
            break
        obs = script.observations[k]
        messages.append({"role": "user", "content": obs})
        routed = len(seq) - 1
        input_ids = seq + tok.bridge_ids(out) + tok.message_ids("user", obs) + tok.generation_prompt_ids()
    s = len(seq)
    routing = np.concatenate(rows, axis=0)
    if routing.shape[0] != s - 1:
        raise RuntimeError(f"{rid}: routing tiles cover {routing.shape[0]} rows, the sequence needs {s - 1}")
    routing = np.concatenate([routing, np.full((1, *routing.shape[1:]), -1, dtype=np.int16)])
    loss = np.zeros(s, dtype=bool)
    logprobs = np.zeros(s, dtype=np.float32)
    for (a, b), lp in zip(spans, lps):
        loss[a:b] = True
        logprobs[a:b] = lp
    return SampledEpisode(
        np.asarray(seq, dtype=np.int32), loss, logprobs, routing, tuple(spans), tuple(messages), tuple(turns)
    )


def assemble(ep: SampledEpisode, episode: str):
    """Stream the episode's turns as wire records through the learner's real TITO assembly (boundary check
    and repair, routing alignment); returns ``(segments, drift_stats)``."""
    from t1async.ingest.assembly import Assembler
    from t1async.protocol import wire

    asm = Assembler()
    segs = []
    prev = np.zeros(0, np.int32)
    for k, t in enumerate(ep.turns):
        n = min(len(prev), len(t.input_ids))
        neq = np.flatnonzero(t.input_ids[:n] != prev[:n])
        keep = int(neq[0]) if len(neq) else n
        finish = wire.Finish(t.finish) if t.finish in ("stop", "length", "abort") else wire.Finish.STOP
        rec = wire.TurnRecord(
            episode=episode,
            turn=k,
            policy_version=0,
            keep=keep,
            input_delta=t.input_ids[keep:].astype(np.int32),
            input_len=len(t.input_ids),
            input_digest=wire.digest_ids(t.input_ids),
            output_ids=t.output_ids,
            output_logprobs=t.logprobs,
            finish=finish,
            routing=None if (t.routing < 0).all() else wire.Routing(t.routing_start, t.routing.astype(np.uint8)),
            reward=0.0,
            tests_passed=-1,
            t_sample_s=0.0,
            t_exec_s=0.0,
        )
        segs += asm.add(rec)
        prev = np.concatenate([t.input_ids, t.output_ids])
    segs += asm.end(wire.EndRecord(episode, len(ep.turns), wire.EndReason.MAX_TURNS, 0, 1, False))
    return segs, asm.stats()


async def sample_episodes(
    sampler: Sampler, tok: ChatTokenizer, scripts: Sequence[Script], params: SamplingParams
) -> list[SampledEpisode]:
    """All episodes concurrently, so the sampler decodes them as one batch."""
    results: list[SampledEpisode | None] = [None] * len(scripts)

    async def one(i: int) -> None:
        results[i] = await sample_episode(sampler, tok, scripts[i], params, rid=f"mismatch-{i}")

    async with anyio.create_task_group() as tg:
        for i in range(len(scripts)):
            tg.start_soon(one, i)
    return [r for r in results if r is not None]


@dataclass(frozen=True)
class Retokenized:
    """The text-level pipeline's view of one episode."""

    tokens: np.ndarray  # int32 [R], render(messages) encoded at once
    loss_mask: np.ndarray  # bool [R]: tokens of assistant turns (content, and im_end if the sampler emitted one)
    logprobs: np.ndarray  # float32 [R]: sampled logprobs zipped by position within the turn (0 if none)
    has_logprob: np.ndarray  # bool [R]: a sampled logprob was available for this loss token
    drift: np.ndarray  # bool [R]: loss token whose ID or context differs from what was sampled
    id_match: np.ndarray  # bool [R]: loss token whose ID equals the sampled ID at its place in the turn
    dropped: int  # sampled tokens left without a counterpart (the turn re-encoded shorter)
    routing: np.ndarray  # int16 [R, L, K]: recorded routing where the token aligns with the sampled sequence


def retokenize(ep: SampledEpisode, tok: ChatTokenizer) -> Retokenized:
    text_parts: list[tuple[str, int]] = []  # (piece, assistant turn index or -1)
    turn = 0
    for m in ep.messages:
        text_parts.append((f"<|im_start|>{m['role']}\n", -1))
        if m["role"] == "assistant":
            text_parts.append((m["content"], turn))
            turn += 1
        else:
            text_parts.append((m["content"], -1))
        text_parts.append(("<|im_end|>\n", -1))
    text = "".join(p for p, _ in text_parts)
    if text != tok.render_text(list(ep.messages), add_generation_prompt=False):
        raise RuntimeError("bench text assembly disagrees with the chat template")
    enc = tok.tok.encode(text, add_special_tokens=False)
    ids = np.asarray(enc.ids, dtype=np.int32)
    offs = np.asarray(enc.offsets, dtype=np.int64).reshape(-1, 2)
    r = len(ids)
    loss = np.zeros(r, dtype=bool)
    lps = np.zeros(r, dtype=np.float32)
    has = np.zeros(r, dtype=bool)
    match = np.zeros(r, dtype=bool)
    dropped = 0
    pos = 0
    for piece, t in text_parts:
        c0, c1 = pos, pos + len(piece)
        pos = c1
        if t < 0:
            continue
        a, b = ep.turn_spans[t]
        sampled = ep.tokens[a:b]
        # the turn's tokens: any token overlapping the content, then the template's im_end if sampled
        idx: list[int] = np.flatnonzero((offs[:, 1] > c0) & (offs[:, 0] < c1)).tolist() if c1 > c0 else []
        end_tok = int(np.searchsorted(offs[:, 0], c1, side="left"))
        if (
            len(sampled)
            and int(sampled[-1]) == tok.end_of_turn_id
            and end_tok < r
            and int(ids[end_tok]) == tok.end_of_turn_id
        ):
            idx.append(end_tok)
        for i, p in enumerate(idx):
            loss[p] = True
            if i < len(sampled):
                lps[p] = ep.logprobs[a + i]
                has[p] = True
                match[p] = int(ids[p]) == int(sampled[i])
        dropped += max(0, len(sampled) - len(idx))
    # first position where the retokenized sequence departs from the sampled one: from there on, every
    # token has a different ID or a different context than the sampler gave it
    n = min(r, len(ep.tokens))
    neq = np.flatnonzero(ids[:n] != ep.tokens[:n])
    first = int(neq[0]) if len(neq) else n
    drift = loss & (np.arange(r) >= first)
    # routing: replay the recorded experts where a token-level diff aligns the two sequences
    routing = np.full((r, *ep.routing.shape[1:]), -1, dtype=np.int16)
    sm = difflib.SequenceMatcher(None, ids.tolist(), ep.tokens.tolist(), autojunk=False)
    for blk in sm.get_matching_blocks():
        if blk.size:
            routing[blk.a : blk.a + blk.size] = ep.routing[blk.b : blk.b + blk.size]
    return Retokenized(ids, loss, lps, has, drift, match, dropped, routing)
