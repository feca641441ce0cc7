"""The N-rank learner (learner/distributed.py, learner/ranks.py) with real ranks: rank 0 is this test
process, rank 1 a real ``python -m t1async.learner.ranks`` child (what torchrun would start), over a real gloo
group, the model sharded by FSDP2. Steps over 2 ranks give the weights one rank gives; each rank holds half
the weights; checkpoints (DCP) move between N=2 and N=1; a failed step and a dead rank fail loudly."""

from __future__ import annotations

import copy
import os
import signal

import numpy as np
import pytest
import torch

from t1async.learner.distributed import DistributedTrainer, RankFailedError, balance, place
from t1async.learner.ranks import Ranks, RanksConfig
from t1async.learner.trainer import Trainer, state_bytes
from t1async.learner.trainer_config import TrainerConfig
from tests.segments import TCFG, segments, tiny

# Adam's first steps move a weight by ~lr * g / (|g| + eps) whatever |g| is, so a weight whose gradient is near 0
# amplifies the float difference of summing the gradient over two ranks instead of one. atol 1e-5 (0.1% of
# lr 1e-2) failed on 1 of 131,072 weights by 1.5e-5 under load; 1e-4 (1% of a step) still catches a rank whose
# gradient is left out of the sum (seen: 5783 weights off, by up to 0.034).
WEIGHT_ATOL = 1e-2 * TCFG.lr


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    """``b`` may be a DistributedTrainer's sharded model: its full weights are gathered first."""
    full = b.export_model() if isinstance(b, DistributedTrainer) else b
    for (name, pa), (_, pb) in zip(a.named_parameters(), full.named_parameters()):
        torch.testing.assert_close(
            pa.detach(), pb.detach(), rtol=1e-4, atol=WEIGHT_ATOL, msg=lambda m, n=name: f"{n}: {m}"
        )


def moved(base: torch.nn.Module, trainer: DistributedTrainer) -> float:
    full = trainer.export_model()
    return max(float((p - q).detach().abs().max()) for p, q in zip(base.parameters(), full.parameters()))


def test_balance_splits_by_tokens():
    parts = balance([100, 10, 10, 10, 90, 5], 2)
    loads = [sum([100, 10, 10, 10, 90, 5][i] for i in p) for p in parts]
    assert sorted(i for p in parts for i in p) == list(range(6))
    assert max(loads) - min(loads) <= 10, loads
    assert balance([7], 3) == [[0], [], []]  # fewer segments than ranks: a rank may get none


def test_two_ranks_step_like_one_rank_and_hold_half_each(ranks2):
    ranks, holder = ranks2
    torch.manual_seed(0)
    base = tiny()
    one = Trainer(copy.deepcopy(base), TCFG)
    two = holder["trainer"] = ranks.start(copy.deepcopy(base), TCFG)
    assert isinstance(two, DistributedTrainer) and two.world == 2
    for v in range(3):  # 3 steps, each with 2 PPO epochs; the ranks get different numbers of micro-batches
        segs = segments(one.model, seed=v, policy_version=v)
        m1, m2 = one.step(segs, v), two.step(segs, v)
        assert (m2.segments, m2.tokens, m2.loss_tokens, m2.turns) == (m1.segments, m1.tokens, m1.loss_tokens, m1.turns)
        for k in ("loss", "policy_loss", "value_loss", "clip_frac", "grad_norm", "mean_abs_dlogp", "adv_mean"):
            assert getattr(m2, k) == pytest.approx(getattr(m1, k), rel=1e-3, abs=1e-5), (v, k)
        assert m2.routing_compared == m1.routing_compared and m2.staleness_hist == m1.staleness_hist
    assert moved(base, two) > 1e-3  # the steps moved the weights, so the comparison below means something
    assert_same_weights(one.model, two)
    # one segment for two ranks: rank 1 runs only zero-weight micro-batches, yet takes the same optimizer step
    seg = segments(one.model, n=1, seed=4, policy_version=3)
    m1, m2 = one.step(seg, 3), two.step(seg, 3)
    assert_same_weights(one.model, two)
    assert m2.loss == pytest.approx(m1.loss, rel=1e-4, abs=1e-6)
    # each rank holds half of the parameters, gradients and AdamW moments (FSDP2's shards)
    whole = state_bytes(one)
    for r, mem in enumerate(two.rank_memory()):
        for k in ("param_bytes", "grad_bytes", "optim_bytes"):
            assert mem[k] / whole[k] == pytest.approx(0.5, abs=0.03), (r, k, mem[k], whole[k])


def test_checkpoints_resume_from_two_ranks_to_one_and_back(ranks2, tmp_path):
    """torch.distributed.checkpoint reshards: written by 2 ranks, resumed by 1, written by 1, resumed by 2; the
    weights, the AdamW moments and the version/step numbers carry over, and the model dir holds the full
    weights for the samplers."""
    from t1async.model.weights import load_pretrained

    ranks, holder = ranks2
    torch.manual_seed(1)
    base = tiny()
    two = holder["trainer"] = ranks.start(copy.deepcopy(base), TCFG)
    two.step(segments(base), 0)
    ck = two.save(tmp_path / "ck", 1)
    assert (ck.policy_version, ck.step) == (1, 1) and sorted(p.name for p in (ck.path / "dcp").iterdir())
    assert_same_weights(load_pretrained(ck.path), two)  # the model dir: the full weights, gathered
    # N=2 -> N=1: a plain trainer resumes from it and steps like the 2-rank trainer goes on
    one = Trainer(tiny(), TCFG)
    assert one.load(ck.path).step == 1 and one.steps == 1
    assert_same_weights(one.model, two)
    assert state_bytes(one)["optim_bytes"] > 0  # the moments came with it
    segs = segments(one.model, seed=2, policy_version=1)
    one.step(segs, 1)
    two.step(segs, 1)
    assert_same_weights(one.model, two)
    # N=1 -> N=2: the 2-rank trainer loads a 1-rank checkpoint (its own weights are stale: step on one only)
    one.step(segments(one.model, seed=5, policy_version=2), 2)
    ck1 = one.save(tmp_path / "ck1", 3)
    two.load(ck1.path)
    assert two.steps == one.steps == 3
    assert_same_weights(one.model, two)
    segs = segments(one.model, seed=3, policy_version=3)
    one.step(segs, 3)
    two.step(segs, 3)
    assert_same_weights(one.model, two)
    assert two.save(tmp_path / "ck1", 4).step == one.steps == 4


def test_a_failed_step_fails_on_every_rank_and_restore_resets_both(ranks2, tmp_path):
    """Rank 0 raises in its second PPO epoch, after every rank took the first epoch's optimizer step. Rank 1
    learns of it at the meeting before the optimizer step (no hang); ``restore`` (as the service does) puts
    every rank's shards back, so the next step equals one rank's from the checkpoint."""
    ranks, holder = ranks2
    torch.manual_seed(2)
    base = tiny()
    two = holder["trainer"] = ranks.start(copy.deepcopy(base), TCFG)
    two.step(segments(base, seed=7), 0)
    ck = two.save(tmp_path / "ck", 1)
    calls = {"n": 0}
    real = two._optimizer_step

    def second_epoch_fails() -> float:
        calls["n"] += 1
        if calls["n"] == 2:
            raise FloatingPointError("injected")
        return real()

    two._optimizer_step = second_epoch_fails  # type: ignore[method-assign]
    segs = segments(base, policy_version=1)
    with pytest.raises(FloatingPointError, match="injected"):
        two.step(segs, 1)
    del two._optimizer_step
    assert two.restore(tmp_path / "ck", 1, tmp_path / "unused") == str(ck.path)
    one = Trainer(tiny(), TCFG)
    one.load(ck.path)
    one.step(segs, 1)
    two.step(segs, 1)
    assert_same_weights(one.model, two)


def test_a_rank_killed_mid_step_fails_the_step_loudly(ranks2):
    ranks, holder = ranks2
    base = tiny()
    two = holder["trainer"] = ranks.start(copy.deepcopy(base), TCFG)
    real = two._adv_moments

    def kill_rank_1_then_meet(adv):  # noqa: ANN001, ANN202 - mid-step: scored, before the update
        holder["exit_codes"] = [-signal.SIGKILL]
        os.kill(ranks.procs[0].pid, signal.SIGKILL)
        ranks.procs[0].wait(30)
        return real(adv)

    two._adv_moments = kill_rank_1_then_meet  # type: ignore[method-assign]
    with pytest.raises(RankFailedError, match="a rank died"):
        two.step(segments(base, n=3), 0)
    import anyio

    with pytest.raises(
        RankFailedError, match=r"learner rank 1 \(pid \d+\) exited with code -9; .*resumes from its last"
    ):
        anyio.run(ranks.watch)


def test_ranks_that_never_join_fail_in_one_line(monkeypatch):
    monkeypatch.setattr("sys.executable", "/bin/false")  # rank 1 exits at once with code 1
    ranks = Ranks(RanksConfig(nproc=2, join_timeout_s=3))
    try:
        with pytest.raises(RankFailedError, match=r"did not join within 3 s \(exit code by pid.*: \{\d+: 1\}"):
            ranks.start(tiny(), TCFG)
    finally:
        ranks.close(None)
    assert ranks.procs == [] and not ranks.joined


def test_two_ranks_share_the_steps_turn_baseline(ranks2):
    """advantage="turn" centres each turn on the mean of the WHOLE step's turns with its number: rank 1 gets rank
    0's baseline, so 2 ranks step like 1 (a per-rank mean would centre each rank's share on its own rewards).
    With the detached critic (the value head run apart from the model's forward) and ``score`` too."""
    ranks, holder = ranks2
    cfg = TrainerConfig(lr=1e-2, microbatch_tokens=64, advantage="turn", critic="detached")
    torch.manual_seed(0)
    base = tiny()
    segs = segments(base)
    one = Trainer(copy.deepcopy(base), cfg)
    m1 = one.step(segs, 0)
    two = holder["trainer"] = ranks.start(copy.deepcopy(base), cfg)
    m2 = two.step(segs, 0)
    assert_same_weights(one.model, two)
    assert m2.adv_mean == pytest.approx(m1.adv_mean, abs=1e-6) and m2.adv_std == pytest.approx(m1.adv_std, rel=1e-4)
    for (lp1, r1), (lp2, r2) in zip(one.score(segs), two.score(segs)):
        np.testing.assert_allclose(lp1, lp2, atol=1e-4)
        assert (r1 == r2).mean() > 0.99


def test_an_old_single_file_checkpoint_loads_on_one_rank_and_refuses_two_in_one_line(ranks2, tmp_path):
    """The format before DCP (AdamW moments in trainer_state.safetensors) still resumes on one rank."""
    import json

    from safetensors.torch import save_file

    from t1async.learner.checkpoint import FORMAT_V1, STATE_JSON, STATE_TENSORS
    from t1async.model.weights import save_pretrained
    from t1async.protocol.errors import ConfigError

    torch.manual_seed(3)
    src = Trainer(tiny(), TCFG)
    src.step(segments(src.model, n=3), 0)
    d = tmp_path / "v000001"
    save_pretrained(src.model, d)
    names = {id(p): n for n, p in src.model.named_parameters()}
    moments = {
        f"{names[id(p)]}.{k}": v.detach().clone() for p, st in src.optimizer.state.items() for k, v in st.items()
    }
    save_file(moments, str(d / STATE_TENSORS))
    groups = [{k: v for k, v in g.items() if k != "params"} for g in src.optimizer.param_groups]
    meta = {"format": FORMAT_V1, "policy_version": 1, "step": 1, "param_groups": groups}
    (d / STATE_JSON).write_text(json.dumps(meta, default=list))
    one = Trainer(tiny(), TCFG)
    assert one.load(d).step == 1
    assert_same_weights(src.model, one.model)
    segs = segments(src.model, seed=1, policy_version=1)
    src.step(segs, 1)
    one.step(segs, 1)
    assert_same_weights(src.model, one.model)  # the moments came too
    ranks, holder = ranks2
    two = holder["trainer"] = ranks.start(tiny(), TCFG)
    with pytest.raises(ConfigError, match=r"old single-file checkpoint: resume it once with --nproc 1"):
        two.load(d)


def test_two_ranks_train_in_bf16_like_one_rank(ranks2):
    """--train-dtype bfloat16 reaches every rank (the config travels with the model): two ranks' bf16 steps
    match one rank's bf16 steps, and every rank keeps fp32 weights."""
    ranks, holder = ranks2
    torch.manual_seed(0)
    base = tiny()
    cfg = TrainerConfig(**{**TCFG.__dict__, "train_dtype": "bfloat16"})
    one = Trainer(copy.deepcopy(base), cfg)
    two = holder["trainer"] = ranks.start(copy.deepcopy(base), cfg)
    for v in range(2):
        segs = segments(one.model, seed=v, policy_version=v)
        m1, m2 = one.step(segs, v), two.step(segs, v)
        assert m2.loss == pytest.approx(m1.loss, rel=1e-2, abs=1e-4), v
    assert moved(base, two) > 1e-3
    full = two.export_model()
    assert {p.dtype for p in full.parameters()} == {torch.float32}
    # bf16 rounds differently in other micro-batches, and AdamW turns a tiny gradient of either sign into a
    # step of ~lr: a few weights differ by up to ~5 lr, the rest agree; 4 optimizer steps (2 steps x 2 epochs)
    # bound any difference by 8 lr. Two ranks also gather the weights in bf16 (FSDP's MixedPrecisionPolicy:
    # norms and router too, which one rank's autocast keeps fp32): seen 1.7% of weights off by more than 2e-3
    # (0.27% without it), 99th percentile 3.1e-3 (6.8e-4), median 3e-5 against a median move of 1e-2
    diff = torch.cat([(p - q).detach().abs().flatten() for p, q in zip(one.model.parameters(), full.parameters())])
    assert float(torch.quantile(diff, 0.99)) < 0.5 * cfg.lr and float(torch.quantile(diff, 0.5)) < 1e-2 * cfg.lr
    assert float(diff.max()) < 8 * cfg.lr


def test_two_ranks_anchor_to_a_sharded_reference_like_one_rank(ranks2, tmp_path):
    """--kl-ref-coef at 2 ranks: each rank reads its own half of the reference (``load_reference``), and the
    steps (loss, the KL term) and weights equal one rank's with a whole reference. A reference whose shapes
    differ is refused with no rank left waiting. Before this, the N-rank learner refused the flag."""
    from dataclasses import replace

    from t1async.model.moe import MoETransformer
    from t1async.model.weights import save_pretrained
    from t1async.protocol.errors import ConfigError

    ranks, holder = ranks2
    torch.manual_seed(0)
    base = tiny()
    cfg = TrainerConfig(**{**TCFG.__dict__, "kl_ref_coef": 1.0, "prefix_kv": "exact"})
    ref_dir = save_pretrained(base, tmp_path / "ref")
    one = Trainer(copy.deepcopy(base), cfg)
    one.load_reference(ref_dir)
    two = holder["trainer"] = ranks.start(copy.deepcopy(base), cfg)
    other = save_pretrained(MoETransformer(replace(base.cfg, d_ff=2 * base.cfg.d_ff)), tmp_path / "other")
    with pytest.raises(ConfigError, match="differs from the policy"):
        two.load_reference(other)
    assert two.ref is None
    two.load_reference(ref_dir)  # a command every rank joins: none was left behind by the refusal
    for v in range(3):
        segs = segments(one.model, seed=v, policy_version=v)
        m1, m2 = one.step(segs, v), two.step(segs, v)
        for k in ("loss", "policy_loss", "kl_ref", "grad_norm"):
            assert getattr(m2, k) == pytest.approx(getattr(m1, k), rel=1e-3, abs=1e-6), (v, k)
        assert v == 0 or m1.kl_ref > 1e-6, (v, m1.kl_ref)  # the policy moved off its reference: a term to match
    assert_same_weights(one.model, two)
    whole = state_bytes(one)["ref_bytes"]
    assert whole == state_bytes(one)["param_bytes"]
    for r, mem in enumerate(two.rank_memory()):
        assert mem["ref_bytes"] / whole == pytest.approx(0.5, abs=0.03), (r, mem["ref_bytes"], whole)


def test_place_keeps_an_episode_on_the_rank_that_holds_its_keys():
    """``place`` (--prefix-kv reuse): an episode's segments go together; an episode with a home stays there while
    its new positions fit, and moves when staying would overload its home; one with none balances by tokens."""
    from types import SimpleNamespace

    def seg(ep: str, n: int) -> SimpleNamespace:
        return SimpleNamespace(episode=ep, tokens=np.arange(n, dtype=np.int32))

    segs = [seg("a", 100), seg("b", 90), seg("a", 110), seg("c", 20)]
    assert place(segs, {}, 2) == [[0, 2], [1, 3]]  # a's two parts together (210), then b and c on the other
    # a's 100 positions are kept on rank 1: it costs 10 there, so it goes there, and b (no home) goes to rank 0
    homes = {"a": (1, np.arange(100, dtype=np.int32))}
    assert place(segs, homes, 2) == [[1], [0, 2, 3]]
    # both at home on rank 0: a's new positions (10) and b's (all 90, its kept tokens differ) ...
    homes = {"a": (0, np.arange(100, dtype=np.int32)), "b": (0, np.full(90, 7, np.int32))}
    assert place(segs, homes, 2) == [[0, 2, 3], [1]]  # ... b costs as much anywhere: it goes to the idle rank
    assert place([seg("a", 5)], {"a": (3, np.arange(5, dtype=np.int32))}, 2) == [[0], []]  # a home past N


def growing_episodes(n: int = 3, turns: int = 7, cut_every: int = 2) -> list[list]:
    """``n`` episodes of ``turns`` turns, fed to an assembler turn by turn side by side; every ``cut_every`` turns
    the open episodes are cut (as the learner cuts due episodes). Returns each step's segments."""
    from t1async.ingest.assembly import Assembler
    from t1async.testing.episodes import Sizes, make_episode

    sizes = Sizes(prompt=(40, 60), output=(8, 16), observation=(20, 40), vocab=300)
    eps = [
        make_episode(
            np.random.default_rng(i), ["clean"] * (turns - 1 - i), episode=f"e{i}", sizes=sizes, layers=2, num_experts=4
        ).records
        for i in range(n)
    ]
    asm, steps = Assembler(), []
    for j in range(max(len(r) for r in eps)):
        segs = [s for r in eps if j < len(r) for s in asm.feed(r[j])]
        if j % cut_every == 0:
            segs += asm.cut()
        if segs:
            steps.append(segs)
    return steps


@pytest.mark.parametrize("prefix", ["reuse", "exact"])
def test_two_ranks_train_growing_episodes_like_one_rank(ranks2, prefix):
    """Three episodes growing turn by turn, cut every 2 turns, over 2 ranks: the steps equal one rank's with the
    same --prefix-kv (losses, forwarded positions, weights). With reuse each rank keeps its episodes' keys and
    values, primes cuts whose kept keys aged out (max age 2), and the ranks agree on their micro-batch and priming
    counts; every episode stays on the rank holding its keys, so the kept positions attended to equal one rank's.
    On the old code 2 ranks re-forwarded everything (reused 0). Against the exact step reuse forwards less and its
    log-probs stay within the stated bound (its gradient lacks the path through the kept keys: not allclose)."""
    from t1async.model.config import MoEConfig
    from t1async.model.moe import MoETransformer

    ranks, holder = ranks2
    mcfg = MoEConfig(vocab_size=300, d_model=32, n_layers=2, n_heads=2, n_experts=4, top_k=2, d_ff=32, max_seq_len=4096)
    cfg = TrainerConfig(
        lr=1e-2, microbatch_tokens=256, prefix_kv=prefix, prefix_kv_max_age=2, prefix_kv_prime_tokens=32
    )
    torch.manual_seed(0)
    base = MoETransformer(mcfg)
    one = Trainer(copy.deepcopy(base), cfg)
    two = holder["trainer"] = ranks.start(copy.deepcopy(base), cfg)
    exact = Trainer(copy.deepcopy(base), TrainerConfig(**{**cfg.__dict__, "prefix_kv": "exact"}))
    steps = growing_episodes()
    assert len(steps) >= 4 and max(len(s) for s in steps) == 3
    m2s, mes = [], []
    for v, segs in enumerate(steps):
        m1, m2, me = one.step(segs, v), two.step(segs, v), exact.step(segs, v)
        m2s.append(m2)
        mes.append(me)
        for k in ("loss", "policy_loss", "value_loss", "grad_norm", "mean_abs_dlogp"):
            assert getattr(m2, k) == pytest.approx(getattr(m1, k), rel=1e-3, abs=1e-5), (v, k)
        # forwarded_tokens differ: one rank trains several micro-batches on their scoring forwards' graph
        # (one_pass_tokens), N ranks only a single one (DistributedTrainer._one_pass) and re-forward the rest
        for k in ("loss_tokens", "backward_tokens", "new_tokens"):
            assert getattr(m2, k) == getattr(m1, k), (v, k)
        assert (m2.prefix_reused_tokens, m2.prefix_primed_tokens) == (m1.prefix_reused_tokens, m1.prefix_primed_tokens)
        assert m2.prefix_max_age == m1.prefix_max_age
        # keys kept from weights up to 2 versions older, at 100x the default lr: the log-probs move by < 1%
        assert m2.mean_abs_dlogp == pytest.approx(me.mean_abs_dlogp, rel=0.01), v
    assert moved(base, two) > 1e-3
    assert_same_weights(one.model, two)
    reused = sum(m.prefix_reused_tokens for m in m2s)
    if prefix == "reuse":
        assert reused > 0 and sum(m.prefix_primed_tokens for m in m2s) > 0
        assert sum(m.backward_tokens for m in m2s) < 0.6 * sum(m.backward_tokens for m in mes)
        assert sum(m.forwarded_tokens for m in m2s) < sum(m.forwarded_tokens for m in mes)
    else:
        assert reused == 0
