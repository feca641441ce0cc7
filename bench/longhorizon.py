"""Cost per turn over one long episode: does turn 300 cost what turn 10 did?

One episode of ``--turns`` turns (default 320) through the real pieces: the agent loop with the shipped
chat tokenizer, a REAL bubblewrap sandbox running every command, the actor's ``TurnEncoder`` (``keep`` /
``input_delta`` / digest / routing rows from the first uncovered position), a REAL ``nats-server``
(``t1async.transport.natsd``) and ``NatsTransport``. The sampler is scripted (shell commands, no model) so that what
is measured is the infrastructure. On the learner side a core subscription receives each turn's bytes and
the bench times ``wire.decode`` + ``Assembler.feed`` (decode, TITO check and repair, routing alignment).

Per turn index it reports the bytes on the wire, that ingest time, and the sandbox round trip of the turn's
command. Ingest is also re-timed offline over the received bytes (``--replays`` fresh assemblers, per-turn
minimum), which takes the noise of a shared machine out of the ratio. Then, separately:

- ``exec_p50_ms``: the round trip of ``true`` through ``BwrapSandbox.exec`` (the sandbox's public API);
- ``train_peak_rss_gb_32k``: one PPO step of the shipped model on a single 32k-token segment, in a child
  process so that its ``ru_maxrss`` is its own peak.

- live training: the received records replayed into an assembler and the real ``Trainer.step`` of the shipped
  model, the open episode cut every ``--cut-every`` turns as the learner cuts a due episode: per turn index,
  positions forwarded and back-propagated per trained (new) position, and step time per trained position;
  with ``--prefix-kv reuse`` (the default, learner.prefixkv) over all turns, and ``exact`` over the first
  ``--exact-turns``; every ``--cos-every`` steps the reuse gradient's cosine to the exact one on the same cut.

Targets: ``ingest_ratio_late_early`` (median ingest of turns 300-320 over turns 10-30)
<= 1.5, ``exec_p50_ms`` <= 10, ``train_peak_rss_gb_32k`` < 4, ``forwarded_per_trained_token`` <= 3,
``step_time_ratio_late_early`` <= 1.5.

With ``--ranks N`` the live training runs on N learner ranks (``learner.ranks.Ranks``: this process rank 0, the
others children, the model sharded by FSDP2), as ``--learner-procs N`` trains; the gradient cosine is then
not measured (the gradient is sharded).

    python -m bench.longhorizon [--turns 320] [--json] [--train-tokens 32768] [--no-train] [--no-live] [--ranks N]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import numpy as np

from actors.records import TurnEncoder
from actors.settings import EpisodeOptions
from bench._common import add_model_arg, emit_json, model_dir, print_grid, print_table, trainable_routing
from sandbox_agent.agent.runner import run_episode
from sandbox_agent.agent.types import AgentConfig, TurnResult
from sandbox_agent.sandbox import SandboxConfig
from sandbox_agent.sandbox.backend import BwrapBackend
from sandbox_agent.sandbox.bwrap import BwrapSandbox
from sandbox_agent.tasks.task import load_task
from t1async.ingest.assembly import Assembler
from t1async.ingest.episode import AssemblerConfig
from t1async.ingest.routing import compact_dtype
from t1async.log import configure
from t1async.model.config import MoEConfig
from t1async.model.tokenizer import ChatTokenizer
from t1async.protocol import wire
from t1async.protocol.sampling import Generation, SamplingParams
from t1async.transport.base import traj_subject
from t1async.transport.nats import NatsTransport
from t1async.transport.natsd import NatsServer

TASK = Path(__file__).resolve().parents[1] / "sandbox_agent" / "fixtures" / "tb1" / "hello-world"
EARLY = (10, 30)  # turns compared with the last 20 (300-320 at the default --turns 320)


class ScriptedSampler:
    """Answers every turn with a shell command (a fixed cycle), exact IDs and routing rows only from
    ``routed_experts_start_len``, as a token-in/token-out sampler with a prefix cache does."""

    COMMANDS = (
        "true",
        "echo step {k}",
        "ls -la",
        "pwd",
        "printf 'line %s of the log\\n' {k} {k} {k} {k}",
        "seq {k} {k2}",
    )
    # ~80 tokens a turn (action, observation, template): ~26k tokens of context by turn 320

    def __init__(self, tok: ChatTokenizer, cfg: MoEConfig) -> None:
        self.tok, self.cfg, self.calls = tok, cfg, 0  # cfg: the model's routing shape (layers, top-k, experts)

    async def generate(
        self,
        input_ids: Sequence[int],
        params: SamplingParams,
        *,
        routed_experts_start_len: int | None = None,
        rid: str | None = None,
    ) -> Generation:
        k = self.calls
        self.calls += 1
        cmd = self.COMMANDS[k % len(self.COMMANDS)].format(k=k, k2=k + 40)
        out = self.tok.encode(f"Next.\n```bash\n{cmd}\n```") + [self.tok.end_of_turn_id]
        out = out[: params.max_new_tokens]
        start = 0 if routed_experts_start_len is None else routed_experts_start_len
        pos = np.arange(start, len(input_ids) + len(out) - 1)
        experts, top_k = self.cfg.n_experts, self.cfg.top_k
        first = (pos * 7 + 3) % experts
        rows = np.stack([(first + j) % experts for j in range(top_k)], -1)[:, None, :]
        routing = np.broadcast_to(rows, (len(pos), self.cfg.n_layers, top_k)).astype(compact_dtype(experts))
        await anyio.lowlevel.checkpoint()
        return Generation(
            output_ids=np.asarray(out, dtype=np.int32),
            logprobs=np.full(len(out), -0.25, np.float32),
            finish=wire.Finish.STOP,
            policy_version=0,
            routing=routing if routed_experts_start_len is not None else None,
            routing_start=start,
            prompt_tokens=len(input_ids),
        )

    async def aclose(self) -> None:
        pass


@dataclass
class TurnRow:
    turn: int
    context: int  # full input length of the turn
    wire_bytes: int
    ingest_live_s: float = 0.0
    ingest_best_s: float = float("inf")
    exec_s: float = 0.0
    encode_s: float = 0.0  # the actor's TurnEncoder.encode + wire.encode (keep, digest, routing rows)


@dataclass
class EpisodeRun:
    rows: dict[int, TurnRow] = field(default_factory=dict)
    payloads: list[bytes] = field(default_factory=list)  # every record of the episode as received, in order
    reason: str = ""
    drift: dict = field(default_factory=dict)
    segments: int = 0


def _ingest(assembler: Assembler, data: bytes) -> tuple[wire.Record, int, float]:
    t0 = time.perf_counter()
    rec = wire.decode(data)
    n = len(assembler.feed(rec))
    return rec, n, time.perf_counter() - t0


async def run_episode_over_nats(turns: int, work: Path, model: Path, max_context: int = 32768) -> EpisodeRun:
    tok, mcfg = ChatTokenizer.load(model), MoEConfig.load(model)
    task = load_task(TASK)
    run = EpisodeRun()
    episode = "longhorizon-0"
    subject = traj_subject(episode)
    asm = Assembler(AssemblerConfig(num_experts=mcfg.n_experts))
    encoder = TurnEncoder(episode)
    done = anyio.Event()
    cfg = AgentConfig(
        max_turns=turns,
        max_context_tokens=max_context,  # past it, the actors' default context policy compacts (a fork)
        verify_every=0,
        stop_when_resolved=False,
        sampling=SamplingParams(max_new_tokens=64),
    )

    async with NatsServer.start(work / "nats") as srv, NatsTransport(srv.url) as nt:

        async def learner(*, task_status=anyio.TASK_STATUS_IGNORED) -> None:
            async with nt.subscribe(subject) as msgs:
                task_status.started()
                async for m in msgs:
                    rec, nseg, dt = _ingest(asm, m.data)
                    run.payloads.append(bytes(m.data))
                    run.segments += nseg
                    if isinstance(rec, wire.TurnRecord):
                        run.rows[rec.turn].ingest_live_s = dt
                    elif isinstance(rec, wire.EndRecord):
                        done.set()
                        return

        async def on_turn(t: TurnResult) -> None:
            t0 = time.perf_counter()
            rec = encoder.encode(t)
            size = len(wire.encode(rec))
            dt = time.perf_counter() - t0
            run.rows[t.turn] = TurnRow(t.turn, len(t.input_ids), size, exec_s=t.t_exec_s, encode_s=dt)
            await nt.publish(subject, rec)

        async with anyio.create_task_group() as tg:
            await tg.start(learner)
            await nt.publish(subject, wire.StartRecord(episode, "bench", task.id, turns, time.time()))
            res = await run_episode(
                task,
                sampler=ScriptedSampler(tok, mcfg),
                tokenizer=tok,
                backend=BwrapBackend(),
                config=cfg,
                on_turn=on_turn,
                rid=episode,
                work_root=work,
            )
            await nt.publish(
                subject,
                wire.EndRecord(
                    episode, len(run.rows), wire.EndReason(res.reason), res.tests_passed, res.tests_total, res.resolved
                ),
            )
            with anyio.fail_after(60):
                await done.wait()
    run.reason = res.reason
    run.drift = {k: v for k, v in asm.stats().as_dict().items() if isinstance(v, int) and v}
    return run


def replay_ingest(run: EpisodeRun, replays: int, n_experts: int) -> None:
    """Feed the received bytes to fresh assemblers; keep each turn's fastest ingest."""
    for _ in range(replays):
        asm = Assembler(AssemblerConfig(num_experts=n_experts))
        for data in run.payloads:
            rec, _, dt = _ingest(asm, data)
            if isinstance(rec, wire.TurnRecord):
                row = run.rows[rec.turn]
                row.ingest_best_s = min(row.ingest_best_s, dt)


async def exec_true_ms(n: int, work: Path) -> list[float]:
    wd = work / "exec"
    wd.mkdir()
    async with BwrapSandbox.open(wd, SandboxConfig()) as sb:
        for _ in range(10):  # warm the shell
            await sb.exec("true")
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            r = await sb.exec("true")
            out.append((time.perf_counter() - t0) * 1000.0)
            if r.exit_code != 0:
                raise RuntimeError(f"`true` exited {r.exit_code} in the sandbox: {r.output!r}")
    return out


# ------------------------------------------------------------------------------ the 32k training step


def train_step_child(tokens: int, model_dir: Path) -> None:
    """Child process: one Trainer.step of the model on one ``tokens``-long segment; prints JSON."""
    import torch

    from t1async.ingest.tito import Segment
    from t1async.learner.trainer import Trainer
    from t1async.learner.trainer_config import TrainerConfig
    from t1async.model.weights import load_pretrained

    model = load_pretrained(model_dir)
    cfg = model.cfg
    rng = np.random.default_rng(0)
    toks = rng.integers(0, cfg.vocab_size, tokens).astype(np.int32)
    lm = np.zeros(tokens, bool)
    lm[tokens // 2 :] = True  # a long context, then the actions
    with torch.no_grad():
        routing = model(torch.from_numpy(toks[None, :2048].astype(np.int64))).routing[0].numpy()
    routing = trainable_routing(routing, cfg.dense_layers)[np.arange(tokens) % 2048]
    seg = Segment(
        episode="e",
        index=0,
        tokens=toks,
        loss_mask=lm,
        logprobs=np.where(lm, -8.0, 0).astype(np.float32),
        versions=np.where(lm, 0, -1).astype(np.int32),
        turn_ids=np.zeros(tokens, np.int32),
        routing=routing,
        turn_ends=np.array([tokens - 1], np.int32),
        turn_rewards=np.array([1.0], np.float32),
        done=True,
    )
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    m = Trainer(model, TrainerConfig()).step([seg], policy_version=0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(
        json.dumps(
            {
                "peak_gb": peak / 2**20,
                "base_gb": base / 2**20,
                "step_s": time.perf_counter() - t0,
                "loss": m.loss,
                "tokens": tokens,
            }
        )
    )


def train_peak(tokens: int, model: Path) -> dict:
    p = subprocess.run(
        [sys.executable, "-m", "bench.longhorizon", "--train-child", str(tokens), "--model", str(model)],
        capture_output=True,
        text=True,
        check=False,
    )
    if p.returncode != 0:
        raise RuntimeError(f"the training child failed (rc {p.returncode}): {p.stderr[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------ live training


@dataclass
class LiveRun:
    """The episode trained as the learner trains it live: cut every ``cut_every`` turns, one step a cut."""

    prefix: str
    per_turn: dict[int, dict[str, float]] = field(default_factory=dict)  # turn -> the step that trained it
    steps: int = 0
    forwarded: int = 0
    backward: int = 0
    new: int = 0
    cosines: list[tuple[int, int, float]] = field(default_factory=list)  # (turn, age, cosine to exact)
    seconds: float = 0.0


def train_live(
    payloads: Sequence[bytes],
    *,
    model_dir: Path,
    prefix: str,
    cut_every: int,
    upto: int,
    cos_every: int,
    critic: str = "detached",
    ranks: int = 1,
) -> LiveRun:
    """Replay the received records into an assembler and the real ``Trainer.step`` of the model (the shipped
    one: random init), cutting the open episode every ``cut_every`` turns up to turn ``upto``, as the learner cuts an
    episode whose turns are due. Every ``cos_every`` steps (reuse only) the same cut is also trained exactly
    from a copy of the weights and the two gradients compared."""
    import copy

    import torch

    from t1async.learner.ranks import Ranks, RanksConfig
    from t1async.learner.trainer import Trainer
    from t1async.learner.trainer_config import Critic, Prefix, TrainerConfig
    from t1async.model.weights import load_pretrained

    class Capture(Trainer):
        grad: torch.Tensor | None = None

        def _optimizer_step(self) -> float:
            self.grad = torch.cat([p.grad.flatten() for p in self.model.parameters() if p.grad is not None]).clone()
            return super()._optimizer_step()

    torch.manual_seed(0)
    model = load_pretrained(model_dir)
    cfg = TrainerConfig(prefix_kv=Prefix(prefix), critic=Critic(critic))
    group = Ranks(RanksConfig(nproc=ranks)) if ranks > 1 else None
    trainer = group.start(model_dir, cfg) if group else Capture(model, cfg)
    if group:
        cos_every = 0  # the gradient is sharded over the ranks
    asm = Assembler(AssemblerConfig(num_experts=model.cfg.n_experts))
    live = LiveRun(prefix)
    pending: list[int] = []
    t_all = time.perf_counter()
    try:
        for data in payloads:
            rec = wire.decode(data)
            if isinstance(rec, wire.TurnRecord) and rec.turn >= upto:
                break
            segs = asm.feed(rec)
            if isinstance(rec, wire.TurnRecord):
                pending.append(rec.turn)
                if len(pending) >= cut_every:
                    segs = segs + asm.cut(rec.episode)
            if not segs:
                continue
            twin = None
            if cos_every and prefix == "reuse" and live.steps % cos_every == cos_every - 1:
                twin = Capture(copy.deepcopy(model), TrainerConfig(prefix_kv=Prefix.EXACT, critic=Critic(critic)))
                twin.step(segs, live.steps)
            t0 = time.perf_counter()
            m = trainer.step(segs, live.steps)
            dt = time.perf_counter() - t0
            live.steps += 1
            live.forwarded += m.forwarded_tokens
            live.backward += m.backward_tokens
            live.new += m.new_tokens
            for t in pending:
                live.per_turn[t] = {
                    "fwd_per_new": m.forwarded_per_trained,
                    "bwd_per_new": m.backward_per_trained,
                    "step_us_per_new": dt / max(m.new_tokens, 1) * 1e6,
                    "step_s": dt,
                }
            if twin is not None and twin.grad is not None and isinstance(trainer, Capture) and trainer.grad is not None:
                cos = float(torch.nn.functional.cosine_similarity(trainer.grad, twin.grad, dim=0))
                live.cosines.append((pending[-1], m.prefix_max_age, cos))
            pending = []
    finally:
        if group:
            group.close(trainer)
    live.seconds = time.perf_counter() - t_all
    return live


def _median_turns(live: LiveRun, lo: int, hi: int, key: str) -> float:
    vals = [live.per_turn[t][key] for t in range(lo, hi) if t in live.per_turn]
    return float(np.median(vals)) if vals else float("nan")


# ------------------------------------------------------------------------------------------- main


def _window(rows: dict[int, TurnRow], lo: int, hi: int, attr: str) -> float:
    vals = [getattr(rows[t], attr) for t in range(lo, hi) if t in rows]
    return float(np.median(vals)) if vals else float("nan")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.longhorizon", description=__doc__.split("\n\n")[0])
    ap.add_argument("--turns", type=int, default=320, help="turns of the episode (default 320)")
    ap.add_argument("--replays", type=int, default=5, help="offline ingest re-timings per turn (default 5)")
    ap.add_argument("--exec-n", type=int, default=300, help="`true` round trips timed (default 300)")
    ap.add_argument("--train-tokens", type=int, default=32768, help="segment length of the training step")
    ap.add_argument("--no-train", action="store_true", help="skip the training-step peak RSS")
    ap.add_argument("--every", type=int, default=20, help="print every Nth turn in the table (default 20)")
    ap.add_argument(
        "--cut-every",
        type=int,
        default=2,
        help="live training: turns between cuts of the open episode (default 2: a default cluster's 16-turn "
        "batch over 8 actors)",
    )
    ap.add_argument(
        "--exact-turns",
        type=int,
        default=80,
        help="live training: also train the first N turns with --prefix-kv exact, for comparison (0: skip)",
    )
    ap.add_argument("--cos-every", type=int, default=20, help="steps between gradient checks against exact")
    ap.add_argument(
        "--critic",
        choices=("shared", "detached"),
        default="detached",
        help="live training's --critic (default detached, the learner's; shared: the value loss also trains the "
        "trunk, and needs the gradient path through the kept keys that reuse omits)",
    )
    ap.add_argument(
        "--max-context",
        type=int,
        default=EpisodeOptions().max_context,
        help=f"the episode's context budget in tokens (default {EpisodeOptions().max_context}, cluster up's); past "
        "it the actors' default context policy compacts the history (32768: a 320-turn episode is never compacted)",
    )
    ap.add_argument("--no-live", action="store_true", help="skip live training (ingest, exec and 32k peak only)")
    ap.add_argument(
        "--ranks",
        type=int,
        default=1,
        help="live training on this many learner ranks (FSDP2, as --learner-procs N; default 1; N > 1 skips the "
        "gradient cosine)",
    )
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    ap.add_argument("--train-child", type=int, default=0, help=argparse.SUPPRESS)
    add_model_arg(ap)
    a = ap.parse_args(argv)
    configure(level="warning")  # logs to stderr; stdout is the table and the JSON line
    model = model_dir(a.model)
    if a.train_child:
        train_step_child(a.train_child, model)
        return 0
    if a.turns < 2 * EARLY[1]:
        ap.error(f"--turns must be >= {2 * EARLY[1]}: the last 20 turns are compared with turns {EARLY[0]}-{EARLY[1]}")
    late = (a.turns - 20, a.turns)

    with tempfile.TemporaryDirectory(prefix="t1-longhorizon-") as tmp:
        run = anyio.run(run_episode_over_nats, a.turns, Path(tmp), model, a.max_context, backend="trio")
        replay_ingest(run, a.replays, MoEConfig.load(model).n_experts)
        exec_ms = anyio.run(exec_true_ms, a.exec_n, Path(tmp), backend="trio")
    train = None if a.no_train else train_peak(a.train_tokens, model)
    lives: list[LiveRun] = []
    if not a.no_live:
        lives.append(
            train_live(
                run.payloads,
                model_dir=model,
                prefix="reuse",
                cut_every=a.cut_every,
                upto=a.turns,
                cos_every=a.cos_every,
                critic=a.critic,
                ranks=a.ranks,
            )
        )
        if a.exact_turns:
            lives.append(
                train_live(
                    run.payloads,
                    model_dir=model,
                    prefix="exact",
                    cut_every=a.cut_every,
                    upto=a.exact_turns,
                    cos_every=0,
                    critic=a.critic,
                    ranks=a.ranks,
                )
            )

    rows = run.rows
    max_turn = max(rows) + 1 if rows else 0
    grid = [
        (t, r.context, r.wire_bytes, r.ingest_live_s * 1e6, r.ingest_best_s * 1e6, r.encode_s * 1e6, r.exec_s * 1e3)
        for t, r in sorted(rows.items())
        if t % a.every == 0 or t == max_turn - 1
    ]
    header = ("turn", "context", "wire B", "ingest us (live)", "ingest us (best)", "actor encode us", "exec ms")
    print_grid(header, grid, title=f"one {max_turn}-turn episode (ended: {run.reason}), real bwrap + nats-server")
    early_best, late_best = _window(rows, *EARLY, "ingest_best_s"), _window(rows, *late, "ingest_best_s")
    early_live, late_live = _window(rows, *EARLY, "ingest_live_s"), _window(rows, *late, "ingest_live_s")
    res = {
        "max_turn": max_turn,
        "ingest_ratio_late_early": late_best / early_best,
        "ingest_ratio_late_early_live": late_live / early_live,
        "ingest_early_us": early_best * 1e6,
        "ingest_late_us": late_best * 1e6,
        "wire_bytes_early": _window(rows, *EARLY, "wire_bytes"),
        "wire_bytes_late": _window(rows, *late, "wire_bytes"),
        "context_late": _window(rows, *late, "context"),
        "max_context": a.max_context,
        "actor_encode_ratio_late_early": _window(rows, *late, "encode_s") / _window(rows, *EARLY, "encode_s"),
        "turn_exec_p50_ms": float(np.median([r.exec_s for r in rows.values()])) * 1e3,
        "exec_p50_ms": float(np.percentile(exec_ms, 50)),
        "exec_p99_ms": float(np.percentile(exec_ms, 99)),
        "drift": run.drift,
        "train_peak_rss_gb_32k": None if train is None else train["peak_gb"],
        "train_step_s": None if train is None else train["step_s"],
        "train_tokens": a.train_tokens,
        "ranks": a.ranks,
    }
    table = [
        ("turns", max_turn),
        (f"ingest us, turns {EARLY[0]}-{EARLY[1]} (median of best)", res["ingest_early_us"]),
        (f"ingest us, turns {late[0]}-{late[1]} (median of best)", res["ingest_late_us"]),
        ("ingest ratio late/early (target <= 1.5)", res["ingest_ratio_late_early"]),
        ("ingest ratio late/early, live", res["ingest_ratio_late_early_live"]),
        ("wire bytes/turn early -> late", f"{res['wire_bytes_early']:.0f} -> {res['wire_bytes_late']:.0f}"),
        ("context at the late turns (tokens)", f"{res['context_late']:.0f} (--max-context {a.max_context})"),
        ("actor encode ratio late/early", res["actor_encode_ratio_late_early"]),
        ("exec `true` p50 / p99 ms (target p50 <= 10)", f"{res['exec_p50_ms']:.2f} / {res['exec_p99_ms']:.2f}"),
        ("turn command exec p50 ms", res["turn_exec_p50_ms"]),
    ]
    if train is not None:
        table.append((f"train step peak RSS GB, {a.train_tokens} tokens (target < 4)", train["peak_gb"]))
        table.append(("train step s", train["step_s"]))
    for lv in lives:
        last = max(lv.per_turn) + 1 if lv.per_turn else 0
        lo, hi = (max(last - 20, 0), last)
        early_us, late_us = _median_turns(lv, *EARLY, "step_us_per_new"), _median_turns(lv, lo, hi, "step_us_per_new")
        key = "" if lv.prefix == "reuse" else "_exact"
        res[f"forwarded_per_trained_token{key}"] = lv.forwarded / max(lv.new, 1)
        res[f"backward_per_trained_token{key}"] = lv.backward / max(lv.new, 1)
        res[f"step_time_ratio_late_early{key}"] = late_us / early_us
        res[f"live_turns{key}"] = last
        res[f"live_steps{key}"] = lv.steps
        res[f"live_seconds{key}"] = lv.seconds
        res[f"step_us_per_trained_early{key}"] = early_us
        res[f"step_us_per_trained_late{key}"] = late_us
        if lv.prefix == "reuse":
            res["grad_cosine_to_exact"] = [{"turn": t, "age": age, "cosine": c} for t, age, c in lv.cosines]
            res["grad_cosine_min"] = min((c for *_, c in lv.cosines), default=None)
        label = f"--prefix-kv {lv.prefix}, turns 0-{last} cut every {a.cut_every}, {a.ranks} rank(s)"
        table.append((f"{label}: forwarded / trained token (target <= 3)", res[f"forwarded_per_trained_token{key}"]))
        table.append((f"{label}: backward / trained token", res[f"backward_per_trained_token{key}"]))
        table.append(
            (
                f"{label}: step us / trained token, turns {EARLY[0]}-{EARLY[1]} -> {lo}-{hi} (ratio target <= 1.5)",
                f"{early_us:.1f} -> {late_us:.1f} (x{late_us / early_us:.2f})",
            )
        )
        if lv.cosines:
            table.append(
                (
                    f"{label}: gradient cosine to exact (turn/age/cos)",
                    " ".join(f"{t}/{age}/{c:.3f}" for t, age, c in lv.cosines),
                )
            )
        live_grid = [
            (
                t,
                f"{r['fwd_per_new']:.2f}",
                f"{r['bwd_per_new']:.2f}",
                f"{r['step_us_per_new']:.1f}",
                f"{r['step_s']:.2f}",
            )
            for t, r in sorted(lv.per_turn.items())
            if t % a.every == 0
        ]
        print_grid(("turn", "fwd/new", "bwd/new", "step us/new", "step s"), live_grid, title=f"live training, {label}")
    print_table("bench.longhorizon", table)
    if a.json:
        emit_json(res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
