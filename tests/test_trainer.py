"""The PPO training step on a tiny real MoE: learning direction, R3 replay, staleness, micro-batching,
checkpoints that the engine loads, and bad input."""

from __future__ import annotations

import copy
import math

import anyio
import numpy as np
import pytest
import torch

from t1async.ingest.tito import Segment
from t1async.learner.batch import BatchError
from t1async.learner.checkpoint import latest_checkpoint, save_checkpoint
from t1async.learner.trainer import Trainer
from t1async.learner.trainer_config import TrainerConfig
from t1async.model.moe import MoETransformer
from tests.segments import CFG, advantages_fed_to_the_loss, sampled_segment, tiny


def logp_of(model: MoETransformer, tokens, pos: int) -> float:
    x = torch.tensor([tokens], dtype=torch.long)
    with torch.no_grad():
        lg = model(x).logits[0, pos - 1].float()
    return float(torch.log_softmax(lg, -1)[tokens[pos]])


def test_steps_raise_logprob_of_positively_advantaged_actions():
    torch.manual_seed(0)
    model = tiny()
    trainer = Trainer(model, TrainerConfig(lr=3e-3))
    good, bad = [5, 6, 7, 100, 101], [5, 6, 7, 200, 201]
    before = logp_of(model, good, 3), logp_of(model, bad, 3)
    for _ in range(8):
        segs = [sampled_segment(model, good, [3, 4], reward=1.0), sampled_segment(model, bad, [3, 4], reward=-1.0)]
        m = trainer.step(segs, policy_version=0)
        assert m.ess == pytest.approx(1.0, abs=1e-6)  # on-policy: all importance weights equal
        assert m.mean_abs_dlogp < 1e-4
    after = logp_of(model, good, 3), logp_of(model, bad, 3)
    assert after[0] > before[0] + 0.1
    assert after[1] < before[1] - 0.1
    assert trainer.steps == 8 and m.loss_tokens == 4 and m.turns == 2


def test_replay_removes_mismatch_from_routing_the_learner_would_not_choose():
    learner = tiny()
    sampler_router = copy.deepcopy(learner)  # the "sampler" routes with a perturbed router
    with torch.no_grad():
        for blk in sampler_router.blocks:
            blk.moe.router.weight.add_(torch.randn_like(blk.moe.router.weight) * 0.5)
    rng = np.random.default_rng(0)
    toks = rng.integers(10, 4000, size=40).tolist()
    seg = sampled_segment(learner, toks, range(20, 40), reward=1.0, routing_from=sampler_router)
    on = Trainer(copy.deepcopy(learner), TrainerConfig(replay=True)).step([seg], 0)
    off = Trainer(copy.deepcopy(learner), TrainerConfig(replay=False)).step([seg], 0)
    # the sampler's logprobs came from the learner's weights with the recorded routing: replay reproduces them
    assert on.mean_abs_dlogp < 1e-4
    assert off.mean_abs_dlogp > 1e-3
    assert on.routing_drift > 0.05 and off.routing_drift > 0.05  # the learner's own router disagrees either way
    assert on.routing_compared == off.routing_compared == 39 * CFG.n_layers
    assert on.routing_used_mismatch == 0.0  # replay: the forward used exactly the recorded experts
    assert off.routing_used_mismatch == off.routing_drift > 0  # free: it used its own choice
    assert on.routing_missing == 0
    # recorded routing = the learner's own choice: no drift, and replay changes nothing
    own = sampled_segment(learner, toks, range(20, 40), reward=1.0)
    m = Trainer(copy.deepcopy(learner), TrainerConfig(replay=True)).step([own], 0)
    assert m.routing_drift == 0.0 and m.mean_abs_dlogp < 1e-4


def test_staleness_histogram_and_drift_pass_through():
    model = tiny()
    segs = [
        sampled_segment(model, [1, 2, 3, 4, 5], [3, 4], reward=0.0, policy_version=3),
        sampled_segment(model, [1, 2, 9, 8], [2, 3], reward=1.0, policy_version=5, done=False),
        sampled_segment(model, [1, 7, 9], [2], reward=1.0, policy_version=5),
    ]
    m = Trainer(model).step(segs, policy_version=6, drift={"clean": 4, "realign": 1, "fork": 0})
    assert m.staleness_hist == {1: 3, 3: 2}
    assert m.max_staleness == 3
    assert m.drift == {"clean": 4, "realign": 1, "fork": 0}
    assert m.to_dict()["staleness_hist"] == {"1": 3, "3": 2}


def test_cut_segment_bootstraps_from_the_value_at_its_end():
    model = tiny()
    toks = [5, 6, 7, 100, 101, 102]
    seg = sampled_segment(model, toks, [3, 4, 5], reward=0.0, done=False)
    with torch.no_grad():
        v_end = float(model(torch.tensor([toks])).values[0, -1])
    cfg = TrainerConfig(gamma=1.0, lam=1.0, normalize_advantages=False, lr=1e-9)
    m = Trainer(model, cfg).step([seg], 0)
    assert m.return_mean == pytest.approx(v_end, abs=1e-5)  # no reward: every return is the bootstrap
    done = Segment(**{**seg.__dict__, "done": True})
    m2 = Trainer(model, cfg).step([done], 0)
    assert m2.return_mean == pytest.approx(0.0, abs=1e-6)


def test_microbatches_accumulate_to_the_same_update():
    base = tiny()
    rng = np.random.default_rng(1)
    segs = []
    for i, n in enumerate((30, 24, 17, 9)):
        toks = rng.integers(10, 4000, size=n).tolist()
        segs.append(
            sampled_segment(base, toks, range(n // 2, n), reward=float(i % 2) - 0.5, episode=f"e{i}", done=i != 0)
        )
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    ma = Trainer(a, TrainerConfig(microbatch_tokens=4096)).step(segs, 0)  # one micro-batch, single pass
    mb = Trainer(b, TrainerConfig(microbatch_tokens=32)).step(segs, 0)  # four micro-batches, two passes
    assert ma.loss == pytest.approx(mb.loss, rel=1e-4, abs=1e-6)
    for (n, pa), pb in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=1e-4, atol=1e-6, msg=n)
    assert any(not torch.equal(pa, pc) for pa, pc in zip(a.parameters(), base.parameters()))


def test_bad_segments_are_rejected_with_the_reason():
    model = tiny()
    good = sampled_segment(model, [1, 2, 3, 4], [2, 3], reward=1.0)
    trainer = Trainer(model)
    with pytest.raises(BatchError, match="at least one segment"):
        trainer.step([], 0)
    bad0 = Segment(**{**good.__dict__, "loss_mask": np.array([1, 0, 1, 1], bool)})
    with pytest.raises(BatchError, match="position 0"):
        trainer.step([bad0], 0)
    badr = Segment(**{**good.__dict__, "routing": np.zeros((4, 3, 2), np.int16)})
    with pytest.raises(BatchError, match="routing has shape"):
        trainer.step([badr], 0)
    bade = Segment(**{**good.__dict__, "routing": np.full((4, 2, 2), 7, np.int16)})
    with pytest.raises(BatchError, match="expert ids outside"):
        trainer.step([bade], 0)
    dup = good.routing.copy()
    dup[1, 0] = [2, 2]
    with pytest.raises(BatchError, match="repeats an expert at position 1, layer 0"):
        trainer.step([Segment(**{**good.__dict__, "routing": dup})], 0)
    badv = Segment(**{**good.__dict__, "tokens": np.array([1, 2, 3, 99999], np.int32)})
    with pytest.raises(BatchError, match="outside"):
        trainer.step([badv], 0)


async def test_checkpoint_loads_in_the_engine_and_resumes(tmp_path):
    from t1async.model.engine import Engine
    from t1async.model.records import EngineConfig, GenRequest
    from t1async.model.weights import save_pretrained

    model = tiny()
    base_dir = save_pretrained(model, tmp_path / "base")
    trainer = Trainer(model, TrainerConfig(lr=1e-2))
    seg = sampled_segment(model, [5, 6, 7, 100, 101], [3, 4], reward=1.0)
    trainer.step([seg], 0)
    info = trainer.save(tmp_path / "ckpt", policy_version=1)
    assert latest_checkpoint(tmp_path / "ckpt") == info

    prompt = [5, 6, 7, 100]
    x = torch.tensor([prompt])
    with torch.no_grad():
        want = torch.log_softmax(model(x).logits[0, -1].float(), -1)
    engine = Engine(base_dir, EngineConfig(max_batch=2, dtype="float32", prefix_cache_tokens=0))
    async with anyio.create_task_group() as tg:
        await tg.start(engine.run)
        await engine.update_weights_from_disk(info.path, "1")
        res = await engine.collect(GenRequest(rid="r", input_ids=tuple(prompt), max_new_tokens=1, temperature=0.0))
        tg.cancel_scope.cancel()
    tok = res.output_ids[0]
    assert tok == int(want.argmax())
    assert res.logprobs[0] == pytest.approx(float(want[tok]), abs=1e-4)

    # resume: a fresh model and optimizer continue exactly like the original
    fresh = tiny()
    t2 = Trainer(fresh, TrainerConfig(lr=1e-2))
    got = t2.load(info.path)
    assert (got.policy_version, got.step, t2.steps) == (1, 1, 1)
    seg2 = sampled_segment(model, [9, 8, 7, 300, 301], [3, 4], reward=-1.0)
    trainer.step([seg2], 1)
    t2.step([seg2], 1)
    for pa, pb in zip(model.parameters(), fresh.parameters()):
        torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-6)
    with pytest.raises(Exception, match="already exists"):
        save_checkpoint(tmp_path / "ckpt", model, trainer.optimizer, policy_version=1, step=2)


def _shift_after_one_step(lr: float) -> tuple:
    """Train one step at version 0 on fresh turns, then a step at version 1 holding fresh turns (sampled by
    the new weights) and stale ones (sampled by the version-0 weights)."""
    model = tiny()
    rng = np.random.default_rng(7)
    seqs = [rng.integers(10, 4000, size=24).tolist() for _ in range(4)]
    trainer = Trainer(model, TrainerConfig(lr=lr))
    stale_segs = [sampled_segment(model, s, range(12, 24), reward=1.0, episode=f"old{i}") for i, s in enumerate(seqs)]
    first = trainer.step(
        [sampled_segment(model, s, range(12, 24), reward=float(i % 2), episode=f"a{i}") for i, s in enumerate(seqs)], 0
    )
    fresh = [
        sampled_segment(model, s, range(12, 24), reward=1.0, policy_version=1, episode=f"new{i}")
        for i, s in enumerate(seqs)
    ]
    second = trainer.step(fresh + stale_segs, 1)
    return first, second


@pytest.mark.parametrize("lr", [1e-12, 3e-3])
def test_mismatch_counts_only_tokens_trained_at_the_version_that_sampled_them(lr):
    first, second = _shift_after_one_step(lr)
    # the 'sampler' is the learner's own fp32 weights: no train/inference mismatch, whatever the lr
    assert first.mismatch < 1e-4 and first.mismatch_tokens == 48 and first.policy_shift_tokens == 0
    assert second.mismatch < 1e-4 and second.mismatch_tokens == 48 and second.policy_shift_tokens == 48
    assert second.staleness_hist == {0: 48, 1: 48}
    assert set(second.policy_shift_by_staleness) == {1}
    if lr > 1e-6:  # the old mixed figure is policy change, not mismatch
        assert second.policy_shift > 1e-3 and second.mean_abs_dlogp > 10 * second.mismatch
    else:  # a frozen model: nothing moved
        assert second.policy_shift < 1e-4
    d = second.to_dict()
    assert d["policy_shift_by_staleness"] == {"1": pytest.approx(second.policy_shift)}


def test_policy_shift_grows_with_the_learning_rate():
    shifts = [_shift_after_one_step(lr)[1].policy_shift for lr in (1e-12, 1e-4, 3e-3)]
    assert shifts[0] < 1e-4 < shifts[1] < shifts[2]


def test_a_training_step_never_keeps_full_vocabulary_logits_for_backward():
    """Activation memory of the head is one checkpointed chunk's: no tensor of T x V elements (the [B, T, V]
    logits, their log-softmax) is saved for the backward pass. At 32k tokens those were 512 MB each."""
    model = tiny()
    t = 700
    toks = np.random.default_rng(3).integers(0, CFG.vocab_size, size=t)
    seg = sampled_segment(model, toks, range(350, t), reward=1.0)
    saved: list[tuple[int, tuple[int, ...]]] = []

    def pack(x: torch.Tensor) -> torch.Tensor:
        saved.append((x.numel(), tuple(x.shape)))
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        m = Trainer(model, TrainerConfig(lr=1e-3, entropy_coef=0.01)).step([seg], 0)
    assert m.loss_tokens == t - 350 and math.isfinite(m.loss)
    biggest = max(saved)
    assert biggest[0] < t * CFG.vocab_size // 4, f"a {biggest[1]} tensor was saved for backward"


def test_a_step_with_checkpointed_blocks_updates_the_weights_as_without():
    toks = np.random.default_rng(5).integers(0, CFG.vocab_size, size=90)
    after = []
    for ck in (False, True):
        model = tiny()
        segs = [
            sampled_segment(model, toks, range(40, 90), reward=1.0),
            sampled_segment(model, toks[:60], range(30, 60), reward=0.0, episode="b"),
        ]
        m = Trainer(model, TrainerConfig(lr=1e-3, checkpoint_blocks=ck, microbatch_tokens=100)).step(segs, 0)
        after.append((m, [p.detach().clone() for p in model.parameters()]))
    (m0, p0), (m1, p1) = after
    assert m0.loss == pytest.approx(m1.loss, rel=1e-5) and m0.grad_norm == pytest.approx(m1.grad_norm, rel=1e-4)
    for a, b in zip(p0, p1):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)


def _positive_reward_segments(model: MoETransformer) -> list[Segment]:
    """Four one-turn episodes whose rewards are all positive (tests passed are never negative)."""
    rng = np.random.default_rng(7)
    segs = []
    for i, (n, r) in enumerate(((30, 1.0), (24, 4.0), (17, 2.0), (9, 3.0))):
        toks = rng.integers(10, 4000, size=n).tolist()
        segs.append(sampled_segment(model, toks, range(n // 2, n), reward=r, episode=f"e{i}"))
    return segs


def test_advantages_are_whitened_over_all_loss_tokens_of_the_step(monkeypatch):
    # Rewards (tests passed) are >= 0 and a fresh value head is ~0, so raw advantages are all positive: every
    # sampled token would be pushed up. The step whitens them over ALL its loss tokens, across micro-batches.
    base = tiny()
    segs = _positive_reward_segments(base)
    raw, _ = advantages_fed_to_the_loss(
        monkeypatch, copy.deepcopy(base), TrainerConfig(normalize_advantages=False, microbatch_tokens=32), segs
    )
    assert raw.min() > 0  # the premise: every raw advantage is positive
    adv, calls = advantages_fed_to_the_loss(monkeypatch, copy.deepcopy(base), TrainerConfig(microbatch_tokens=32), segs)
    assert calls > 1  # several micro-batches
    assert adv.mean() == pytest.approx(0.0, abs=1e-5) and adv.std() == pytest.approx(1.0, abs=1e-4)
    # one shift and one scale for the whole step (not per micro-batch): an affine map of the raw advantages
    np.testing.assert_allclose(np.sort(adv), np.sort((raw - raw.mean()) / raw.std()), atol=1e-4)
    assert (adv < 0).sum() > 0 and (adv > 0).sum() > 0


def test_all_positive_rewards_still_lower_the_worse_replies_tokens():
    torch.manual_seed(0)
    model = tiny()
    trainer = Trainer(model, TrainerConfig(lr=3e-3))
    good, poor = [5, 6, 7, 100, 101], [5, 6, 7, 200, 201]
    before = logp_of(model, good, 3), logp_of(model, poor, 3)
    for _ in range(8):
        segs = [sampled_segment(model, good, [3, 4], reward=4.0), sampled_segment(model, poor, [3, 4], reward=1.0)]
        m = trainer.step(segs, policy_version=0)
        assert m.adv_mean > 0  # the raw advantages are positive...
    after = logp_of(model, good, 3), logp_of(model, poor, 3)
    assert after[0] > before[0] + 0.1
    assert after[1] < before[1] - 0.1  # ...but the below-average reply is made less likely


@pytest.mark.parametrize("critic", ["shared", "detached"])
def test_a_detached_critic_leaves_the_policy_update_to_the_policy_loss(critic):
    """With ``critic="detached"`` the value loss trains the value head only: the trunk and the LM head move the
    same whatever ``value_coef`` is (with a shared critic they do not), and the value head still learns."""
    from t1async.protocol.errors import ConfigError

    toks = np.random.default_rng(5).integers(0, CFG.vocab_size, size=60)
    runs = []
    for coef in (0.0, 0.5):
        torch.manual_seed(0)
        model = tiny()
        segs = [
            sampled_segment(model, toks, range(30, 60), reward=4.0),
            sampled_segment(model, toks[:40], range(20, 40), reward=0.0, episode="b"),
        ]
        cfg = TrainerConfig(lr=1e-3, critic=critic, value_coef=coef)
        Trainer(model, cfg).step(segs, 0)
        runs.append({n: p.detach().clone() for n, p in model.named_parameters()})
    (no_v, with_v), head = runs, "value_head.weight"
    policy = [n for n in no_v if not n.startswith("value_head")]
    moved = max(float((with_v[n] - no_v[n]).abs().max()) for n in policy)
    if critic == "detached":
        assert moved == 0.0, f"the value loss moved the policy's weights by {moved}"
        assert not torch.equal(with_v[head], no_v[head])  # the head itself learns from the value loss
    else:
        assert moved > 1e-6  # the shared critic's loss reaches the trunk
    with pytest.raises(ConfigError, match="critic must be 'shared' or 'detached'"):
        TrainerConfig(critic="frozen")


def test_cluster_up_critic_reaches_the_learners_trainer_config(tmp_path):
    import argparse

    from t1async.cluster.config import from_args
    from t1async.protocol.errors import ConfigError
    from tests.clusterargs import learner_argv, learner_toml, serve_args

    argv = learner_argv(tmp_path / "a", "--critic", "shared")
    assert learner_toml(argv)["critic"] == "shared" and "--critic" not in argv
    assert serve_args(argv).critic == "shared"
    assert serve_args(learner_argv(tmp_path / "b")).critic == "detached"  # the default
    with pytest.raises(ConfigError, match="--critic must be shared or detached"):
        from_args(argparse.Namespace(run_dir=tmp_path, critic="frozen"))


def test_bf16_training_autocasts_over_fp32_master_weights():
    """--train-dtype bfloat16: the forward runs in bf16 (its log-probs move by bf16 rounding), the weights
    and AdamW state stay fp32, and the steps still learn the right way."""
    torch.manual_seed(0)
    model = tiny()
    fp32 = Trainer(copy.deepcopy(model), TrainerConfig(lr=3e-3))
    bf16 = Trainer(copy.deepcopy(model), TrainerConfig(lr=3e-3, train_dtype="bfloat16"))
    good, bad = [5, 6, 7, 100, 101], [5, 6, 7, 200, 201]
    segs = [sampled_segment(model, good, [3, 4], reward=1.0), sampled_segment(model, bad, [3, 4], reward=-1.0)]
    gap = max(float(np.abs(a[0] - b[0]).max()) for a, b in zip(fp32.score(segs), bf16.score(segs)))
    assert 1e-4 < gap < 0.1  # bf16 rounding, not another model
    before = logp_of(bf16.model, good, 3), logp_of(bf16.model, bad, 3)
    for _ in range(8):
        segs = [
            sampled_segment(bf16.model, good, [3, 4], reward=1.0),
            sampled_segment(bf16.model, bad, [3, 4], reward=-1.0),
        ]
        m = bf16.step(segs, policy_version=0)
        assert math.isfinite(m.loss)
    after = logp_of(bf16.model, good, 3), logp_of(bf16.model, bad, 3)
    assert after[0] > before[0] + 0.1 and after[1] < before[1] - 0.1
    assert {p.dtype for p in bf16.model.parameters()} == {torch.float32}
    moments = [t for st in bf16.optimizer.state.values() for k, t in st.items() if k != "step"]
    assert moments and {t.dtype for t in moments} == {torch.float32}


def test_train_dtype_and_device_reach_the_learner_and_bad_ones_are_clear(tmp_path):
    import argparse

    from t1async.cluster.config import from_args
    from t1async.learner.trainer_config import torch_device
    from t1async.protocol.errors import ConfigError
    from tests.clusterargs import learner_argv, learner_toml, serve_args

    argv = learner_argv(tmp_path / "a", "--train-dtype", "bfloat16", "--device", "cuda")
    toml = learner_toml(argv)
    assert (toml["train_dtype"], toml["device"]) == ("bfloat16", "cuda")
    args = serve_args(argv)
    assert (args.train_dtype, args.device) == ("bfloat16", "cuda")
    defaults = serve_args(learner_argv(tmp_path / "b"))
    assert (defaults.train_dtype, defaults.device) == ("float32", "cpu")
    with pytest.raises(ConfigError, match="--train-dtype must be float32 or bfloat16"):
        from_args(argparse.Namespace(run_dir=tmp_path, train_dtype="float16"))
    with pytest.raises(ConfigError, match="train_dtype must be 'float32' or 'bfloat16'"):
        TrainerConfig(train_dtype="fp8")
    assert torch_device("cpu") == torch.device("cpu")
    if torch.cuda.is_available():
        assert torch_device("cuda").type == "cuda"
    else:
        with pytest.raises(ConfigError, match="--device cuda: torch sees no CUDA GPU"):
            torch_device("cuda")


def test_a_dense_layers_rows_are_not_counted_as_missing_routes():
    """Qwen3-MoE's mlp_only_layers route nothing: their recorded rows (zeros from the sampler, -1 once ingest
    has checked them) are neither compared nor missing. Seen failing on the old code (missing = the dense
    layer's rows)."""
    from dataclasses import replace

    model = MoETransformer(replace(CFG, n_layers=3, dense_layers=(1,)))
    seg = sampled_segment(model, [1, 2, 3, 4, 5, 6], [4, 5], reward=1.0)
    assert seg.routing is not None
    routing = seg.routing.copy()
    routing[:, 1] = -1  # the dense layer, as ingest leaves it
    m = Trainer(model).step([replace(seg, routing=routing)], policy_version=0)
    assert m.routing_missing == 0
    assert m.routing_compared == 2 * (6 - 1)  # the two MoE layers, every routed position
