"""The MoE transformer: full forward vs incremental decoding, routing replay (R3), save/load, the default."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from t1async.model.attention import rotary_angles
from t1async.model.config import QWEN3_MOE, MoEConfig
from t1async.model.kvcache import KVCache
from t1async.model.moe import MoETransformer
from t1async.model.tokenizer import assets_dir
from t1async.model.weights import default_model_dir, load_pretrained, load_weights_into, save_pretrained
from t1async.protocol.errors import ConfigError

CFG = MoEConfig(
    vocab_size=97,
    d_model=32,
    n_layers=3,
    n_heads=4,
    n_experts=6,
    top_k=2,
    d_ff=24,
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


@pytest.fixture(scope="module")
def model() -> MoETransformer:
    return MoETransformer(CFG).eval()


def ids(b: int, t: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, CFG.vocab_size, (b, t), generator=torch.Generator().manual_seed(seed))


def incremental(model: MoETransformer, x: torch.Tensor, chunks: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Feed x [B, T] through the KV cache in the given chunk sizes; logits and routing of every position."""
    b, t = x.shape
    cache = KVCache(model.cfg, torch.float32)
    cache.reserve(b, t)
    logits, topk, pos = [], [], 0
    for n in chunks:
        lg, tk = model.forward_cached(x[:, pos : pos + n], cache, 0, torch.full((b,), pos))
        logits.append(lg)
        topk.append(tk)
        pos += n
    assert pos == t
    return torch.cat(logits, 1), torch.cat(topk, 1)


@torch.no_grad()
def test_incremental_decoding_matches_full_forward(model):
    x = ids(3, 40)
    full = model(x)
    for chunks in ([40], [1] * 40, [17, 1, 1, 5, 16]):
        lg, tk = incremental(model, x, chunks)
        assert (lg - full.logits).abs().max().item() < 1e-4, chunks
        assert torch.equal(tk, full.routing), chunks
    assert full.logits.shape == (3, 40, CFG.vocab_size)
    assert full.values.shape == (3, 40) and full.values.dtype == torch.float32
    assert full.routing.shape == (3, 40, CFG.n_layers, CFG.top_k)
    assert torch.equal(full.routing, full.free_topk)
    assert full.router_logits.shape == (3, 40, CFG.n_layers, CFG.n_experts)


@torch.no_grad()
def test_cached_rows_at_different_lengths_share_one_forward(model):
    """Slots holding sequences of different lengths decode together, each seeing only its own past."""
    a, b = ids(1, 30, seed=1), ids(1, 12, seed=2)
    cache = KVCache(CFG, torch.float32)
    cache.reserve(2, 31)
    model.forward_cached(a[:, :29], cache, 0, torch.tensor([0]))
    model.forward_cached(b[:, :11], cache, 1, torch.tensor([0]))
    lg, _ = model.forward_cached(torch.tensor([[a[0, 29]], [b[0, 11]]]), cache, 0, torch.tensor([29, 11]))
    assert (lg[0, 0] - model(a).logits[0, -1]).abs().max().item() < 1e-4
    assert (lg[1, 0] - model(b).logits[0, -1]).abs().max().item() < 1e-4


@torch.no_grad()
def test_attention_mask_handles_left_padding(model):
    x = ids(1, 20)
    pad = torch.cat([torch.zeros(1, 5, dtype=torch.long), x], 1)
    mask = torch.cat([torch.zeros(1, 5), torch.ones(1, 20)], 1)
    out = model(pad, attention_mask=mask)
    ref = model(x)
    assert (out.logits[:, 5:] - ref.logits).abs().max().item() < 1e-4
    assert torch.equal(out.routing[:, 5:], ref.routing)


@torch.no_grad()
def test_replay_forces_the_recorded_experts_and_minus_one_routes_freely(model):
    x = ids(2, 16)
    free = model(x)
    g = torch.Generator().manual_seed(5)
    forced = torch.stack(
        [torch.randperm(CFG.n_experts, generator=g)[: CFG.top_k] for _ in range(2 * 16 * CFG.n_layers)]
    )
    forced = forced.view(2, 16, CFG.n_layers, CFG.top_k)
    forced[0, 3, 1] = torch.tensor([-1, -1])
    forced[1, 7, 0, 1] = -1  # one missing entry marks the whole (token, layer) row missing
    out = model(x, replay=forced)
    missing = (forced < 0).any(-1, keepdim=True)
    assert torch.equal(out.routing, torch.where(missing, out.free_topk, forced))
    assert int(missing.sum()) == 2
    assert (out.logits - free.logits).abs().max().item() > 1e-3  # forcing other experts changes the output
    # replaying the free choice reproduces the free forward exactly
    again = model(x, replay=free.routing)
    assert torch.equal(again.logits, free.logits)
    assert torch.equal(again.routing, free.routing)


def test_gradient_reaches_the_router_under_replay(model):
    x = ids(2, 10)
    with torch.no_grad():
        forced = model(x).routing.flip(-1)  # same experts, other order: still the recorded set
    m = MoETransformer(CFG)
    out = m(x, replay=forced)
    out.logits.logsumexp(-1).mean().backward()
    for blk in m.blocks:
        assert blk.moe.router.weight.grad is not None
        assert blk.moe.router.weight.grad.abs().sum().item() > 0
    assert m.value_head.weight.grad is None  # values were not in the loss


def test_replay_is_validated(model):
    x = ids(1, 4)
    with pytest.raises(ValueError, match="shape"):
        model(x, replay=torch.zeros(1, 4, CFG.n_layers, CFG.top_k + 1, dtype=torch.long))
    with pytest.raises(ValueError, match="outside"):
        model(x, replay=torch.full((1, 4, CFG.n_layers, CFG.top_k), CFG.n_experts))
    dup = torch.zeros(1, 4, CFG.n_layers, CFG.top_k, dtype=torch.long)
    with pytest.raises(ValueError, match="repeats"):
        model(x, replay=dup)


def test_save_load_roundtrip(tmp_path, model):
    d = save_pretrained(model, tmp_path / "m")
    names = {p.name for p in d.iterdir()}
    assert {"model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"} <= names
    assert json.loads((d / "config.json").read_text())["n_experts"] == CFG.n_experts
    loaded = load_pretrained(d)
    x = ids(2, 12)
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, model(x).logits)
    bf = load_pretrained(d, dtype=torch.bfloat16)
    assert next(bf.parameters()).dtype == torch.bfloat16


def test_load_rejects_a_mismatched_model(tmp_path, model):
    other = MoETransformer(MoEConfig(**{**CFG.__dict__, "n_experts": 4}))
    d = save_pretrained(other, tmp_path / "other")
    with pytest.raises(ConfigError, match="does not match"):
        load_weights_into(model, d)
    with pytest.raises(ConfigError, match="no model config"):
        load_pretrained(tmp_path / "missing")
    (tmp_path / "other" / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(ConfigError, match="cannot read weights"):
        load_pretrained(tmp_path / "other")


def test_config_json_roundtrip_and_validation():
    assert MoEConfig.from_json(CFG.to_json()) == CFG
    with pytest.raises(ConfigError, match="top_k"):
        MoEConfig(n_experts=2, top_k=3)
    with pytest.raises(ConfigError, match="n_heads"):
        MoEConfig(d_model=30, n_heads=4)
    with pytest.raises(ConfigError, match="model_type"):
        MoEConfig.from_dict({"model_type": "llama"})


def test_default_model_is_deterministic(tmp_path, monkeypatch):
    monkeypatch.setenv("T1ASYNC_CACHE", str(tmp_path / "a"))
    da = default_model_dir()
    monkeypatch.setenv("T1ASYNC_CACHE", str(tmp_path / "b"))
    db = default_model_dir()
    assert da != db and default_model_dir() == db  # second call reuses the cache
    wa, wb = load_file(str(da / "model.safetensors")), load_file(str(db / "model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    m = load_pretrained(da)
    assert m.cfg == MoEConfig.load(assets_dir() / "config.json") and m.cfg.architecture == QWEN3_MOE
    assert m.cfg.qk_norm and m.cfg.n_kv_heads < m.cfg.n_heads  # Qwen3's q/k norm and grouped-query attention


def test_the_shipped_default_is_a_qwen3_moe_that_transformers_runs_with_our_logits(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("T1ASYNC_CACHE", str(tmp_path))
    d = default_model_dir()
    ours = load_pretrained(d)
    ref = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    assert type(ref).__name__ == "Qwen3MoeForCausalLM"
    x = torch.randint(0, ours.cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs, mine = ref(input_ids=x).logits, ours(x).logits
    assert (theirs - mine).abs().max().item() <= 1e-4


def test_chunked_token_logprobs_match_the_full_logits_values_and_gradients():
    """The training path (``logits=False`` + ``token_logprobs`` in checkpointed chunks) gives the log-probs,
    entropies and parameter gradients of log-softmax over the full [B, T, V] logits."""
    from t1async.learner.ppo import token_logprobs

    x = ids(2, 37, seed=4)
    replay = MoETransformer(CFG)(x).routing.detach()
    full_m, chunk_m = MoETransformer(CFG), MoETransformer(CFG)
    full = full_m(x, replay=replay)
    lp_ref, ent_ref = token_logprobs(full.logits, x, with_entropy=True)
    out = chunk_m(x, replay=replay, logits=False)
    assert out.logits is None and out.hidden.shape == (2, 37, CFG.d_model)
    for chunk in (10, 7, 4096):  # several chunks (10 // 2 rows = 5 positions), a ragged last one, a single one
        lp, ent = chunk_m.token_logprobs(out.hidden, x, with_entropy=True, chunk=chunk)
        torch.testing.assert_close(lp, lp_ref, rtol=0, atol=1e-5)
        torch.testing.assert_close(ent, ent_ref, rtol=0, atol=1e-5)
    assert lp[:, 0].abs().max().item() == 0.0  # position 0 has no logits before it
    w = torch.linspace(-1, 1, 37)
    ((lp_ref * w).sum() + 0.1 * ent_ref.sum() + full.values.sum()).backward()
    lp, ent = chunk_m.token_logprobs(out.hidden, x, with_entropy=True, chunk=10)
    ((lp * w).sum() + 0.1 * ent.sum() + out.values.sum()).backward()
    for (name, a), b in zip(full_m.named_parameters(), chunk_m.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_training_attention_equals_explicit_softmax_attention():
    """The fused causal SDPA of the training forward (no [T, T] score tensor) against the textbook
    softmax(q k^T / sqrt(d) + causal mask) v, and the masked path against it on left padding."""
    blk = MoETransformer(CFG).blocks[0]
    x = torch.randn(2, 23, CFG.d_model, generator=torch.Generator().manual_seed(1))
    pos = torch.arange(23)[None].expand(2, 23)
    rope = rotary_angles(pos, CFG.head_dim, CFG.rope_theta)
    q, k, v = blk.attn._qkv(x, rope)
    scores = q @ k.transpose(-1, -2) / CFG.head_dim**0.5
    scores = scores.masked_fill(~torch.ones(23, 23, dtype=torch.bool).tril(), float("-inf"))
    ref = blk.attn.out((torch.softmax(scores, -1) @ v).transpose(1, 2).reshape(x.shape))
    torch.testing.assert_close(blk.attn(x, rope, None), ref, rtol=1e-5, atol=1e-6)
    mask = torch.ones(2, 1, 23, 23, dtype=torch.bool).tril()
    torch.testing.assert_close(blk.attn(x, rope, mask), ref, rtol=1e-5, atol=1e-6)


def test_checkpointed_blocks_give_the_same_outputs_and_gradients_under_replay():
    """``checkpoint_blocks`` recomputes each block in the backward pass: outputs, the experts used (R3 replay
    with some rows missing, which route freely) and every parameter gradient match the plain forward."""
    x = ids(2, 29, seed=6)
    g = torch.Generator().manual_seed(9)
    rows = [torch.randperm(CFG.n_experts, generator=g)[: CFG.top_k] for _ in range(2 * 29 * CFG.n_layers)]
    replay = torch.stack(rows).view(2, 29, CFG.n_layers, CFG.top_k)
    replay[1, 4:9, 1] = -1
    runs = []
    for ck in (False, True):
        m = MoETransformer(CFG)
        out = m(x, replay=replay, logits=False, checkpoint_blocks=ck)
        lp, _ = m.token_logprobs(out.hidden, x)
        (lp.sum() + out.values.square().sum() + out.router_logits.mean()).backward()
        runs.append((out, lp, {n: p.grad for n, p in m.named_parameters()}))
    (a, lpa, ga), (b, lpb, gb) = runs
    assert torch.equal(a.routing, b.routing) and torch.equal(a.free_topk, b.free_topk)
    torch.testing.assert_close(lpb, lpa, rtol=0, atol=1e-6)
    torch.testing.assert_close(b.values, a.values, rtol=0, atol=1e-6)
    for n in ga:
        torch.testing.assert_close(gb[n], ga[n], rtol=1e-5, atol=1e-7, msg=n)


# every option of the generalised block at once (the Hugging Face architectures are configs of it, design §2)
FULL = MoEConfig(
    vocab_size=97,
    d_model=32,
    n_layers=3,
    n_heads=4,
    n_kv_heads=2,
    head_dim=6,
    qk_norm=True,
    qkv_bias=True,
    shared_d_ff=20,
    dense_layers=(1,),
    dense_d_ff=28,
    norm_topk_prob=False,
    tie_embeddings=True,
    n_experts=6,
    top_k=2,
    d_ff=24,
    max_seq_len=256,
    init_std=0.1,
    seed=4,
)


def test_every_option_trains_replays_and_decodes_like_the_full_forward():
    """GQA, head_dim, q/k norm, qkv bias, a shared expert, a dense layer, unnormalised gates and tied
    embeddings: incremental decoding matches the full forward, checkpointed blocks give the same gradients,
    every parameter (the shared expert's gate, the dense MLP, the tied embedding) gets one, and the init is
    deterministic."""
    x = torch.randint(0, FULL.vocab_size, (2, 23), generator=torch.Generator().manual_seed(2))
    a, b = MoETransformer(FULL), MoETransformer(FULL)
    assert all(torch.equal(p, q) for p, q in zip(a.state_dict().values(), b.state_dict().values(), strict=True))
    assert a.lm_head.weight is a.embed.weight
    with torch.no_grad():
        full = a(x)
        cache = KVCache(FULL, torch.float32)
        cache.reserve(2, 23)
        lg1, tk1 = a.forward_cached(x[:, :9], cache, 0, torch.zeros(2, dtype=torch.long))
        lg2, tk2 = a.forward_cached(x[:, 9:10], cache, 0, torch.full((2,), 9))
        lg3, _ = a.forward_cached(x[:, 10:], cache, 0, torch.full((2,), 10))
    assert (torch.cat([lg1, lg2, lg3], 1) - full.logits).abs().max().item() < 1e-4
    assert torch.equal(torch.cat([tk1, tk2], 1), full.routing[:, :10])
    assert not full.routing[:, :, 1].any()  # the dense layer records zero rows
    replay = full.routing.clone()
    replay[:, :, 1] = 255  # a dense layer's columns are not looked at
    grads = []
    for m, ck in ((a, False), (b, True)):
        out = m(x, replay=replay, logits=False, checkpoint_blocks=ck)
        lp, _ = m.token_logprobs(out.hidden, x)
        (lp.sum() + out.values.square().sum()).backward()
        grads.append({n: p.grad for n, p in m.named_parameters()})
    assert {n for n, g in grads[0].items() if g is None or not g.abs().sum()} == set()
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], rtol=1e-5, atol=1e-7, msg=n)


def test_every_option_round_trips_through_our_format(tmp_path):
    assert MoEConfig.from_json(FULL.to_json()) == FULL
    m = MoETransformer(FULL).eval()
    back = load_pretrained(save_pretrained(m, tmp_path / "m"))
    x = ids(2, 9)
    with torch.no_grad():
        assert torch.equal(back(x).logits, m(x).logits) and torch.equal(back(x).values, m(x).values)
    assert back.lm_head.weight is back.embed.weight
