"""The learner's algorithm options (design §8): group-relative baselines (grpo, rloo) over task groups the actors
run K times, PPO epochs whose clip binds, truncated and masked importance sampling with their ESS and shares, and
the critic's least-squares warm start with its explained variance."""

from __future__ import annotations

import argparse
import copy
import dataclasses
import math
from pathlib import Path

import anyio
import numpy as np
import pytest
import torch

from actors.actor import run_actor
from actors.settings import ActorSettings
from sandbox_agent.agent.types import AgentConfig
from sandbox_agent.synth import generate
from t1async.ingest.tito import Segment
from t1async.learner import ppo
from t1async.learner.groups import episode_group, grouped_episode_id
from t1async.learner.service import Learner
from t1async.learner.settings import LearnerConfig
from t1async.learner.trainer import Trainer
from t1async.learner.trainer_config import TrainerConfig
from t1async.model.config import MoEConfig
from t1async.model.tokenizer import ChatTokenizer
from t1async.protocol import wire
from t1async.protocol.errors import ConfigError
from t1async.protocol.sampling import SamplingParams
from t1async.transport import MemoryBroker, MemoryTransport
from tests.loops import VersionedMemorySampler
from tests.segments import CFG, advantages_fed_to_the_loss, sampled_segment, tiny, two_turn_segment

# ------------------------------------------------------------------------------------------- task groups


def test_a_grouped_episode_id_names_its_group_and_others_are_their_own():
    ep = grouped_episode_id("a1-9f3c", 2)
    assert ep == "a1-9f3c~g2" and episode_group(ep) == "a1-9f3c"
    assert episode_group("a1-9f3c") == "a1-9f3c"  # ungrouped: its own group
    assert episode_group("x~gy") == "x~gy"  # not a member number
    with pytest.raises(ValueError, match="must not contain"):
        grouped_episode_id("a~g1", 0)


class _Seg:
    """The fields StepBaseline reads: turns 0..n-1, two loss tokens each, rewards at each turn's end."""

    def __init__(self, episode: str, rewards: list[float]) -> None:
        n = len(rewards)
        self.episode = episode
        self.loss_mask = np.ones(2 * n, dtype=bool)
        self.turn_ids = np.repeat(np.arange(n, dtype=np.int32), 2)
        self.turn_ends = np.arange(1, 2 * n, 2, dtype=np.int32)
        self.turn_rewards = np.asarray(rewards, dtype=np.float32)


def _per_turn(adv: np.ndarray) -> list[float]:
    return [round(float(x), 6) for x in adv[::2]]


def test_grpo_and_rloo_centre_each_turns_return_on_its_task_group():
    segs = [_Seg("g~g0", [1.0, 2.0]), _Seg("g~g1", [0.0, 1.0]), _Seg("g~g2", [2.0, 0.0]), _Seg("lone", [5.0])]
    # returns-to-go (gamma 1): g0 (3, 2), g1 (1, 1), g2 (2, 0); the group's means: turn 0 = 2, turn 1 = 1
    grpo = ppo.StepBaseline.of("grpo", segs)
    assert _per_turn(grpo.advantages(segs[0])) == [1.0, 1.0]
    assert _per_turn(grpo.advantages(segs[1])) == [-1.0, 0.0]
    # rloo: the mean of the other two: g0 turn 0 -> 3 - (1 + 2) / 2, turn 1 -> 2 - (1 + 0) / 2
    rloo = ppo.StepBaseline.of("rloo", segs)
    assert _per_turn(rloo.advantages(segs[0])) == [1.5, 1.5]
    assert _per_turn(rloo.advantages(segs[2])) == [-0.0, -1.5]
    # a lone episode falls back to the step's mean for its turn number: turn 0's returns 3, 1, 2, 5 -> mean 2.75
    assert _per_turn(rloo.advantages(segs[3])) == [2.25]
    assert grpo.grouped_share() == pytest.approx(6 / 7)
    # gamma 0: each turn's own reward, centred on the group's (the turn advantage within a group)
    g0 = ppo.StepBaseline.of("grpo", segs, gamma=0.0)
    assert _per_turn(g0.advantages(segs[0])) == [0.0, 1.0]


def test_a_cut_segments_returns_are_counted_truncated():
    """An episode cut open for a step (``done`` False) has a return-to-go without its later turns' rewards:
    ``truncated_share`` counts those (episode, turn)s, so a run sees how much of rloo's signal lacks the episode's
    end (seen failing on the old code: no ``truncated_share``)."""
    segs = [_Seg("g~g0", [1.0, 2.0]), _Seg("g~g1", [0.0, 1.0]), _Seg("g~g2", [2.0])]
    segs[2].done = False  # g2 runs on: its turn 0 return is 2 so far, whatever its turn 1 brings
    segs[0].done = segs[1].done = True
    rloo = ppo.StepBaseline.of("rloo", segs)
    assert rloo.truncated_share() == pytest.approx(1 / 5)  # of the 5 (episode, turn)s, g2's turn 0
    assert ppo.StepBaseline.of("rloo", segs, gamma=0.0).truncated_share() == 0.0  # each turn's own reward
    assert ppo.StepBaseline.of("turn", segs).truncated_share() == 0.0


def test_the_trainer_feeds_group_relative_advantages_to_the_loss(monkeypatch):
    toks = np.random.default_rng(3).integers(0, CFG.vocab_size, size=30)
    base = tiny()
    segs = [
        two_turn_segment(base, toks, (2.0, 0.0), grouped_episode_id("t", 0)),
        two_turn_segment(base, toks, (0.0, 0.0), grouped_episode_id("t", 1)),
        two_turn_segment(base, toks, (1.0, 1.0), grouped_episode_id("u", 0)),
        two_turn_segment(base, toks, (1.0, 3.0), grouped_episode_id("u", 1)),
    ]
    cfg = TrainerConfig(advantage="rloo", normalize_advantages=False, microbatch_tokens=40)
    adv, _ = advantages_fed_to_the_loss(monkeypatch, copy.deepcopy(base), cfg, segs)
    # group t: returns (2, 0) vs (0, 0) -> turn 0 +-2, turn 1 0; group u: (2, 1) vs (4, 3) -> +-2 at both turns
    assert sorted(set(np.round(adv, 4).tolist())) == [-2.0, 0.0, 2.0]
    assert int((np.round(adv, 4) == 2.0).sum()) == 5 * 3 and int((np.round(adv, 4) == 0.0).sum()) == 5 * 2
    # the step's own baseline of all four would centre these differently: the group is what is compared
    m = Trainer(copy.deepcopy(base), cfg).step(segs, 0)
    assert m.adv_grouped_share == 1.0
    assert all(s.done for s in segs) and m.adv_truncated_share == 0.0
    segs[3] = dataclasses.replace(segs[3], done=False)  # u~g1 cut open: both its turns' returns lack what follows
    assert Trainer(copy.deepcopy(base), cfg).step(segs, 0).adv_truncated_share == pytest.approx(2 / 8)


def test_the_random_sign_control_flips_whole_turns_and_keeps_their_size(monkeypatch):
    """``--advantage-signs random``, a control: each (episode, turn)'s advantage keeps its size and gets a sign
    fixed by the step and the turn, the same in every segment of it; gae refuses it (seen failing on the old
    code: no such setting)."""
    segs = [_Seg(f"g~g{i}", [float(i % 3), float(i % 2), 1.0]) for i in range(12)]
    kept, rand = ppo.StepBaseline.of("rloo", segs), ppo.StepBaseline.of("rloo", segs, sign_salt="step0")
    flips = 0
    for s in segs:
        a, b = kept.advantages(s), rand.advantages(s)
        assert np.allclose(np.abs(a), np.abs(b))
        for t in range(3):
            sa, sb = a[2 * t : 2 * t + 2], b[2 * t : 2 * t + 2]
            assert np.allclose(sb, sa * rand.sign(s.episode, t))  # both tokens of a turn alike
            flips += rand.sign(s.episode, t) < 0
    assert 6 <= flips <= 30  # of 36 fair coins
    again = ppo.StepBaseline.of("rloo", segs[::-1], sign_salt="step0")  # rebuilt, as every rank builds it
    assert all(again.sign(s.episode, t) == rand.sign(s.episode, t) for s in segs for t in range(3))
    assert any(
        ppo.StepBaseline.of("rloo", segs, sign_salt="step1").sign(s.episode, t) != rand.sign(s.episode, t)
        for s in segs
        for t in range(3)
    )  # another step, other coins
    toks = np.random.default_rng(3).integers(0, CFG.vocab_size, size=30)
    base = tiny()
    tsegs = [
        two_turn_segment(base, toks, r, grouped_episode_id("t", i)) for i, r in enumerate([(2.0, 0.0), (0.0, 0.0)])
    ]
    cfg = TrainerConfig(advantage="rloo", advantage_signs="random", normalize_advantages=False, microbatch_tokens=40)
    adv, _ = advantages_fed_to_the_loss(monkeypatch, copy.deepcopy(base), cfg, tsegs)
    assert sorted(set(np.abs(np.round(adv, 4)).tolist())) == [0.0, 2.0]  # the sizes of the kept advantages
    with pytest.raises(ConfigError, match="critic-free"):
        TrainerConfig(advantage="gae", advantage_signs="random")


# ------------------------------------------------------------------------------------- PPO epochs and clip


def _segments(model, n: int = 4, seed: int = 5) -> list[Segment]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        toks = rng.integers(10, 4000, size=24).tolist()
        out.append(sampled_segment(model, toks, range(12, 24), reward=float(i % 2) * 3.0, episode=f"e{i}"))
    return out


def test_later_ppo_epochs_recompute_the_ratio_so_the_clip_binds():
    torch.manual_seed(0)
    model = tiny()
    segs = _segments(model)
    cfg = TrainerConfig(lr=3e-3, ppo_epochs=4, clip_eps=0.05)
    m = Trainer(model, cfg).step(segs, 0)
    by = m.clip_frac_by_epoch
    assert sorted(by) == [0, 1, 2, 3]
    assert by[0] == 0.0  # the first epoch's ratio is exactly 1: nothing to clip
    assert m.clip_frac_last == by[3] > 0.05  # later epochs see the moved policy: the clip binds
    assert m.clip_frac == pytest.approx(sum(by.values()) / 4)
    assert "clip_frac_last" in m.to_dict() and m.to_dict()["clip_frac_by_epoch"]["3"] == by[3]
    one = Trainer(tiny(), TrainerConfig(lr=3e-3)).step(_segments(tiny()), 0)
    assert one.clip_frac_by_epoch == {0: 0.0} and one.clip_frac_last == 0.0


# ---------------------------------------------------------------------------------- off-policy correction


def _is_loss(w: list[float], cfg: TrainerConfig):
    logp = torch.full((len(w),), -1.0, requires_grad=True)
    behav = torch.tensor([-1.0 - math.log(x) for x in w])
    z = torch.zeros(len(w))
    terms = ppo.ppo_loss(
        logp, logp.detach(), behav, torch.ones(len(w)), z, z, z, torch.ones(len(w), dtype=torch.bool), cfg
    )
    terms.loss.backward()
    return terms, logp.grad


def test_masked_is_drops_the_tokens_whose_weight_leaves_the_bounds():
    cfg = TrainerConfig(value_coef=0.0, is_correction="mis", is_low=0.5, is_high=2.0)
    terms, grad = _is_loss([0.3, 0.8, 1.5, 4.0], cfg)
    n = 4
    np.testing.assert_allclose(grad.numpy(), [0.0, -0.8 / n, -1.5 / n, 0.0], rtol=1e-5)
    assert terms.is_masked_frac.item() == pytest.approx(0.5) and terms.is_trunc_frac.item() == 0.0
    # the same weights under TIS at a cap of 3: nothing dropped, 4.0 truncated
    terms, grad = _is_loss([0.3, 0.8, 1.5, 4.0], TrainerConfig(value_coef=0.0, is_cap=3.0))
    np.testing.assert_allclose(grad.numpy(), [-0.3 / n, -0.8 / n, -1.5 / n, -3.0 / n], rtol=1e-5)
    assert terms.is_trunc_frac.item() == pytest.approx(0.25) and terms.is_masked_frac.item() == 0.0


def test_no_is_correction_weighs_every_token_one_whatever_the_sampler_said(tmp_path):
    # the ablation: the gradient is the plain surrogate's, -adv / n per token, however far pi_sampler is
    terms, grad = _is_loss([0.3, 0.8, 1.5, 4.0], TrainerConfig(value_coef=0.0, is_correction="none"))
    np.testing.assert_allclose(grad.numpy(), [-0.25] * 4, rtol=1e-6)
    assert terms.is_trunc_frac.item() == 0.0 and terms.is_masked_frac.item() == 0.0
    from tests.clusterargs import learner_argv, serve_args

    assert serve_args(learner_argv(tmp_path, "--is-correction", "none")).is_correction == "none"


def test_bad_is_options_are_refused():
    with pytest.raises(ConfigError, match="is_low < is_high"):
        TrainerConfig(is_correction="mis", is_low=2.0, is_high=1.5)
    with pytest.raises(ConfigError, match="is_correction must be 'tis' or 'mis' or 'none'"):
        TrainerConfig(is_correction="off")


def test_step_metrics_report_the_masked_share_and_the_corrected_ess():
    torch.manual_seed(0)
    model = tiny()
    segs = _segments(model)
    rng = np.random.default_rng(0)
    skewed = []
    for s in segs:  # a sampler whose logprobs differ from the learner's: w = exp(+-1) on a third of the tokens
        lp = s.logprobs.copy()
        pos = np.flatnonzero(s.loss_mask)
        hit = pos[rng.random(len(pos)) < 1 / 3]
        lp[hit] += rng.choice([-1.0, 1.0], size=len(hit)).astype(np.float32)
        skewed.append(Segment(**{**s.__dict__, "logprobs": lp}))
    mis = Trainer(copy.deepcopy(model), TrainerConfig(lr=1e-4, is_correction="mis")).step(skewed, 0)
    tis = Trainer(copy.deepcopy(model), TrainerConfig(lr=1e-4)).step(skewed, 0)
    assert 0.15 < mis.is_masked_frac < 0.5 and mis.is_trunc_frac == 0.0
    assert tis.is_masked_frac == 0.0 and 0.05 < tis.is_trunc_frac < 0.3  # only w = e > 2 is truncated
    # masking zeroes weights: its ESS is below the raw one; truncation only lowers the largest, raising it
    assert mis.ess_corrected < mis.ess < tis.ess_corrected <= 1.0
    # what mis would drop, reported under either correction: the skewed third (w = e, 1/e leave [0.5, 2])
    assert tis.is_outside_frac == pytest.approx(mis.is_masked_frac) == pytest.approx(mis.is_outside_frac)
    assert tis.dlogp_max == pytest.approx(1.0, abs=1e-3)
    clean = Trainer(copy.deepcopy(model), TrainerConfig(is_correction="mis")).step(segs, 0)
    assert clean.is_masked_frac == 0.0 and clean.ess_corrected == pytest.approx(1.0, abs=1e-4)
    assert clean.is_outside_frac == 0.0 and clean.dlogp_max < 1e-4


# ------------------------------------------------------------------------------------------------ critic


def test_explained_variance():
    r = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert ppo.explained_variance(r, r) == pytest.approx(1.0)
    assert ppo.explained_variance(torch.full((4,), 2.5), r) == pytest.approx(0.0)
    assert ppo.explained_variance(r.flip(0), r) == pytest.approx(1.0 - 5.0 / 1.25)
    assert ppo.explained_variance(r, torch.ones(4)) == 0.0  # returns that do not vary: 0, not NaN


def _least_squares_ev(model, segs) -> float:
    """The explained variance of the best linear map (with bias) from the last hidden state before each loss
    token to its return, solved directly: what the warm start must reach."""
    xs, ys = [], []
    with torch.no_grad():
        for s in segs:
            h = model(torch.from_numpy(s.tokens[None].astype(np.int64)), logits=False).hidden[0].double().numpy()
            pos = np.flatnonzero(s.loss_mask)
            xs.append(np.concatenate([h[pos - 1], np.ones((len(pos), 1))], axis=1))
            ys.append(np.full(len(pos), float(s.turn_rewards.sum())))  # one turn, done: the return is its reward
    x, y = np.concatenate(xs), np.concatenate(ys)
    w = np.linalg.lstsq(x, y, rcond=None)[0]
    return 1.0 - float(np.var(y - x @ w)) / float(np.var(y))


def test_the_critic_warm_start_fits_the_returns_for_the_next_step():
    """Without the warm-up a fresh head explains none of the returns' variance; with it the fit after the first
    step explains as much as the best linear fit of the hidden states does, and the next step's values (the
    ones its GAE uses) are that fit's; the step itself is scored by the head as it was (never fitted on its own
    returns: tests/test_critic.py), and only the first ``critic_warmup`` steps fit."""
    torch.manual_seed(0)
    base = tiny()
    rng = np.random.default_rng(2)
    segs = []
    for i in range(8):  # what the return is can be read from the context: rewarded episodes use other tokens
        lo = 10 if i % 2 else 2000
        toks = rng.integers(lo, lo + 1500, size=24).tolist()
        segs.append(sampled_segment(base, toks, range(12, 24), reward=float(i % 2) * 3.0, episode=f"e{i}"))
    best = _least_squares_ev(base, segs)
    assert best > 0.3  # the premise: the hidden states say something about the return
    cold = Trainer(copy.deepcopy(base), TrainerConfig(lr=1e-4, advantage="gae")).step(segs, 0)
    assert cold.critic_warmup_ev is None and cold.explained_variance < 0.05
    trainer = Trainer(copy.deepcopy(base), TrainerConfig(lr=1e-4, advantage="gae", critic_warmup=1))
    warm = trainer.step(segs, 0)
    assert warm.critic_warmup_ev == pytest.approx(best, abs=0.01)  # the fit after the step
    assert warm.explained_variance < 0.05  # the values the step's GAE used: the head as it was
    nxt = trainer.step(segs, 1)
    assert nxt.critic_warmup_ev is None and nxt.critic_ev_heldout is None  # past the warm-up: the value loss
    assert nxt.explained_variance == pytest.approx(best, abs=0.05)  # the fit's values
    assert nxt.value_mean == pytest.approx(nxt.return_mean, abs=0.1)  # a fresh head's were ~0 against 1.5
    assert abs(cold.value_mean - cold.return_mean) > 1.0


# ----------------------------------------------------------------------------------- cluster up and actors


def test_cluster_up_hands_the_algorithm_options_to_the_learner_and_actors(tmp_path):
    import tomllib

    from t1async.cluster import components
    from t1async.cluster.config import from_args
    from t1async.cluster.flags import add_up_arguments
    from tests.clusterargs import bare, learner_argv, serve_args

    flags = ["--advantage", "rloo", "--group-size", "4", "--ppo-epochs", "3", "--is-correction", "mis"]
    flags += ["--is-low", "0.7", "--critic-warmup", "2", "--gamma", "0.9", "--lam", "0.8"]
    cfg = serve_args(learner_argv(tmp_path / "a", *flags))  # learner serve's settings: what its Learner trains with
    assert (cfg.advantage, cfg.ppo_epochs, cfg.critic_warmup, cfg.gamma, cfg.lam) == ("rloo", 3, 2, 0.9, 0.8)
    assert (cfg.is_correction, cfg.is_low, cfg.is_high) == ("mis", 0.7, 2.0)
    p = argparse.ArgumentParser()
    p.add_argument("--run-dir", default=str(tmp_path / "b"))
    add_up_arguments(p)
    spec = next(
        s for s in components.specs(from_args(p.parse_args(bare(flags))), "nats://127.0.0.1:1") if s.name == "actor-0"
    )
    argv = list(spec.argv)
    assert tomllib.loads(Path(argv[argv.index("--config") + 1]).read_text())["group_size"] == 4
    with pytest.raises(ConfigError, match="--group-size"):
        from_args(p.parse_args(["--group-size", "0"]))


async def test_actors_run_each_drawn_task_group_size_times_and_the_learner_centres_on_the_group(tmp_path, tiny_model):
    """Real sandboxes and trainer, in-memory NATS and sampler: with --group-size 3 every group is three episodes
    of one task, started together, and the learner's rloo steps centre turns on their own group."""
    broker = MemoryBroker()
    tok = ChatTokenizer.load()
    mcfg = MoEConfig.load(tiny_model / "config.json")
    sampler = VersionedMemorySampler(
        vocab_size=mcfg.vocab_size,
        num_layers=mcfg.n_layers,
        topk=mcfg.top_k,
        num_experts=mcfg.n_experts,
        eos_token_id=tok.end_of_turn_id,
        seed=1,
    )
    tasks = tmp_path / "tasks"
    generate(tasks, 8, seed=3)
    lcfg = LearnerConfig(
        run_dir=tmp_path / "run",
        model=tiny_model,
        max_staleness=1,
        batch_turns=6,
        steps=2,
        lease=30.0,
        metrics_every_s=0.2,
        lr=1e-4,
        advantage="rloo",
    )
    agent = AgentConfig(
        max_turns=2,
        max_context_tokens=4096,
        command_timeout_s=5.0,
        sampling=SamplingParams(max_new_tokens=16, stop_token_ids=tuple(tok.eos_ids)),
    )
    starts: list[wire.StartRecord] = []
    learner_metrics: list[dict] = []
    async with MemoryTransport(broker) as lt, MemoryTransport(broker) as at, MemoryTransport(broker) as mt:
        learner = Learner(lcfg, lt, sampler)
        async with mt.subscribe("t1.>") as sub, anyio.create_task_group() as tg:
            finished = anyio.Event()

            async def watch():
                async for m in sub:
                    if isinstance(m.record, wire.StartRecord):
                        starts.append(m.record)
                    elif isinstance(m.record, wire.MetricsRecord) and m.record.component == "learner":
                        learner_metrics.append(m.record.values)

            async def run_learner(*, task_status=anyio.TASK_STATUS_IGNORED):
                await learner.run(task_status=task_status)
                finished.set()

            tg.start_soon(watch)
            await tg.start(run_learner)
            actor = ActorSettings(actor_id="a1", tasks=tasks, concurrency=3, split="all", group_size=3)
            tg.start_soon(lambda: run_actor(actor, transport=at, sampler=sampler, tokenizer=tok, agent=agent))
            with anyio.fail_after(240):
                await finished.wait()
            tg.cancel_scope.cancel()
    learner.journal.close()
    by_group: dict[str, list[wire.StartRecord]] = {}
    for s in starts:
        by_group.setdefault(episode_group(s.episode), []).append(s)
    full = [g for g in by_group.values() if len(g) == 3]
    assert len(full) >= 2 and all(len(g) <= 3 for g in by_group.values())
    for g in full:
        assert len({s.task for s in g}) == 1  # one task per group
        assert sorted(s.episode.rsplit("~g", 1)[1] for s in g) == ["0", "1", "2"]
    shares = [v["adv_grouped_share"] for v in learner_metrics if "adv_grouped_share" in v]
    assert shares and max(shares) > 0.5  # turns were centred on their own group, not the step's fallback
