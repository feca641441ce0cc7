"""Long-horizon episodes: the context policy (sandbox_agent/agent/context.py), empty outputs, and one 350-turn
episode through the real actor loop, memory transport, real learner service and a real bwrap sandbox.

The scripted sampler here routes like a real MoE: the experts of position p depend on every token up to p
(a hash of the prefix), so a row reused from a different context, or a row never asked for, is caught.
"""

from __future__ import annotations

from pathlib import Path

import anyio
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as hst

from actors.actor import run_actor
from actors.settings import ActorSettings
from sandbox_agent.agent.context import OMITTED, ContextConfig, History, TruncateObservations, make_policy
from sandbox_agent.agent.loop import run_agent
from sandbox_agent.agent.types import AgentConfig, TurnResult
from sandbox_agent.sandbox import MemorySandbox
from sandbox_agent.synth import generate
from sandbox_agent.tasks.verifier import VerifyResult
from t1async.learner.service import Learner
from t1async.learner.settings import LearnerConfig
from t1async.model.tokenizer import ChatTokenizer
from t1async.protocol import wire
from t1async.protocol.errors import ConfigError
from t1async.protocol.sampling import Generation, SamplingParams, common_prefix_len
from t1async.testing.models import tiny_model_dir
from t1async.transport import MemoryBroker, MemoryTransport

LAYERS, TOPK, EXPERTS = 2, 2, 4
PAIRS = [(a, b) for a in range(EXPERTS) for b in range(a + 1, EXPERTS)]
MASK = (1 << 61) - 1


def prefix_routing(tokens) -> np.ndarray:
    """[len, LAYERS, TOPK] u1: the experts of position p are a function of tokens[0..p] (all of them)."""
    out = np.empty((len(tokens), LAYERS, TOPK), dtype=np.uint8)
    h = 1469598103934665603
    for p, t in enumerate(tokens):
        h = ((h * 1099511628211) ^ (int(t) + 1)) & MASK
        for layer in range(LAYERS):
            out[p, layer] = PAIRS[(h >> (7 * layer + 3)) % len(PAIRS)]
    return out


class ScriptedMoESampler:
    """Replies ``script(k)`` (the k-th call) as a fenced bash block + <|im_end|>, with prefix-dependent routing
    and per-call logprobs; ``empty_at`` calls return no tokens (``finish`` as given)."""

    def __init__(self, tok, script, *, empty_at: dict[int, str] | None = None) -> None:
        self.tok, self.script, self.empty_at = tok, script, dict(empty_at or {})
        self.weight_version = 0
        self.calls: list[dict] = []

    async def update_weights_from_disk(self, path: str, version: int) -> None:
        self.weight_version = int(version)

    async def generate(
        self, input_ids, params: SamplingParams, *, routed_experts_start_len=None, rid=None
    ) -> Generation:
        k = len(self.calls)
        ids = [int(t) for t in input_ids]
        assert len(ids) + params.max_new_tokens <= 4096
        if k in self.empty_at:
            out, finish = [], self.empty_at[k]
        else:
            out = self.tok.encode(f"```bash\n{self.script(k)}\n```") + [self.tok.end_of_turn_id]
            finish = "stop" if len(out) <= params.max_new_tokens else "length"
            out = out[: params.max_new_tokens]
        start = routed_experts_start_len or 0
        full = ids + out
        routing = prefix_routing(full[:-1])[start:] if routed_experts_start_len is not None else None
        lps = -np.random.default_rng(k).uniform(0.01, 3.0, len(out)).astype(np.float32)
        self.calls.append({"input": ids, "out": out, "logprobs": lps, "start": routed_experts_start_len})
        await anyio.lowlevel.checkpoint()
        return Generation(
            output_ids=np.asarray(out, dtype=np.int32),
            logprobs=lps,
            finish=finish,
            policy_version=self.weight_version,
            routing=routing,
            routing_start=start,
        )

    async def aclose(self) -> None:
        pass


# --------------------------------------------------------------------------------------------- the policy


async def _agent_episode(tok, script, *, turns: int, max_context: int, context: ContextConfig, empty_at=None):
    sampler = ScriptedMoESampler(tok, script, empty_at=empty_at)
    sb = MemorySandbox(lambda c: "\n".join(f"line {i} of {c}" for i in range(6)))
    seen: list[TurnResult] = []

    async def on_turn(t: TurnResult) -> None:
        seen.append(t)

    async def verify() -> VerifyResult:
        return VerifyResult.from_tests({"a": True, "b": False})

    cfg = AgentConfig(
        max_turns=turns, max_context_tokens=max_context, context=context, sampling=SamplingParams(max_new_tokens=48)
    )
    res = await run_agent(
        instruction="Count the lines.",
        sampler=sampler,
        tokenizer=tok,
        sandbox=sb,
        verify=verify,
        config=cfg,
        on_turn=on_turn,
    )
    return res, seen, sampler


async def test_truncate_observations_keeps_going_from_exact_ids():
    tok = ChatTokenizer.load()
    res, seen, sampler = await _agent_episode(
        tok,
        lambda k: f"wc -l notes{k}.txt",
        turns=120,
        max_context=1500,
        context=ContextConfig(keep_last=4, compact_to=0.6),
    )
    assert res.reason == "max_turns" and res.turns == 120
    compacted = [t.turn for t in seen if t.compacted]
    assert res.compactions == len(compacted) >= 3
    assert len(compacted) <= 120 // 5  # compacting to half the window leaves room for many turns each time
    head = sampler.calls[0]["input"]
    task = head[: len(head) - len(tok.generation_prompt_ids())]  # system prompt and task
    for k, call in enumerate(sampler.calls):
        assert len(call["input"]) <= 1500 - 16  # room for min_new_tokens, always
        if k == 0:
            continue
        prev = sampler.calls[k - 1]["input"] + sampler.calls[k - 1]["out"]
        if k in compacted:
            # a FORK by construction: the system prompt and task stay, the rest is rebuilt from exact IDs
            lcp = common_prefix_len(np.asarray(call["input"]), np.asarray(prev))
            assert lcp < len(prev) and call["input"][: len(task)] == task
            assert call["start"] == lcp  # routing is asked for every position of the new context
            ins = call["input"]
            for j in range(max(0, k - 4), k):  # the last K turns whole: outputs as sampled, observations whole
                out = sampler.calls[j]["out"]
                assert any(ins[i : i + len(out)] == out for i in range(len(ins) - len(out) + 1)), (k, j)
                assert tok.decode(tok.message_ids("user", seen[j].observation)) in tok.decode(ins)
            assert OMITTED in tok.decode(ins)
        else:
            assert call["input"][: len(prev)] == prev and call["start"] == len(prev) - 1  # CLEAN


async def test_stop_policy_ends_with_context():
    tok = ChatTokenizer.load()
    res, seen, _ = await _agent_episode(
        tok, lambda k: f"wc -l notes{k}.txt", turns=120, max_context=1500, context=ContextConfig(policy="stop")
    )
    assert res.reason == "context" and res.compactions == 0 and not any(t.compacted for t in seen)
    assert res.turns < 120


def test_unknown_policy_is_a_clear_error():
    with pytest.raises(ConfigError, match="unknown context policy 'summarize'.*truncate-observations, stop"):
        ContextConfig(policy="summarize")
    assert make_policy(ContextConfig(policy="stop")).name == "stop"


def test_history_drops_oldest_turns_when_shortening_is_not_enough():
    tok = ChatTokenizer.load()
    head = tok.render([{"role": "system", "content": "s"}, {"role": "user", "content": "task"}])
    h = History(tok, head)
    for k in range(30):
        out = tok.encode(f"echo {k} " + "x" * 80) + [tok.end_of_turn_id]
        h.add(
            out,
            f"[exit code: 0]\n{k}",
            tok.bridge_ids(out) + tok.message_ids("user", f"[exit code: 0]\n{k}") + tok.generation_prompt_ids(),
        )
    ids = TruncateObservations(keep_last=3).compact(h, limit=600, target=400)
    assert ids is not None and len(ids) <= 400 and h.dropped > 0
    text = tok.decode(ids)
    assert f"[{h.dropped} earlier turns were dropped" in text and text.startswith(
        tok.decode(head[: -len(tok.generation_prompt_ids())])
    )
    assert "echo 29 " in text and "echo 0 " not in text
    assert TruncateObservations(keep_last=3).compact(History(tok, head), limit=len(head) - 1, target=10) is None


# --------------------------------------------------------------------------------------------- 350 turns


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return tiny_model_dir(
        tmp_path_factory.mktemp("model"), n_layers=LAYERS, n_experts=EXPERTS, top_k=TOPK, max_seq_len=4096
    )


def lh_script(k: int) -> str:
    if k == 0:
        return "export LH_MARK=kept-at-turn-1 && mkdir -p lh/deep && cd lh/deep"
    if k == 349:
        return 'echo "mark=$LH_MARK cwd=$(pwd)"'
    return f"echo turn {k}; seq {k} {k + k % 7}"


@pytest.mark.slow
async def test_350_turns_through_actor_and_learner(tmp_path, tiny_model):
    tasks = tmp_path / "tasks"
    generate(tasks, 1, seed=3, families=["files"])
    tok = ChatTokenizer.load()
    sampler = ScriptedMoESampler(tok, lh_script)
    broker = MemoryBroker()
    B, TURNS = 35, 350
    lcfg = LearnerConfig(
        run_dir=tmp_path / "run",
        model=tiny_model,
        max_staleness=0,
        batch_turns=B,
        steps=TURNS // B,
        lease=120.0,
        metrics_every_s=0.5,
        lr=1e-3,
    )
    agent = AgentConfig(
        max_turns=TURNS,
        max_context_tokens=1536,
        command_timeout_s=10.0,
        wall_time_s=600.0,
        sampling=SamplingParams(max_new_tokens=48, stop_token_ids=tuple(tok.eos_ids)),
    )
    records: list = []
    steps: list[list] = []
    async with MemoryTransport(broker) as lt, MemoryTransport(broker) as at, MemoryTransport(broker) as mt:
        learner = Learner(lcfg, lt, sampler)
        real_step = learner.trainer.step

        def recording_step(segments, version, **kw):
            steps.append(list(segments))
            return real_step(segments, version, **kw)

        learner.trainer.step = recording_step
        async with mt.subscribe("t1.traj.>") as sub, anyio.create_task_group() as tg:

            async def watch():
                async for m in sub:
                    records.append(m.record)

            tg.start_soon(watch)
            await tg.start(learner.run)
            stats = await run_actor(
                ActorSettings(actor_id="lh", tasks=tasks, concurrency=1, split="all", episodes=1),
                transport=at,
                sampler=sampler,
                tokenizer=tok,
                agent=agent,
            )
            with anyio.fail_after(120):
                while learner.state.step < TURNS // B or not any(isinstance(r, wire.EndRecord) for r in records):
                    await anyio.sleep(0.1)
            tg.cancel_scope.cancel()
    learner.journal.close()

    turns = [r for r in records if isinstance(r, wire.TurnRecord)]
    end = next(r for r in records if isinstance(r, wire.EndRecord))
    assert [r.turn for r in turns] == list(range(TURNS)) and stats.done == 1
    assert end.reason is wire.EndReason.MAX_TURNS and end.turns == TURNS
    # the shell state set at turn 1 is still there at turn 350
    assert "mark=kept-at-turn-1" in turns[-1].observation and "lh/deep" in turns[-1].observation

    # FORKs only at compactions: every other boundary extends the assembled sequence exactly
    compacted = {r.turn for r in turns if r.compacted}
    assert len(compacted) >= 5 and end.compactions == stats.compactions == len(compacted)
    for prev, r in zip(turns, turns[1:]):
        prev_len = prev.input_len + len(prev.output_ids)
        assert (r.keep < prev_len) == (r.turn in compacted), r.turn
    drift = learner.assembler.stats()
    assert drift.fork == drift.compactions == len(compacted) and drift.realign == 0
    assert drift.clean == TURNS - 1 - len(compacted) and drift.untrainable_turns == 0
    assert learner.metrics()["compactions"] == len(compacted)
    rs = learner.assembler.routing_stats()
    assert rs.gap_rows == rs.missing_rows == rs.rejected_traces == 0

    # every turn trained exactly once, each loss token the sampled ID with its logprob and its routing
    trained: list[tuple[str, int]] = []
    for segs in steps:
        for s in segs:
            ids = np.unique(s.turn_ids[s.loss_mask])
            trained += [(s.episode, int(t)) for t in ids]
            for t in ids:
                call = sampler.calls[int(t)]
                at_t = s.loss_mask & (s.turn_ids == t)
                assert s.tokens[at_t].tolist() == call["out"]  # loss-region drift 0
                assert np.array_equal(s.logprobs[at_t], call["logprobs"])
            want = prefix_routing(s.tokens[:-1])  # the routes the sampler used, in this segment's context
            assert s.routing is not None and np.array_equal(s.routing[:-1], want.astype(np.int16))
    assert sorted(trained) == sorted(set(trained)) and len(trained) == TURNS
    assert learner.state.turns_trained == TURNS


def test_context_policy_flags_reach_the_actors(tmp_path):
    from actors.__main__ import build_parser, settings
    from t1async.cluster.components import specs
    from t1async.cluster.config import UpConfig

    with pytest.raises(ConfigError, match="--context-policy 'summarize' is not one of: truncate-observations, stop"):
        UpConfig(run_dir=tmp_path, context_policy="summarize").check()
    cfg = UpConfig(
        run_dir=tmp_path, sampler_url=("http://127.0.0.1:1",), context_policy="stop", context_keep_turns=3
    ).check()
    actor = next(s for s in specs(cfg, "nats://127.0.0.1:1") if s.name == "actor-0")
    argv = actor.argv[actor.argv.index("actors") + 1 :]
    p = build_parser()
    args = settings(p.parse_args(argv), p)  # what the actor reads from the --config file cluster up wrote
    assert (args.context_policy, args.context_keep_turns) == ("stop", 3)


async def test_empty_outputs_are_never_silently_dropped(tmp_path, tiny_model):
    """A sample with no tokens is no wire turn: its credit pays for the next sample, its reward reaches the
    next turn or the end, and a credit still unspent when the episode ends is released by the end record
    (before: the turn was dropped, the next turns' numbers had a gap the learner waited on forever, the
    credit was held until its lease ran out, and the final reward was lost)."""
    tasks = tmp_path / "tasks"
    solution = generate(tasks, 1, seed=3, families=["files"])[0] / "solution.sh"
    solve = "\n".join(ln for ln in solution.read_text().splitlines() if not ln.startswith(("#!", "set -e")))
    tok = ChatTokenizer.load()
    script = {6: solve}
    # call 3 returns nothing mid-episode; call 7 (after the solution ran) is aborted before its first token
    sampler = ScriptedMoESampler(tok, lambda k: script.get(k, f"echo {k}"), empty_at={3: "stop", 7: "abort"})
    broker = MemoryBroker()
    lcfg = LearnerConfig(
        run_dir=tmp_path / "run",
        model=tiny_model,
        max_staleness=0,
        batch_turns=3,
        steps=0,
        lease=600.0,
        metrics_every_s=0.5,
    )
    agent = AgentConfig(
        max_turns=20,
        max_context_tokens=4000,
        command_timeout_s=10.0,
        sampling=SamplingParams(max_new_tokens=400, stop_token_ids=tuple(tok.eos_ids)),
    )
    records: list = []
    async with MemoryTransport(broker) as lt, MemoryTransport(broker) as at, MemoryTransport(broker) as mt:
        learner = Learner(lcfg, lt, sampler)
        async with mt.subscribe("t1.traj.>") as sub, anyio.create_task_group() as tg:

            async def watch():
                async for m in sub:
                    records.append(m.record)

            tg.start_soon(watch)
            tg.start_soon(learner.run)
            with anyio.fail_after(120):  # before the fix: the actor waited for a credit the learner never freed
                stats = await run_actor(
                    ActorSettings(actor_id="em", tasks=tasks, concurrency=1, split="all", episodes=1),
                    transport=at,
                    sampler=sampler,
                    tokenizer=tok,
                    agent=agent,
                )
            ledger = learner.gate.ledger
            with anyio.fail_after(60):  # the unspent credit is released by the end, not by its 600 s lease
                while learner.state.step < 2 or ledger.running or ledger.stats.released < 1:
                    await anyio.sleep(0.05)
            tg.cancel_scope.cancel()
    learner.journal.close()
    turns = [r for r in records if isinstance(r, wire.TurnRecord)]
    end = next(r for r in records if isinstance(r, wire.EndRecord))
    assert len(sampler.calls) == 8 and stats.empty_outputs == 2
    assert [r.turn for r in turns] == list(range(6)) and end.turns == 6 and end.reason is wire.EndReason.ABORTED
    assert end.tests_passed > 0 and sum(r.reward for r in turns) + end.unstreamed_reward == end.tests_passed
    assert (ledger.stats.granted, ledger.stats.delivered, ledger.stats.released) == (7, 6, 1)
    assert learner.state.turns_trained == 6
    rs = learner.assembler.routing_stats()
    assert rs.gap_rows == rs.missing_rows == 0  # the empty sample's rows were asked again by the next one


def test_tail_names_a_compaction_not_drift():
    from t1async.cluster.observe.tail import Formatter
    from t1async.transport.base import Message

    fmt = Formatter(text=False)

    def line(rec) -> str:
        return fmt.line(Message("t1.traj.e", b"", rec))

    base = dict(
        episode="e",
        policy_version=0,
        output_ids=np.array([5, 6], np.int32),
        input_digest=b"0" * 16,
        output_logprobs=np.zeros(2, np.float32),
        finish=wire.Finish.STOP,
        routing=None,
        reward=0.0,
        tests_passed=-1,
        t_sample_s=0.1,
        t_exec_s=0.0,
    )
    line(wire.TurnRecord(turn=0, keep=0, input_delta=np.arange(10, dtype=np.int32), input_len=10, **base))
    comp = line(
        wire.TurnRecord(turn=1, keep=4, input_delta=np.arange(3, dtype=np.int32), input_len=7, compacted=True, **base)
    )
    assert "prev=12 COMPACTED keep-prev=-8" in comp and "DRIFT" not in comp
    end = line(wire.EndRecord("e", 2, wire.EndReason.MAX_TURNS, 0, 3, False, compactions=1))
    assert "reason=max_turns" in end and "compactions=1" in end


class GatedSampler(ScriptedMoESampler):
    """Holds every turn for ``hold_s`` before sampling, as a CreditedSampler does: ``gate`` True exposes the
    hold as ``wait_turn`` (credits; ``generate`` takes it itself if the caller did not), False keeps it
    inside ``generate`` (a slow sampler)."""

    def __init__(self, tok, script, *, hold_s: float, gate: bool) -> None:
        super().__init__(tok, script)
        self.hold_s, self.held = hold_s, False
        if gate:
            self.wait_turn = self._wait_turn

    async def _wait_turn(self) -> None:
        if not self.held:
            await anyio.sleep(self.hold_s)
            self.held = True

    async def generate(self, input_ids, params, *, routed_experts_start_len=None, rid=None) -> Generation:
        if hasattr(self, "wait_turn"):
            await self.wait_turn()
            self.held = False
        else:
            await anyio.sleep(self.hold_s)
        return await super().generate(input_ids, params, routed_experts_start_len=routed_experts_start_len, rid=rid)


@pytest.mark.parametrize("gate", [True, False])
async def test_credit_waits_are_not_the_agents_wall_time(autojump_clock, gate):
    """Five turns each held 60 s by the learner's backpressure fit a 100 s wall time (the episode was paused);
    the same 60 s spent inside the sampler does not."""
    tok = ChatTokenizer.load()
    sampler = GatedSampler(tok, lambda k: f"echo {k}", hold_s=60.0, gate=gate)
    sb = MemorySandbox(lambda c: "ok")

    async def verify() -> VerifyResult:
        return VerifyResult.from_tests({"a": True})

    cfg = AgentConfig(max_turns=5, wall_time_s=100.0, sampling=SamplingParams(max_new_tokens=32))
    res = await run_agent(instruction="x", sampler=sampler, tokenizer=tok, sandbox=sb, verify=verify, config=cfg)
    if gate:
        assert res.reason == "max_turns" and res.turns == 5 and res.paused_s == pytest.approx(300.0)
    else:
        assert res.reason == "timeout" and res.turns == 1 and res.paused_s == 0


@settings(max_examples=60, deadline=None)
@given(
    sizes=hst.lists(hst.tuples(hst.integers(1, 60), hst.integers(0, 400)), min_size=1, max_size=40),
    keep=hst.integers(0, 10),
    limit=hst.integers(200, 1500),
    frac=hst.floats(0.2, 1.0),
)
def test_compaction_property(sizes, keep, limit, frac):
    """Whatever the turn sizes: a compaction fits the limit or gives up (None), keeps the system prompt and
    task, is built from the turns' exact output IDs, and a second compaction never undoes the first."""
    tok = ChatTokenizer.load()
    head = tok.render([{"role": "system", "content": "sys"}, {"role": "user", "content": "the task"}])
    h = History(tok, head)
    outs = []
    for k, (n_out, n_obs) in enumerate(sizes):
        out = [7 + (k % 50)] * n_out + [tok.end_of_turn_id]
        obs = "[exit code: 0]\n" + "z" * n_obs
        outs.append(out)
        h.add(out, obs, tok.bridge_ids(out) + tok.message_ids("user", obs) + tok.generation_prompt_ids())
    policy = TruncateObservations(keep_last=keep)
    first = policy.compact(h, limit, int(limit * frac))
    if first is None:
        return
    assert len(first) <= limit
    task = head[: -len(tok.generation_prompt_ids())]
    assert first[: len(task)] == task and first[-len(tok.generation_prompt_ids()) :] == tok.generation_prompt_ids()
    states = [t.state for t in h.turns]
    for t, out in zip(h.turns, outs):  # every turn still present shows its sampled IDs, unchanged
        if t.state != "dropped":
            assert any(first[i : i + len(out)] == out for i in range(len(first) - len(out) + 1))
    second = policy.compact(h, limit, int(limit * frac))
    assert second is not None and len(second) <= len(first)
    assert all(a == b or a == "whole" or b == "dropped" for a, b in zip(states, (t.state for t in h.turns)))
