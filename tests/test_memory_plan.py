"""bench.memory_plan on a tiny Qwen3-MoE config: the traced step's numbers agree with the model and with each other."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from bench import memory_plan as mp
from t1async.model import moe
from t1async.model.config import QWEN3_MOE, MoEConfig

TOKENS = 256  # each trace runs a few thousand ops on fake tensors: seconds, whatever the sizes


@pytest.fixture(scope="module")
def cfg() -> MoEConfig:
    return MoEConfig(
        architecture=QWEN3_MOE,
        qk_norm=True,
        vocab_size=512,
        d_model=64,
        n_layers=3,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        n_experts=8,
        top_k=2,
        d_ff=32,
        dense_d_ff=96,
    )


@pytest.fixture(scope="module")
def base(cfg) -> mp.Plan:
    return mp.trace(cfg, world=4, tokens=TOKENS, flags=mp.PlanFlags())


def _optimizer_phase(p: mp.Plan) -> dict[str, int]:
    return p.phases["optimizer"]


def test_params_are_the_real_models_and_each_rank_holds_its_share(cfg, base):
    real = moe.MoETransformer(cfg, init=False)
    numel = sum(p.numel() for p in real.parameters())
    assert mp.count_params(cfg) == numel
    held = _optimizer_phase(base)
    share = numel * 4 / 4  # fp32, world 4
    # FSDP pads dim 0 to a multiple of the world: a little over the exact share, never under
    for part in ("sharded_params", "sharded_grads"):
        assert share <= held[part] <= share * 1.02, (part, held[part], share)
    assert 2 * share <= held["optimizer_state"] <= 2 * share * 1.02  # AdamW's two moments


def test_a_later_step_holds_adams_moments_from_its_start(cfg, base):
    # AdamW makes its moments in its first step: every later step starts with them, so they add to every phase
    moments = _optimizer_phase(base)["optimizer_state"]
    assert moments > 0
    for ph, cats in base.phases.items():
        assert cats["optimizer_state"] == moments, ph
    first = mp.trace(cfg, world=4, tokens=TOKENS, flags=mp.PlanFlags(), first_step=True)
    for ph in ("forward_1", "backward_1", "clip"):
        assert first.phases[ph]["optimizer_state"] == 0
        assert base.phases[ph]["total"] - first.phases[ph]["total"] == moments, ph
    assert first.phases["optimizer"]["total"] == base.phases["optimizer"]["total"]
    assert base.peak_bytes == first.peak_bytes + moments


def test_the_plan_is_what_the_step_holds_on_real_tensors(cfg):
    # the same step, run for real on this CPU at world 1 under the same tracker: the fake tensors, the fake
    # group and the balanced routing change nothing in the bytes
    planned = mp.trace(cfg, world=1, tokens=TOKENS, flags=mp.PlanFlags())
    real = mp.measure(cfg, tokens=TOKENS, flags=mp.PlanFlags())
    assert not torch.distributed.is_initialized()
    for ph, cats in planned.phases.items():
        assert real["phases"][ph]["total"] == cats["total"], ph
    numel = mp.count_params(cfg)
    assert 3 * numel * 4 <= real["held"] <= 3 * numel * 4 * 1.02  # fp32 parameters and AdamW's two moments
    assert real["rss_peak"] >= real["rss_before"] > 0


def test_peak_grows_with_tokens(cfg, base):
    more = mp.trace(cfg, world=4, tokens=2 * TOKENS, flags=mp.PlanFlags())
    assert more.peak_bytes > base.peak_bytes
    for ph in ("forward_1", "backward_1"):
        assert more.phases[ph]["total"] > base.phases[ph]["total"]
    # the sharded state does not depend on the tokens
    assert _optimizer_phase(more)["optimizer_state"] == _optimizer_phase(base)["optimizer_state"]


def test_two_ranks_hold_twice_the_sharded_part_of_four(cfg, base):
    two = mp.trace(cfg, world=2, tokens=TOKENS, flags=mp.PlanFlags())
    for part in ("sharded_params", "sharded_grads", "optimizer_state"):
        b4, b2 = _optimizer_phase(base)[part], _optimizer_phase(two)[part]
        assert b2 == pytest.approx(2 * b4, rel=0.02), part
    # what is not sharded (activations of this rank's tokens) stays
    assert two.phases["forward_1"]["activations"] == base.phases["forward_1"]["activations"]


def test_bf16_parameters_halve_the_gathered_weights(cfg, base):
    bf16 = mp.trace(cfg, world=4, tokens=TOKENS, flags=mp.PlanFlags(param_dtype="bfloat16"))
    g32 = base.phases["forward_1"]["gathered_params"]
    g16 = bf16.phases["forward_1"]["gathered_params"]
    assert g32 > 0 and g16 == pytest.approx(g32 / 2, rel=0.02)
    # the master weights and AdamW stay fp32
    assert _optimizer_phase(bf16)["optimizer_state"] == _optimizer_phase(base)["optimizer_state"]


def test_checkpointing_keeps_fewer_activations(cfg, base):
    kept = mp.trace(cfg, world=4, tokens=TOKENS, flags=mp.PlanFlags(checkpoint_blocks=False))
    assert kept.phases["forward_1"]["activations"] > base.phases["forward_1"]["activations"]


def test_a_second_microbatch_runs_with_the_first_ones_gradients(cfg):
    two = mp.trace(cfg, world=4, tokens=TOKENS, flags=mp.PlanFlags(microbatch_tokens=TOKENS // 2))
    assert two.microbatches == 2
    assert two.phases["forward_1"]["sharded_grads"] == 0
    assert two.phases["forward_2"]["sharded_grads"] > 0


def test_layers_extended_linearly_match_a_full_trace(cfg):
    deep = dataclasses.replace(cfg, n_layers=5)
    full = mp.trace(deep, world=4, tokens=TOKENS, flags=mp.PlanFlags())
    ext = mp.plan(deep, world=4, tokens=TOKENS, flags=mp.PlanFlags(), layers=3)
    assert ext.scaled and not full.scaled
    for ph, cats in full.phases.items():
        assert ext.phases[ph]["total"] == pytest.approx(cats["total"], rel=0.01), ph
    assert ext.peak_phase == full.peak_phase


def test_the_expert_loop_traces_with_balanced_routing(cfg, base, monkeypatch):
    # without torch._grouped_mm the model loops over the experts, reading bincount's counts back
    monkeypatch.setattr(moe, "_grouped_mm", None)
    loop = mp.trace(cfg, world=4, tokens=TOKENS, flags=mp.PlanFlags())
    assert loop.peak_bytes == pytest.approx(base.peak_bytes, rel=0.25)
    assert _optimizer_phase(loop)["optimizer_state"] == _optimizer_phase(base)["optimizer_state"]


def test_cli_json_and_search(cfg, tmp_path, capsys):
    path = tmp_path / "config.json"
    cfg.save(path)
    mp.main(["--config", str(path), "--world", "4", "--tokens", str(TOKENS), "--layers", "0", "--json"])
    rep = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rep["params"] == mp.count_params(cfg) and rep["world"] == 4 and rep["tokens"] == TOKENS
    assert rep["fits"] and rep["peak_gb_per_rank"] == round(rep["peak_bytes_per_rank"] / 2**30, 2)
    # a budget the defaults miss: the search names flags whose plan is under it
    budget = 0.9 * rep["peak_bytes_per_rank"] / 2**30
    mp.main(
        ["--config", str(path), "--world", "4", "--tokens", str(TOKENS), "--layers", "0"]
        + ["--budget-gb", str(budget), "--search", "--json"]
    )
    found = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert not found["fits"]
    fit = found["fit"]
    assert fit is not None and fit["fits"] and fit["argv"]
    assert fit["peak_bytes_per_rank"] <= budget * 2**30


def test_bad_flags_are_one_line(tmp_path):
    with pytest.raises(SystemExit, match="--layers 0 or >= 3"):
        mp.main(["--config", str(tmp_path), "--layers", "2"])
    with pytest.raises(SystemExit, match="give --world 1"):
        mp.main(["--config", str(tmp_path), "--world", "2", "--measure"])
    with pytest.raises(SystemExit, match="no model config"):
        mp.main(["--config", str(tmp_path / "missing.json")])


def test_no_process_group_is_left_behind(cfg, base):
    assert not torch.distributed.is_initialized()
