"""The training MoE's grouped experts (t1async/model/moe.py ``ExpertPath.GROUPED``) against the per-expert loop
it replaced
(``ExpertPath.LOOP``, the reference): the same outputs, routes and gradients in fp32 and in bf16, under
R3 replay, with a fixed op count whatever the number of experts and no host read of a tensor's value; and
the lm_head's log-prob chunk sized by the vocabulary."""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.profiler import ProfilerActivity, profile

from t1async.model import moe as moe_mod
from t1async.model.config import MoEConfig
from t1async.model.moe import LOGPROB_BYTES, ExpertPath, MoE, MoETransformer, logprob_chunk

# d_ff 24: 48 bf16 bytes a row, not a multiple of 16, so bf16 takes the padded branch; the shared expert and
# a dense layer ride along so every MoE option goes through both paths
CFG = MoEConfig(
    vocab_size=97,
    d_model=32,
    n_layers=3,
    n_heads=4,
    n_kv_heads=2,
    n_experts=6,
    top_k=2,
    d_ff=24,
    shared_d_ff=20,
    dense_layers=(1,),
    dense_d_ff=28,
    max_seq_len=256,
    init_std=0.1,
    seed=3,
)


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """Tiny matrices: a second OpenMP thread costs more than it saves on 2 shared cores (restored after)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def ids(b: int, t: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, CFG.vocab_size, (b, t), generator=torch.Generator().manual_seed(seed))


def pair(cfg: MoEConfig = CFG) -> tuple[MoETransformer, MoETransformer]:
    """The same weights twice: grouped experts, and the loop."""
    grouped = MoETransformer(cfg)
    loop = copy.deepcopy(grouped)
    loop.set_expert_path(ExpertPath.LOOP)
    return grouped, loop


def step(model: MoETransformer, x: torch.Tensor, replay: torch.Tensor | None, autocast: bool):
    """One training forward and backward (the trainer's: no logits, chunked log-probs, the value head)."""
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = model(x, replay=replay, logits=False)
        lp, ent = model.token_logprobs(out.hidden, x, with_entropy=True)
        assert ent is not None
        loss = -lp.mean() - 0.01 * ent.mean() + out.values.square().mean() + 1e-3 * out.router_logits.square().mean()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out, lp.detach(), grads


def assert_grads_close(a: dict, b: dict, rtol: float, atol: float) -> None:
    assert a.keys() == b.keys() and any(".w_gate" in n for n in a)
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


def recorded_with_holes(free: torch.Tensor) -> torch.Tensor:
    """A replay that differs from the free routing: rows shuffled among tokens, some rows missing (-1)."""
    rp = free.flip(1).clone()
    rp[:, ::5] = -1
    return rp


@pytest.mark.parametrize("replayed", [False, True], ids=["free", "replay"])
def test_grouped_experts_match_the_loop_in_fp32(replayed):
    grouped, loop = pair()
    x = ids(2, 40)
    rp = recorded_with_holes(loop(x).routing) if replayed else None
    og, lpg, gg = step(grouped, x, rp, autocast=False)
    ol, lpl, gl = step(loop, x, rp, autocast=False)
    assert torch.equal(og.routing, ol.routing) and torch.equal(og.free_topk, ol.free_topk)
    if replayed:  # the replay was followed where it was given
        for layer in CFG.moe_layers:
            given = (rp[:, :, layer] >= 0).all(-1)
            assert torch.equal(og.routing[:, :, layer][given], rp[:, :, layer][given])
        assert not torch.equal(og.routing, og.free_topk)
    torch.testing.assert_close(lpg, lpl, rtol=1e-5, atol=1e-6)
    assert_grads_close(gg, gl, rtol=1e-4, atol=1e-6)


def test_grouped_experts_match_the_loop_in_bf16():
    """Under the trainer's bf16 autocast over fp32 weights, and with the weights themselves in bf16 (what
    FSDP's mixed precision hands the layer): same routes, gradients within bf16's rounding."""
    grouped, loop = pair()
    x = ids(2, 40, seed=1)
    og, lpg, gg = step(grouped, x, None, autocast=True)
    ol, lpl, gl = step(loop, x, None, autocast=True)
    assert torch.equal(og.routing, ol.routing)
    torch.testing.assert_close(lpg, lpl, rtol=2e-2, atol=2e-2)
    assert_grads_close(gg, gl, rtol=5e-2, atol=2e-3)

    grouped, loop = grouped.to(torch.bfloat16), loop.to(torch.bfloat16)
    og, lpg, gg = step(grouped, x, og.routing, autocast=False)
    ol, lpl, gl = step(loop, x, og.routing, autocast=False)
    assert grouped.blocks[0].moe.w_gate.grad.dtype == torch.bfloat16
    torch.testing.assert_close(lpg, lpl, rtol=2e-2, atol=2e-2)
    assert_grads_close(gg, gl, rtol=5e-2, atol=5e-3)


def test_an_expert_no_token_chose_gets_a_zero_gradient():
    cfg = MoEConfig(d_model=32, n_heads=4, n_experts=8, top_k=2, d_ff=32)
    layer = MoE(cfg)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.1)
    x = torch.randn(12, 32)
    replay = torch.tensor([[0, 3]] * 6 + [[3, 5]] * 6)
    layer(x, replay)[0].square().sum().backward()
    used = layer.w_gate.grad.flatten(1).abs().sum(1) > 0
    assert used.tolist() == [True, False, False, True, False, True, False, False]


def test_float64_takes_the_loop():
    """``_grouped_mm`` multiplies fp32, bf16 and fp16 only: a float64 layer (exactness tests) uses the loop."""
    cfg = MoEConfig(d_model=32, n_heads=4, n_experts=4, top_k=2, d_ff=32)
    layer = MoE(cfg).double()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.1)
    x = torch.randn(10, 32, dtype=torch.float64)
    out = layer(x)[0]
    layer.path = ExpertPath.LOOP
    assert out.dtype == torch.float64 and torch.equal(out, layer(x)[0])


def top_level_ops(layer: MoE, x: torch.Tensor) -> Counter[str]:
    """The ops one forward and backward of ``layer`` dispatches from Python (the profiler's root events:
    inside CPU's ``_grouped_mm`` torch itself loops over the groups in C++, one ``mm`` each)."""
    layer(x)  # warm-up
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = layer(x)[0]
        out.backward(torch.ones_like(out))
    return Counter(e.name for e in prof.events() if e.cpu_parent is None)


@pytest.mark.parametrize("path", list(ExpertPath))
def test_the_op_count_per_layer_does_not_grow_with_the_experts_when_grouped(path):
    counts = {}
    for n_experts in (4, 32):
        torch.manual_seed(0)
        layer = MoE(MoEConfig(d_model=32, n_heads=4, n_experts=n_experts, top_k=2, d_ff=32))
        with torch.no_grad():
            for p in layer.parameters():
                p.normal_(0, 0.1)
        layer.path = path
        counts[n_experts] = top_level_ops(layer, torch.randn(256, 32, requires_grad=True))
    if path == ExpertPath.GROUPED:
        assert counts[4] == counts[32]
        assert counts[32]["aten::_grouped_mm"] == 3 and "aten::matmul" not in counts[32]
    else:  # the reference: ~8 ops an expert forward, more backward (all 32 experts get tokens here)
        assert sum(counts[32].values()) > sum(counts[4].values()) + 28 * 8


@pytest.mark.parametrize("path", list(ExpertPath))
def test_the_grouped_path_reads_no_tensor_value_on_the_host(path):
    """Under ``FakeTensorMode`` tensors have no values, so an op whose output shape depends on data
    (``bincount``) or a read of one (``tolist``, ``item``: a host sync on a GPU) raises. The grouped forward and
    backward trace through (in bf16: the kernel's meta function takes bf16 only); the loop does not."""
    cfg = MoEConfig(d_model=32, n_heads=4, n_experts=8, top_k=2, d_ff=32)
    with FakeTensorMode():
        torch.set_default_dtype(torch.bfloat16)
        try:
            layer = MoE(cfg)
        finally:
            torch.set_default_dtype(torch.float32)
        layer.path = path
        x = torch.randn(64, 32, dtype=torch.bfloat16, requires_grad=True)
        if path == ExpertPath.LOOP:
            with pytest.raises(RuntimeError):  # DynamicOutputShapeException / DataDependentOutputException
                layer(x)
            return
        out = layer(x)[0]
        out.sum().backward()
        assert out.shape == (64, 32) and layer.w_down.grad is not None


def test_inference_and_training_paths_agree():
    grouped, loop = pair()
    x = ids(1, 30, seed=2)
    with torch.no_grad():
        for blk in grouped.blocks:
            h = torch.randn(30, CFG.d_model)
            out, chosen = blk.moe.infer(h)
            ref, ref_chosen = blk.moe(h)[:2]
            torch.testing.assert_close(out, ref)
            assert torch.equal(chosen, ref_chosen)
        torch.testing.assert_close(grouped(x).logits, loop(x).logits, rtol=1e-5, atol=1e-6)


def test_the_logprob_chunk_is_sized_by_the_vocabulary(monkeypatch):
    """At Qwen3's 151,936-token vocabulary a 4096-position chunk was 2.5 GB of fp32 logits: the chunk now
    holds ``LOGPROB_BYTES`` of them whatever the vocabulary, with the same log-probs."""
    assert logprob_chunk(4096) == 4096 and logprob_chunk(151_936) == 110 and logprob_chunk(1 << 30) == 1
    cfg = MoEConfig(vocab_size=151_936, d_model=8, n_layers=1, n_heads=2, n_experts=2, top_k=1, d_ff=8)
    model = MoETransformer(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (2, 150), generator=torch.Generator().manual_seed(0))
    hidden = torch.randn(2, 150, 8, requires_grad=True)
    seen = []
    real = moe_mod._head_logprobs

    def spy(h, nxt, weight, with_entropy):
        seen.append(h.shape[0] * h.shape[1] * weight.shape[0] * 4)
        return real(h, nxt, weight, with_entropy)

    monkeypatch.setattr(moe_mod, "_head_logprobs", spy)
    lp, _ = model.token_logprobs(hidden, tokens)
    assert len(seen) > 1 and max(seen) <= LOGPROB_BYTES
    full = torch.log_softmax(model.lm_head(hidden[:, :-1]).float(), -1).gather(-1, tokens[:, 1:, None])[..., 0]
    torch.testing.assert_close(lp[:, 1:], full)
