"""Poison records: a record no step could use is dead-lettered with its reason, its episode stops there, and
the learner keeps training, also across a restart (design §3, §7). The old learner journaled such a record,
raised BatchError out of Trainer.step, and died again on every restart replaying it."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import anyio
import numpy as np
import pytest
import torch

from t1async.ingest.validate import ModelLimits, check_turn
from t1async.learner.service import Learner
from t1async.learner.settings import LearnerConfig
from t1async.model.config import MoEConfig
from t1async.protocol import wire
from t1async.protocol.errors import WireError
from t1async.testing.episodes import Sizes, make_episode
from t1async.testing.models import tiny_model_dir
from t1async.transport import MemoryBroker, MemoryTransport
from t1async.transport.base import HDR_DEAD_ERROR, HDR_DEAD_REASON, traj_subject

LAYERS, TOPK, EXPERTS = 2, 2, 4


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return tiny_model_dir(tmp_path_factory.mktemp("model"), n_layers=LAYERS, n_experts=EXPERTS, top_k=TOPK)


def episode(name: str, seed: int, turns: int = 4, policy_version: int = 0) -> list:
    rng = np.random.default_rng(seed)
    case = make_episode(
        rng,
        ["clean"] * (turns - 1),
        episode=name,
        sizes=Sizes(prompt=(5, 12), output=(2, 6), observation=(1, 4), vocab=300),
        layers=LAYERS,
        topk=TOPK,
        num_experts=EXPERTS,
    )
    # sampled by the version the learner serves when they are published
    return [replace(r, policy_version=policy_version) if isinstance(r, wire.TurnRecord) else r for r in case.records]


def spoil(rec: wire.TurnRecord, kind: str, vocab: int) -> wire.TurnRecord:
    """``rec`` with one defect that passes wire validation but that no training step could use."""
    if kind == "logprob":  # what SGLangClient makes of a null logprob
        lps = rec.output_logprobs.copy()
        lps[-1] = np.nan
        return replace(rec, output_logprobs=lps)
    if kind == "token_range":
        out = rec.output_ids.copy()
        out[0] = vocab
        return replace(rec, output_ids=out)
    ex = rec.routing.experts.copy()
    if kind == "expert_range":
        ex[0, 1, 0] = EXPERTS
    elif kind == "expert_repeat":
        ex[0, 0, 1] = ex[0, 0, 0]
    elif kind == "routing_shape":  # routed by a model with one more layer
        ex = np.concatenate([ex, ex[:, :1]], axis=1)
    return replace(rec, routing=wire.Routing(rec.routing.start, ex))


KINDS = ["logprob", "token_range", "expert_range", "expert_repeat", "routing_shape"]
BAD_AT = {"routing_shape": 0}  # a segment takes its routing shape from its first trace: poison that one


def good(first: int, policy_version: int = 0, n: int = 4) -> list:
    return [r for i in range(first, first + n) for r in episode(f"good{i}", i, policy_version=policy_version)]


def workload(vocab: int) -> tuple[list, dict[str, wire.TurnRecord]]:
    """Good episodes and one bad episode per kind (bad at turn 2, turn 3 follows), interleaved."""
    eps = [episode(f"good{i}", i) for i in range(6)]
    bad: dict[str, wire.TurnRecord] = {}
    for j, kind in enumerate(KINDS):
        recs = episode(f"bad-{kind.replace('_', '-')}", 100 + j)
        k = BAD_AT.get(kind, 2)
        recs[k] = bad[kind] = spoil(recs[k], kind, vocab)
        eps.append(recs)
    out = []
    for i in range(max(len(e) for e in eps)):
        out += [e[i] for e in eps if i < len(e)]
    return out, bad


async def run_learner(
    run: Path, model: Path, broker: MemoryBroker, steps: int, dead: list, *, patch=None, waves: tuple[list, ...] = ()
) -> Learner:
    """Run a learner until ``steps``; ``waves[i]`` is published once it has tried i + 1 steps in this run (a
    step takes every closed segment there is, so each later step needs new turns)."""
    cfg = LearnerConfig(
        run_dir=run,
        model=model,
        batch_turns=4,
        steps=steps,
        max_staleness=1,
        metrics_every_s=60,
        lr=1e-3,
    )
    async with MemoryTransport(broker) as lt, MemoryTransport(broker) as wt:
        learner = Learner(cfg, lt, None)
        if patch is not None:
            patch(learner)
        async with wt.subscribe("t1.dead.>", include_malformed=True) as sub, anyio.create_task_group() as tg:
            barrier = anyio.Event()

            async def watch():
                async for m in sub:
                    if m.subject == "t1.dead.test-barrier":
                        barrier.set()  # delivery is in order: every dead letter published before it is in `dead`
                    else:
                        dead.append(m)

            def tried() -> int:
                return learner.state.step + learner.poison.failed_steps

            async def feed():
                start = tried()
                for i, wave in enumerate(waves):
                    while tried() < start + i + 1:
                        await anyio.sleep(0.05)
                    for r in wave:
                        await wt.publish(traj_subject(r.episode), r)

            tg.start_soon(watch)
            tg.start_soon(feed)
            with anyio.fail_after(150):
                await learner.run()
                await wt.publish("t1.dead.test-barrier", wire.Heartbeat("test", 0.0))
                await barrier.wait()
            tg.cancel_scope.cancel()
    learner.journal.close()
    return learner


async def publish(broker: MemoryBroker, records: list) -> None:
    async with MemoryTransport(broker) as t:
        for r in records:
            await t.publish(traj_subject(r.episode), r)


async def test_each_kind_of_bad_record_is_dead_lettered_and_the_learner_keeps_training(tmp_path, tiny_model):
    vocab = MoEConfig.load(tiny_model / "config.json").vocab_size
    records, bad = workload(vocab)
    broker = MemoryBroker()
    await publish(broker, records)
    dead: list = []
    first = await run_learner(tmp_path / "run", tiny_model, broker, 3, dead, waves=(good(10, 1), good(20, 2)))
    assert first.state.step == 3

    # the dead-letter subject holds each bad record, and says why
    by_reason = {m.headers[HDR_DEAD_REASON]: m for m in dead}
    assert sorted(by_reason) == sorted(KINDS)
    for kind, rec in bad.items():
        m = by_reason[kind]
        assert m.subject == f"t1.dead.{kind}" and f"{rec.episode}#{rec.turn}" in m.headers[HDR_DEAD_ERROR]
        assert wire.records_equal(m.record, rec)

    # the bad turn and the one after it are never trained, and every one is settled (its credit released)
    poisoned = {(r.episode, r.turn) for r in bad.values()} | {(r.episode, 3) for r in bad.values()}
    trained = {(ep, t) for ep, ts in first.state.trained.items() for t in ts}
    assert not trained & poisoned
    assert first.poison.metrics()["dead"] == dict.fromkeys(KINDS, 1)
    assert first.poison.dropped_turns == sum(3 - BAD_AT.get(k, 2) for k in KINDS)
    assert first.settler.counts["poisoned"] == sum(4 - BAD_AT.get(k, 2) for k in KINDS)
    assert not [k for k in first.untrained if k in poisoned]

    # a restart comes up on the same run dir, trains on, and never sees the bad records again
    dead.clear()
    await publish(broker, good(30, 3))
    second = await run_learner(tmp_path / "run", tiny_model, broker, 5, dead, waves=(good(40, 4),))
    assert second.state.step == 5 and not dead
    trained = {(ep, t) for ep, ts in second.state.trained.items() for t in ts}
    assert not trained & poisoned
    # the turns before a poisoned one still train (the episode stops there, as a cut)
    assert ("bad-logprob", 0) in trained or ("bad-logprob", 1) in trained or second.untrained


async def test_a_journal_from_before_validation_with_a_bad_record_replays_without_a_crash(tmp_path, tiny_model):
    """A run dir whose journal holds a NaN-logprob turn (journaled unscreened): the learner used to die on it
    at every restart. Now replay dead-letters it and trains the rest."""
    from t1async.ingest.journal import Journal

    vocab = MoEConfig.load(tiny_model / "config.json").vocab_size
    records, bad = workload(vocab)
    j = Journal(tmp_path / "run" / "learner" / "journal")
    j.append(records)
    j.close()
    dead: list = []
    broker = MemoryBroker()
    learner = await run_learner(tmp_path / "run", tiny_model, broker, 2, dead, waves=(good(10, 1),))
    assert learner.state.step == 2
    assert sorted(m.headers[HDR_DEAD_REASON] for m in dead) == sorted(KINDS)


async def test_a_step_that_raises_dead_letters_its_segments_and_is_never_retried(tmp_path, tiny_model):
    vocab = MoEConfig.load(tiny_model / "config.json").vocab_size
    records, _ = workload(vocab)
    broker = MemoryBroker()
    await publish(broker, [r for r in records if not r.episode.startswith("bad")])
    failed: list[set] = []
    restored: list[bool] = []

    def patch(learner: Learner) -> None:
        real = learner.trainer.step
        before = {k: v.clone() for k, v in learner.model.state_dict().items()}

        def step(segments, policy_version, **kw):
            if not failed:  # the first step fails the way an unforeseen defect would: after the update
                failed.append({(s.episode, int(t)) for s in segments for t in np.unique(s.turn_ids[s.loss_mask])})
                real(segments, policy_version, **kw)
                raise RuntimeError("injected: the step's metrics hit something no check saw")
            if not restored:  # the next step starts from the weights of its version, not the failed update
                restored.append(all(torch.equal(v, before[k]) for k, v in learner.model.state_dict().items()))
                restored.append(learner.trainer.steps == 0 and not learner.trainer.optimizer.state)
            return real(segments, policy_version, **kw)

        learner.trainer.step = step

    dead: list = []
    first = await run_learner(
        tmp_path / "run", tiny_model, broker, 2, dead, patch=patch, waves=(good(10, 0), good(20, 1))
    )
    assert first.state.step == 2 and failed and failed[0] and restored == [True, True]
    assert dead and {m.headers[HDR_DEAD_REASON] for m in dead} == {"train_step"}
    assert {m.subject for m in dead} == {"t1.dead.train_step"}
    assert "injected" in dead[0].headers[HDR_DEAD_ERROR]
    assert first.poison.failed_steps == 1 and first.settler.counts["poisoned"] >= len(failed[0])
    trained = {(ep, t) for ep, ts in first.state.trained.items() for t in ts}
    assert not trained & failed[0]
    await publish(broker, good(30, 2))
    second = await run_learner(tmp_path / "run", tiny_model, broker, 3, [])
    trained = {(ep, t) for ep, ts in second.state.trained.items() for t in ts}
    assert second.state.step == 3 and not trained & failed[0]


class Crash(BaseException):
    """A learner killed at one point (nothing catches it), as a SIGKILL would stop it there."""


async def test_a_poisoned_episode_is_remembered_by_the_time_its_batch_is_acked(tmp_path, tiny_model):
    """The learner is killed right after acking a batch with a bad turn, before taking anything: the restarted
    learner still drops the episode's later turns (else they would wait forever for the poisoned one)."""
    vocab = MoEConfig.load(tiny_model / "config.json").vocab_size
    recs = episode("bad-ep", 3)
    recs[1] = spoil(recs[1], "logprob", vocab)
    broker = MemoryBroker()
    await publish(broker, recs[:2] + good(0, 0))

    def patch(learner: Learner) -> None:
        def crash(rec, *, live):
            raise Crash

        learner.ingest._take_safely = crash

    with pytest.raises(BaseExceptionGroup) as err:
        await run_learner(tmp_path / "run", tiny_model, broker, 1, [], patch=patch)
    assert err.group_contains(Crash)
    await publish(broker, recs[2:])  # the episode's later turns and its end arrive after the restart
    learner = await run_learner(tmp_path / "run", tiny_model, broker, 1, [])
    assert learner.poison.stop_turn("bad-ep") == 1
    assert learner.poison.dropped_turns == 2 and not [k for k in learner.untrained if k[0] == "bad-ep"]
    assert "bad-ep" not in learner.assembler.open


async def test_a_record_whose_assembly_raises_drops_its_episode_and_the_learner_goes_on(tmp_path, tiny_model):
    """A defect no check foresaw, in taking a validated record (injected into the assembler): the record goes
    to t1.dead.assembly, its episode is dropped whole, and neither this learner nor a restart dies on it."""
    broker = MemoryBroker()
    await publish(broker, good(0, 0))

    def patch(learner: Learner) -> None:
        real = learner.assembler.feed

        def feed(rec):
            if getattr(rec, "episode", "") == "good1" and getattr(rec, "turn", -1) == 2:
                raise IndexError("injected: an assembly defect")
            return real(rec)

        learner.assembler.feed = feed

    dead: list = []
    first = await run_learner(tmp_path / "run", tiny_model, broker, 2, dead, patch=patch, waves=(good(10, 1),))
    assert first.state.step == 2
    assert [(m.subject, m.record.episode, m.record.turn) for m in dead] == [("t1.dead.assembly", "good1", 2)]
    assert "injected" in dead[0].headers[HDR_DEAD_ERROR]
    assert not any(first.state.was_trained("good1", t) for t in (2, 3))
    await publish(broker, good(20, 2))
    second = await run_learner(tmp_path / "run", tiny_model, broker, 3, [], patch=patch)  # replay meets it again
    assert second.state.step == 3 and not any(second.state.was_trained("good1", t) for t in (2, 3))


# ---------------------------------------------------------------------------------------------- the checks


LIM = ModelLimits(vocab_size=300, n_layers=LAYERS, top_k=TOPK, n_experts=EXPERTS, max_seq_len=64)


def a_turn() -> wire.TurnRecord:
    return episode("e", 1, turns=1)[0]


@pytest.mark.parametrize("kind", KINDS)
def test_each_check_names_the_turn_field_and_value(kind):
    rec = spoil(a_turn(), kind, LIM.vocab_size)
    with pytest.raises(WireError) as err:
        check_turn(rec, LIM)
    assert err.value.reason == kind and "e#0" in str(err.value)


def test_a_good_turn_passes_and_an_all_zero_layer_is_left_to_the_assembler():
    rec = a_turn()
    check_turn(rec, LIM)
    ex = rec.routing.experts.copy()
    ex[:, 1, :] = 0  # a broken capture of one layer: the assembler drops that layer's rows (design §6)
    check_turn(replace(rec, routing=wire.Routing(rec.routing.start, ex)), LIM)


def test_a_turn_longer_than_the_model_is_rejected():
    rec = a_turn()
    with pytest.raises(WireError, match="max_seq_len 8") as err:
        check_turn(rec, replace(LIM, max_seq_len=8))
    assert err.value.reason == "length"


def test_a_turn_from_a_version_the_learner_never_had_is_rejected():
    rec = replace(a_turn(), policy_version=5)
    check_turn(rec, LIM, policy_version=5)
    with pytest.raises(WireError, match="5 is newer than the learner's version 4") as err:
        check_turn(rec, LIM, policy_version=4)
    assert err.value.reason == "policy_version"


def test_input_token_ids_are_checked_too():
    rec = a_turn()
    delta = rec.input_delta.copy()
    delta[-1] = 999
    with pytest.raises(WireError, match=r"input_delta \[7\] = 999") as err:
        check_turn(replace(rec, input_delta=delta), LIM)
    assert err.value.reason == "token_range"


# ---------------------------------------------------------------------------------------------- real NATS


async def test_over_real_nats_the_dead_letter_stream_keeps_the_record_and_its_reason(tmp_path, tiny_model, nats_server):
    from t1async.transport import NatsTransport

    recs = episode("nan-ep", 7, policy_version=0)
    recs[1] = spoil(recs[1], "logprob", 0)
    records = recs + good(0, 0)
    cfg = LearnerConfig(run_dir=tmp_path / "run", model=tiny_model, batch_turns=4, steps=1, metrics_every_s=60)
    async with NatsTransport(nats_server.url) as t:
        for r in records:
            await t.publish(traj_subject(r.episode), r)
        learner = Learner(cfg, t, None)
        with anyio.fail_after(120):
            await learner.run()
        learner.journal.close()
        # read back from JetStream's T1_DEAD, as an operator would (nats stream get T1_DEAD --last-for ...)
        msg = await t.last_message("T1_DEAD", "t1.dead.logprob")
    assert learner.state.step == 1 and not learner.state.was_trained("nan-ep", 1)
    assert msg.headers[HDR_DEAD_REASON] == "logprob" and "nan-ep#1" in msg.headers[HDR_DEAD_ERROR]
    assert wire.records_equal(wire.decode(msg.data), recs[1])
