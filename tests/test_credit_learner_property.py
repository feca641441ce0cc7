"""The staleness and settling properties on the REAL learner service (design §7), not the simulator.

Scripted actors (credits through ``t1.credit``, heartbeats, the actors' own ``TurnEncoder``) drive a real
``Learner`` (memory transport, tiny real MoE, real trainer) in seeded random scenarios: records arrive in
random order (turns of one episode too, ends before their turns), weight updates land mid-turn (per-token
versions), leases expire, an actor is killed, the learner is cancelled mid-step and restarted on its run
dir. Checked from the step log (each step's trained set and token staleness, written before the step):

- no (episode, turn) is trained twice, and the steps are exactly 0..v-1;
- the staleness of every trained token is <= η;
- ``stale_masked_tokens == 0`` in a learner that saw no lease expire (and did not inherit leases from a
  crashed predecessor);
- every turn the learner took is settled at most once, and opened == settled + still open;
- the ledger holds only the work in flight.

Deterministic for a seed: the same seed gives the same history (the last test runs one twice and compares).
Time is trio's MockClock with autojump (virtual seconds pass only when every task waits); worker-thread calls
(a trainer step, a journal append) run inline and take ``STEP_S`` / ``IO_S`` virtual seconds; trio's scheduler
and the memory broker draw from Randoms seeded by the scenario; episode ids come from the actor's Random.
Nothing waits on the wall clock: the real trainer's compute is the only real time spent.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from pathlib import Path

import anyio
import numpy as np
import pytest
import torch
import trio
import trio.testing

from actors.records import TurnEncoder
from sandbox_agent.agent.types import TurnResult
from t1async.credits.client import CreditClient
from t1async.credits.settle import trained_counts
from t1async.learner.service import Learner
from t1async.learner.settings import LearnerConfig
from t1async.model.config import MoEConfig
from t1async.model.tokenizer import ChatTokenizer
from t1async.protocol import wire
from t1async.protocol.sampling import SamplingParams
from t1async.sampler.memory import MemorySampler
from t1async.testing.models import tiny_model_dir
from t1async.transport import MemoryBroker, MemoryTransport
from t1async.transport.base import traj_subject


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return tiny_model_dir(tmp_path_factory.mktemp("model"), d_model=16, d_ff=16, max_seq_len=4096)


# virtual seconds a worker-thread call takes: a trainer step or a checkpoint (the calls Learner._train_step
# makes) about what the tiny model's step takes for real (t_step_s ~0.05), a journal append or a trim less. The
# ratio decides which interleavings a seed explores: with every call 0.25 s the learner was slow enough that
# the due turns were always in by the time it trained, and a can_train() that always said yes went unseen
STEP_S, IO_S = 0.05, 0.005


async def _inline_thread(func, *args, abandon_on_cancel=False, cancellable=None, limiter=None):
    """``anyio.to_thread.run_sync`` made deterministic: the call runs inline after its virtual duration. As a
    real worker thread, it cannot be interrupted once started: a cancel lands at the next checkpoint."""
    await anyio.lowlevel.checkpoint_if_cancelled()
    with anyio.CancelScope(shield=True):
        await anyio.sleep(STEP_S if "_train_step" in getattr(func, "__qualname__", "") else IO_S)
    return func(*args)


def seed_everything(monkeypatch: pytest.MonkeyPatch, seed: int) -> None:
    """What a run draws that the scenario's own Randoms do not: trio's scheduling order (pytest-trio turns on
    trio's deterministic scheduling; its Random is seeded here), the memory broker's choice among subscribers,
    and the timing of worker threads. Call it before each trio run."""
    monkeypatch.setattr(trio._core._run, "_ALLOW_DETERMINISTIC_SCHEDULING", True)
    monkeypatch.setattr(trio._core._run, "_r", random.Random(f"trio-{seed}"))
    monkeypatch.setattr("t1async.transport.memory.random", random.Random(f"broker-{seed}"))
    monkeypatch.setattr(anyio.to_thread, "run_sync", _inline_thread)


@pytest.fixture
def one_torch_thread():
    """The trainer step runs inline on the event loop's thread: torch's other intra-op threads would spin after
    each op and starve the loop (seed 0: 14 s of CPU instead of 5 on 2 cores)."""
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


@pytest.fixture
def seeded(seed, monkeypatch, one_torch_thread):
    """Seeds a test parametrized by ``seed`` before its trio run starts (with pytest-trio's ``autojump_clock``)."""
    seed_everything(monkeypatch, seed)


class SplitSampler(MemorySampler):
    """A memory sampler whose weight updates may land mid-request: the tokens sampled after the update carry
    the new version (``output_versions``), as the embedded engine reports them."""

    def __init__(self, rng: random.Random, **kw) -> None:
        super().__init__(**kw)
        self.rng = rng
        self.split_turns = 0

    async def generate(self, input_ids, params, *, routed_experts_start_len=None, rid=None):
        v0 = self.weight_version
        g = await super().generate(input_ids, params, routed_experts_start_len=routed_experts_start_len, rid=rid)
        await anyio.sleep(self.rng.uniform(0, 0.05))  # decoding: a weight update may land meanwhile
        n, v1 = len(g.output_ids), self.weight_version
        if v1 != v0 and n >= 2:
            k = self.rng.randint(1, n - 1)
            g = replace(g, output_versions=np.array([v0] * k + [v1] * (n - k), np.int32), policy_version=v1)
            self.split_turns += 1
        return g


@dataclass
class Scenario:
    seed: int
    eta: int
    batch_turns: int
    actors: int
    concurrency: int
    kill: bool  # SIGKILL-like: an actor stops mid-episode, its unpublished records are lost
    restart: bool  # the learner is cancelled mid-step and a new one resumes from the run dir
    expire: bool  # short leases and late deliveries: some leases run out
    inject: bool  # inputs that discard a whole output (REALIGN), turns after their end, NaN logprobs (poison)
    steps: int = 8
    # how often each injected fault happens (per turn, per delivery, per episode): the every-reason test raises
    # the rarest so that no reason is left to chance: at the defaults one reason had no turn in 1 of 10 runs, and
    # seed 11 settled as few as 2 turns as realign_dropped and 2 as abandoned
    poison_p: float = 0.03
    late_p: float = 0.05
    past_end_p: float = 0.1
    realign_p: float = 0.15

    @classmethod
    def draw(cls, seed: int) -> Scenario:
        r = random.Random(seed)
        return cls(
            seed,
            r.choice([0, 1, 2]),
            r.choice([2, 3, 4]),
            r.choice([2, 3]),
            r.choice([1, 2, 3]),
            kill=r.random() < 0.6,
            restart=r.random() < 0.5,
            expire=r.random() < 0.35,
            inject=r.random() < 0.5,
        )


async def scripted_actor(
    name: str, transport: MemoryTransport, sampler: SplitSampler, sc: Scenario, rng: random.Random, vocab: int
) -> None:
    credits = CreditClient(transport, name, request_timeout_s=1.0)
    outbox: list[tuple[str, wire.Record]] = []
    late_s = 3.0 if sc.expire else 0.0  # > the 1.5 s lease of an `expire` scenario

    async def episode() -> None:
        ep = f"{name}-{rng.getrandbits(32):08x}"  # from the seed: a uuid4 would differ run to run
        enc = TurnEncoder(ep)
        await transport.publish(traj_subject(ep), wire.StartRecord(ep, name, "task", 99, 0.0))
        seq = np.array([rng.randrange(vocab) for _ in range(rng.randint(4, 12))], np.int32)
        turns = rng.randint(2, 6)

        async def sample(t: int, start: int) -> wire.TurnRecord:
            g = await sampler.generate(
                seq.tolist(),
                SamplingParams(max_new_tokens=rng.randint(2, 6), temperature=1.0),
                routed_experts_start_len=start,
            )
            lps = g.logprobs.copy()
            if sc.inject and rng.random() < sc.poison_p:
                lps[0] = np.nan  # a null logprob from a sampler: fails validation, its episode is poisoned
            tr = TurnResult(
                t,
                seq,
                g.output_ids,
                lps,
                "length",
                g.policy_version,
                g.routing,
                g.routing_start,
                "bash",
                "true",
                "ok",
                0,
                False,
                False,
                None,
                0.0,
                0.0,
                0.0,
                output_versions=g.output_versions,
            )
            return enc.encode(tr)

        realign = False
        for t in range(turns):
            await credits.acquire(ep, t)
            outbox.append((traj_subject(ep), await sample(t, 0 if t == 0 or realign else len(enc.seq) - 1)))
            obs = np.array([rng.randrange(vocab) for _ in range(rng.randint(1, 4))], np.int32)
            realign = (
                sc.inject and rng.random() < sc.realign_p
            )  # the agent drops this turn's whole output (TITO REALIGN)
            seq = np.concatenate([enc.seq[: len(seq)] if realign else enc.seq, obs])
            if realign and obs[0] == enc.seq[len(seq) - len(obs)]:
                seq[len(seq) - len(obs)] = (int(obs[0]) + 1) % vocab  # really differs from the dropped output
        outbox.append((traj_subject(ep), wire.EndRecord(ep, turns, wire.EndReason.MAX_TURNS, 0, 1, False)))
        if sc.inject and rng.random() < sc.past_end_p:  # a turn past its episode's end (no credit): never trained
            outbox.append((traj_subject(ep), await sample(turns, 0)))

    async def episodes() -> None:
        while True:
            await episode()

    async def deliver() -> None:  # what piled up, in any order; now and then one held back past a lease
        while True:
            await anyio.sleep(rng.uniform(0, 0.2))
            batch = [outbox.pop(rng.randrange(len(outbox))) for _ in range(len(outbox))]
            for subject, rec in batch:
                if late_s and rng.random() < sc.late_p:
                    await anyio.sleep(late_s)
                await transport.publish(subject, rec)

    async def heartbeat() -> None:
        while True:
            await transport.publish(f"t1.actor.{name}", wire.Heartbeat(name, 0.0))
            await anyio.sleep(0.2)

    async with anyio.create_task_group() as tg:
        for fn in [deliver, heartbeat] + [episodes] * sc.concurrency:
            tg.start_soon(fn)


async def run_scenario(
    sc: Scenario, run: Path, model: Path, sizes: list[int] | None = None
) -> tuple[list[Learner], SplitSampler]:
    rng = random.Random(sc.seed)
    tok = ChatTokenizer.load()
    cfg = MoEConfig.load(model / "config.json")
    sampler = SplitSampler(
        rng,
        vocab_size=cfg.vocab_size,
        num_layers=cfg.n_layers,
        topk=cfg.top_k,
        num_experts=cfg.n_experts,
        eos_token_id=tok.end_of_turn_id,
        seed=sc.seed,
    )
    broker = MemoryBroker(ack_wait_s=1.0, clock=anyio.current_time)  # redeliveries on the (mock) loop clock
    lcfg = LearnerConfig(
        run_dir=run,
        model=model,
        max_staleness=sc.eta,
        batch_turns=sc.batch_turns,
        lease=1.5 if sc.expire else 60.0,
        actor_timeout=2.0,
        metrics_every_s=60.0,
        lr=1e-3,
    )
    learners: list[Learner] = []
    async with anyio.create_task_group() as actors_tg:
        actor_scopes = []
        for i in range(sc.actors):
            scope = anyio.CancelScope()
            actor_scopes.append(scope)

            async def one(i=i, scope=scope) -> None:
                async with MemoryTransport(broker) as at:
                    with scope:
                        await scripted_actor(f"a{i}", at, sampler, sc, random.Random(sc.seed * 100 + i), cfg.vocab_size)

            actors_tg.start_soon(one)
        restart_at = rng.randint(1, sc.steps - 2) if sc.restart else None
        kill_at = rng.randint(1, sc.steps - 2) if sc.kill else None
        with anyio.fail_after(60 + 20 * sc.steps):
            while True:
                async with MemoryTransport(broker) as lt, anyio.create_task_group() as tg:
                    learner = Learner(lcfg, lt, sampler)
                    learners.append(learner)
                    await tg.start(learner.run)
                    while learner.state.step < sc.steps:
                        if kill_at is not None and learner.state.step >= kill_at:
                            actor_scopes[0].cancel()  # its outbox and open episodes are lost with it
                            kill_at = None
                        if restart_at is not None and learner.state.step >= restart_at and learner.credits.training:
                            break  # a step is in flight: crash the learner here
                        if sizes is not None:
                            sizes.append(learner.gate.ledger.size)
                        await anyio.sleep(0.01)
                    restarted = learner.state.step < sc.steps
                    if restarted:
                        restart_at = None
                    else:
                        # the killed actor's silence is noticed and its open episodes' aborted ends are taken
                        with anyio.move_on_after(10):
                            while sc.kill and (
                                not any("a0" in lr.liveness.released for lr in learners)
                                or any(ep.startswith("a0-") for ep in learner.assembler.open)
                            ):
                                await anyio.sleep(0.05)
                        await anyio.sleep(0.2)
                    tg.cancel_scope.cancel()
                learner.journal.close()
                if not restarted:
                    break
        actors_tg.cancel_scope.cancel()
    return learners, sampler


@pytest.mark.parametrize("seed", range(24))  # a seed is one interleaving: 24 explore more than 8 did
async def test_the_learner_service_keeps_every_token_within_eta_and_settles_each_turn_once(
    seed, seeded, autojump_clock, tmp_path, tiny_model
):
    sc = Scenario.draw(seed)
    learners, sampler = await run_scenario(sc, tmp_path / "run", tiny_model)
    final = learners[-1]
    assert final.state.step >= sc.steps and len(learners) == 1 + sc.restart
    steps, counts = trained_counts(tmp_path / "run", final.state.policy_version)
    assert sorted(steps) == list(range(final.state.policy_version)), sorted(steps)
    twice = sorted(k for k, c in counts.items() if c > 1)
    assert not twice, f"{sc}: trained twice: {twice[:5]}"
    assert set(counts) == {(ep, t) for ep, ts in final.state.trained.items() for t in ts}
    worst = max(r["max_staleness"] for r in steps.values())
    assert worst <= sc.eta, f"{sc}: a token trained {worst} versions after it was sampled"
    for i, lr in enumerate(learners):
        led = lr.gate.ledger
        assert lr.hist.max <= sc.eta
        if i == 0 and not sc.expire and not sc.inject:  # every turn had its credit: none arrives unadmitted
            assert led.stats.unadmitted == 0, f"{sc}: {led.stats.unadmitted} turns arrived without their credit"
        if i == 0 and led.stats.expired == 0 and led.stats.unadmitted == 0:  # (injected turns past an end have none)
            assert lr.stale_masked_tokens == 0, f"{sc}: {lr.stale_masked_tokens} tokens masked with no lease expired"
        s = lr.settler
        assert s.opened == sum(s.counts.values()) + len(s.untrained), (s.opened, s.counts, len(s.untrained))
        assert led.size <= 2 * ((sc.eta + 2) * sc.batch_turns + sc.actors * sc.concurrency), led.snapshot()
    # the actors' open episodes only: an ended (or stopped) episode is no longer anyone's work
    assert not [ep for ep in final.liveness.owner if ep in final.assembler.ended or not final.ingest.running(ep)]
    if sc.kill:  # released (by the learner running then), and none of its episodes is left open
        assert any("a0" in lr.liveness.released for lr in learners), [lr.liveness.released for lr in learners]
        left = {ep: (a.next_turn, a.end_record) for ep, a in final.assembler.open.items() if ep.startswith("a0-")}
        assert not left, f"{sc}: the killed actor's episodes are still open: {left}"


@pytest.mark.slow
@pytest.mark.parametrize("seed", [11])
async def test_a_long_run_settles_by_every_reason_and_the_ledger_stays_bounded(
    seed, seeded, autojump_clock, tmp_path, tiny_model
):
    """40 steps at η = 1 with every way a delivered turn can end: trained, stale-masked (delivered after its
    lease ran out), dropped by a REALIGN, poisoned (NaN logprob), abandoned (past its end). The ledger holds
    the work in flight at every moment, not every credit since the start."""
    sc = Scenario(
        seed=seed,
        eta=1,
        batch_turns=3,
        actors=3,
        concurrency=2,
        kill=True,
        restart=False,
        expire=True,
        inject=True,
        steps=40,
        poison_p=0.05,
        past_end_p=0.25,
        realign_p=0.3,
    )
    sizes: list[int] = []
    (learner,), _ = await run_scenario(sc, tmp_path / "run", tiny_model, sizes)
    s, led = learner.settler, learner.gate.ledger
    assert all(n > 0 for n in s.counts.values()), str(dict(s.counts))
    assert s.opened == sum(s.counts.values()) + len(s.untrained)
    assert learner.metrics()["settled"] == s.counts
    steps, counts = trained_counts(tmp_path / "run", learner.state.policy_version)
    assert max(counts.values()) == 1 and max(r["max_staleness"] for r in steps.values()) <= sc.eta
    assert led.stats.granted > 100 and len(sizes) > 100
    # in flight: about (η + 1)·B admitted plus a credit per actor slot (ranks freed by untrained settles and
    # releases are granted again, so not a hard cap); the old grant-order deque grew with every grant
    bound = 2 * ((sc.eta + 2) * sc.batch_turns + sc.actors * sc.concurrency)
    assert max(sizes) <= bound and led.stats.granted > 3 * bound, (max(sizes), bound, led.snapshot())


def history(learners: list[Learner], sampler: SplitSampler, run: Path) -> dict:
    """What a run did, as data: every step-log line (superseded ones too), each learner's ledger, settles,
    releases and staleness histogram, the trained turns, and the sampler's calls and split turns."""
    return {
        "step_log": (run / "learner" / "steps.jsonl").read_text().splitlines(),
        "ledgers": [lr.gate.ledger.snapshot() for lr in learners],
        "settled": [(dict(lr.settler.counts), lr.settler.opened, sorted(lr.settler.untrained)) for lr in learners],
        "released": [sorted(lr.liveness.released) for lr in learners],
        "trained": {ep: sorted(ts) for ep, ts in learners[-1].state.trained.items()},
        "sampler": ([(c.input_ids, c.routed_experts_start_len) for c in sampler.calls], sampler.split_turns),
        "hist": [lr.hist.as_dict() for lr in learners],
    }


@pytest.mark.parametrize("seed", [4])  # η 0, kill, restart, expire, inject (Scenario.draw(4)): every path
def test_the_same_seed_gives_the_same_history(seed, tmp_path, tiny_model, monkeypatch, one_torch_thread):
    """The scenario is a function of its seed: two runs, each in a fresh trio run on a fresh MockClock, make
    the same steps of the same turns, the same ledgers and settles, and end at the same virtual time."""
    sc = Scenario.draw(seed)
    runs = []
    for i in range(2):
        seed_everything(monkeypatch, seed)
        run = tmp_path / f"run{i}"

        async def main(run: Path = run) -> tuple[dict, float]:
            learners, sampler = await run_scenario(sc, run, tiny_model)
            return history(learners, sampler, run), trio.current_time()

        runs.append(trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0)))
    (first, t_first), (second, t_second) = runs
    assert len(first["step_log"]) >= sc.steps and len(first["ledgers"]) == 1 + sc.restart, first["ledgers"]
    for key in first:
        assert first[key] == second[key], f"seed {seed}: {key} differs between two runs of one seed"
    assert t_first == t_second
