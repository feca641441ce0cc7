"""Hugging Face MoE architectures run natively: conformance against transformers (the reference).

Each family is built by transformers from a tiny config with random weights (no download), saved with its
``save_pretrained``, loaded by ours; logits on a padded batch, the routing and routing replay are compared,
and the checkpoints go both ways (our save, single file and sharded, loads in transformers)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from transformers import AutoModelForCausalLM, MixtralConfig, OlmoeConfig, Qwen2MoeConfig, Qwen3MoeConfig

from t1async.model.config import MIXTRAL, OLMOE, QWEN2_MOE, QWEN3_MOE, MoEConfig
from t1async.model.hf import hf_slots, hf_state_shapes, to_hf_state
from t1async.model.kvcache import KVCache
from t1async.model.moe import MoETransformer
from t1async.model.weights import (
    INDEX_FILE,
    VALUE_HEAD_FILE,
    WEIGHTS_FILE,
    check_state,
    load_pretrained,
    load_state_into,
    load_weights_into,
    save_pretrained,
)
from t1async.protocol.errors import ConfigError

TOL = 1e-4  # fp32, max |logit difference| against transformers
VOCAB = 101


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """Tiny matrices: a second OpenMP thread costs more than it saves on 2 shared cores (restored after)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def qwen3(**kw) -> Qwen3MoeConfig:
    base = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=40,
        moe_intermediate_size=16,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=12,  # not hidden_size / heads: the explicit head width is honoured
        num_experts=6,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        rope_theta=5000.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=128,
        initializer_range=0.1,
    )
    return Qwen3MoeConfig(**{**base, **kw})


def mixtral(**kw) -> MixtralConfig:
    base = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=5,
        num_experts_per_tok=2,
        rope_theta=1e6,
        max_position_embeddings=128,
        initializer_range=0.1,
    )
    return MixtralConfig(**{**base, **kw})


def qwen2(**kw) -> Qwen2MoeConfig:
    base = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=40,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=28,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        num_experts=5,
        num_experts_per_tok=2,
        rope_theta=20000.0,
        max_position_embeddings=128,
        initializer_range=0.1,
    )
    return Qwen2MoeConfig(**{**base, **kw})


def olmoe(**kw) -> OlmoeConfig:
    base = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=6,
        num_experts_per_tok=3,
        clip_qkv=1.5,  # clamps some of the normalised projections
        eos_token_id=2,  # (its default is outside this vocabulary)
        rope_theta=10000.0,
        max_position_embeddings=128,
        initializer_range=0.1,
    )
    return OlmoeConfig(**{**base, **kw})


FAMILIES = {
    "qwen3-moe": lambda: qwen3(),
    "qwen3-moe-unnormalised-gates": lambda: qwen3(norm_topk_prob=False),
    "qwen3-moe-dense-layers-tied": lambda: qwen3(mlp_only_layers=[0], decoder_sparse_step=2, tie_word_embeddings=True),
    "mixtral": lambda: mixtral(),
    "qwen2-moe": lambda: qwen2(),
    "olmoe": lambda: olmoe(),
}


def reference(hf_cfg, seed: int = 0):
    """A transformers model with random weights, every norm weight too (so a swapped norm shows)."""
    torch.manual_seed(seed)
    ref = AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if "norm" in name or name.endswith("bias"):  # (transformers starts them at 1 and 0)
                p.add_(torch.randn_like(p) * 0.2)
    return ref


def batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids [3, 11], mask (row 1 left-padded by 3, row 2 right-padded by 4), the positions of the real tokens."""
    x = torch.randint(0, VOCAB, (3, 11), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(x)
    mask[1, :3] = 0
    mask[2, 7:] = 0
    return x, mask, (mask.cumsum(-1) - 1).clamp(min=0)


class Router:
    """Records the experts each transformers MoE layer chose (its router's top-k indices), layer by layer."""

    def __init__(self, ref) -> None:
        self.chosen: list[torch.Tensor] = []
        self.handles = [
            m.register_forward_hook(lambda _m, _i, out: self.chosen.append(out[2]))
            for m in ref.modules()
            if type(m).__name__.endswith("TopKRouter")
        ]

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def ref_forward(ref, x, mask, pos) -> tuple[torch.Tensor, list[torch.Tensor]]:
    rec = Router(ref)
    try:
        with torch.no_grad():
            logits = ref(input_ids=x, attention_mask=mask, position_ids=pos).logits
    finally:
        rec.close()
    b, t = x.shape
    return logits, [c.view(b, t, -1) for c in rec.chosen]


def max_diff(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    return (a - b)[mask.bool()].abs().max().item()


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    """(name, transformers model, its save directory, our model loaded from that directory)."""
    ref = reference(FAMILIES[request.param]())
    d = tmp_path_factory.mktemp(request.param)
    ref.save_pretrained(d)
    return request.param, ref, d, load_pretrained(d)


def test_logits_and_routing_match_transformers_on_a_padded_batch(family):
    name, ref, _, ours = family
    x, mask, pos = batch()
    want, their_routing = ref_forward(ref, x, mask, pos)
    with torch.no_grad():
        out = ours(x, attention_mask=mask)
    assert max_diff(out.logits, want, mask) <= TOL, name
    moe = ours.cfg.moe_layers
    assert len(their_routing) == len(moe)
    real = mask.bool()
    for layer, theirs in zip(moe, their_routing, strict=True):
        mine = out.free_topk[:, :, layer]
        assert torch.equal(mine.sort(-1).values[real], theirs.sort(-1).values[real]), (name, layer)
    for layer in ours.cfg.dense_layers:  # zeros, as SGLang's capture leaves a dense layer's rows
        assert bool((out.routing[:, :, layer] == 0).all())
    assert (ours.lm_head.weight is ours.embed.weight) == ours.cfg.tie_embeddings


def test_a_checkpoint_without_a_value_head_gets_a_seeded_one_and_bf16_loads(family):
    name, _, d, ours = family
    again = load_pretrained(d)
    assert torch.equal(again.value_head.weight, ours.value_head.weight) and bool(ours.value_head.weight.abs().sum())
    bf = load_pretrained(d, dtype=torch.bfloat16)
    assert {p.dtype for p in bf.parameters()} == {torch.bfloat16}
    assert torch.equal(bf.embed.weight, ours.embed.weight.bfloat16())


def test_replaying_their_routing_reproduces_our_logits(family):
    name, ref, _, ours = family
    x, mask, pos = batch()
    want, their_routing = ref_forward(ref, x, mask, pos)
    c = ours.cfg
    replay = torch.full((*x.shape, c.n_layers, c.top_k), -1, dtype=torch.long)
    for layer, theirs in zip(c.moe_layers, their_routing, strict=True):
        replay[:, :, layer] = theirs
    with torch.no_grad():
        free = ours(x, attention_mask=mask)
        replayed = ours(x, attention_mask=mask, replay=replay)
        other = ours(x, attention_mask=mask, replay=(replay + 1) % c.n_experts)  # other experts: other logits
    assert max_diff(replayed.logits, free.logits, mask) <= 1e-6, name
    assert max_diff(replayed.logits, want, mask) <= TOL, name
    assert max_diff(other.logits, free.logits, mask) > 1e-3, name


def test_incremental_decoding_matches_the_full_forward(family):
    name, _, _, ours = family
    x, _, _ = batch()
    b, t = x.shape
    with torch.no_grad():
        full = ours(x)
        cache = KVCache(ours.cfg, torch.float32)
        cache.reserve(b, t)
        assert cache.k.shape[2] == ours.cfg.n_kv_heads and cache.k.shape[-1] == ours.cfg.head_dim
        parts, pos = [], 0
        for n in (5, 1, 1, 4):
            lg, tk = ours.forward_cached(x[:, pos : pos + n], cache, 0, torch.full((b,), pos))
            assert torch.equal(tk, full.routing[:, pos : pos + n]), name
            parts.append(lg)
            pos += n
    assert (torch.cat(parts, 1) - full.logits).abs().max().item() <= TOL, name


def test_our_save_loads_in_transformers_single_file_and_sharded(family, tmp_path):
    name, ref, _, ours = family
    x, mask, pos = batch()
    with torch.no_grad():
        mine = ours(x, attention_mask=mask)
    for shard in (None, 20_000):
        d = save_pretrained(ours, tmp_path / f"shard-{shard}", max_shard_bytes=shard)
        files = {p.name for p in d.iterdir()}
        assert VALUE_HEAD_FILE in files
        if shard is None:  # one file, and an index naming it: vLLM loads every *.safetensors of a dir without
            assert WEIGHTS_FILE in files  # one, value_head.safetensors included (t1async/model/weights.py)
            index = json.loads((d / INDEX_FILE).read_text())
            assert set(index["weight_map"].values()) == {WEIGHTS_FILE}
        else:
            index = json.loads((d / INDEX_FILE).read_text())
            assert len(set(index["weight_map"].values())) > 1
            assert WEIGHTS_FILE not in files
        hf = json.loads((d / "config.json").read_text())
        assert hf["architectures"] == [ours.cfg.architecture]
        back = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
        got, _ = ref_forward(back, x, mask, pos)
        assert max_diff(got, mine.logits, mask) <= TOL, (name, shard)
        ours2 = load_pretrained(d)  # and back into ours, the value head included
        with torch.no_grad():
            again = ours2(x, attention_mask=mask)
        assert torch.equal(again.logits, mine.logits) and torch.equal(again.values, mine.values)


def test_a_sharded_transformers_checkpoint_loads(family, tmp_path):
    name, ref, _, ours = family
    ref.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / INDEX_FILE).is_file() and not (tmp_path / WEIGHTS_FILE).exists()
    x, mask, _ = batch()
    with torch.no_grad():
        assert torch.equal(
            load_pretrained(tmp_path)(x, attention_mask=mask).logits, ours(x, attention_mask=mask).logits
        )


def test_saved_names_are_the_hub_layout(family, tmp_path):
    """What transformers itself writes (per-expert tensors, SGLang's loader names) is what we write."""
    name, _, their_dir, ours = family
    from safetensors import safe_open

    def names(d):
        with safe_open(str(d / WEIGHTS_FILE), "pt") as f:
            return set(f.keys())

    mine = names(save_pretrained(ours, tmp_path / "ours"))
    assert mine == names(their_dir), name
    assert not any("value_head" in n for n in mine)
    assert ("lm_head.weight" in mine) == (not ours.cfg.tie_embeddings)


def test_config_maps_the_qwen3_layout():
    cfg = MoEConfig.from_hf_dict(qwen3(mlp_only_layers=[0], decoder_sparse_step=2, tie_word_embeddings=True).to_dict())
    assert cfg.architecture == QWEN3_MOE
    # layer 0 listed, layer 2 off the sparse step (i + 1) % 2 != 0: dense; layer 1 routed
    assert cfg.dense_layers == (0, 2) and cfg.moe_layers == (1,)
    assert (cfg.n_kv_heads, cfg.head_dim, cfg.d_ff, cfg.dense_d_ff) == (2, 12, 16, 40)
    assert cfg.qk_norm and cfg.norm_topk_prob and cfg.tie_embeddings and cfg.rope_theta == 5000.0
    assert MoEConfig.from_dict(cfg.to_hf_dict()) == cfg
    q2 = MoEConfig.from_hf_dict(qwen2().to_dict())
    assert q2.architecture == QWEN2_MOE and q2.qkv_bias and q2.shared_d_ff == 28 and not q2.qk_norm
    assert not q2.norm_topk_prob and q2.head_dim == 8 and q2.dense_layers == ()
    assert MoEConfig.from_dict(q2.to_hf_dict()) == q2
    ol = MoEConfig.from_hf_dict(olmoe().to_dict())
    assert ol.architecture == OLMOE and ol.qk_norm and ol.qk_norm_full and ol.clip_qkv == 1.5 and ol.d_ff == 16
    assert MoEConfig.from_dict(ol.to_hf_dict()) == ol


def test_other_config_keys_survive_and_the_dtype_is_the_saved_one(tmp_path):
    """Token ids and options we do not model pass through our load and save unchanged; ``torch_dtype`` names
    the tensors we wrote (what SGLang's dtype "auto" reads)."""
    reference(qwen3(bos_token_id=7, eos_token_id=8, router_aux_loss_coef=0.25)).save_pretrained(tmp_path / "t")
    ours = load_pretrained(tmp_path / "t", dtype=torch.bfloat16)
    written = json.loads((save_pretrained(ours, tmp_path / "o") / "config.json").read_text())
    assert (written["bos_token_id"], written["eos_token_id"], written["router_aux_loss_coef"]) == (7, 8, 0.25)
    assert written["torch_dtype"] == "bfloat16"
    assert MoEConfig.load(tmp_path / "o") == ours.cfg
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "o")
    assert back.config.eos_token_id == 8 and next(back.parameters()).dtype == torch.bfloat16


def test_an_unsupported_architecture_is_a_one_line_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    with pytest.raises(ConfigError) as e:
        MoEConfig.load(tmp_path)
    msg = str(e.value)
    assert "\n" not in msg and "LlamaForCausalLM" in msg
    assert QWEN3_MOE in msg and MIXTRAL in msg and QWEN2_MOE in msg and OLMOE in msg
    with pytest.raises(ConfigError, match="rope scaling"):
        MoEConfig.from_hf_dict({**mixtral().to_dict(), "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})


def test_the_in_house_model_is_a_mixtral(tmp_path):
    """The in-house config saved as MixtralForCausalLM runs in transformers with the same logits."""
    cfg = MoEConfig(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, n_experts=6, top_k=2, d_ff=24, seed=3)
    ours = MoETransformer(cfg).eval()
    as_mixtral = MoETransformer(dataclasses.replace(cfg, architecture=MIXTRAL)).eval()
    assert all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(), as_mixtral.state_dict().values()))
    ref = AutoModelForCausalLM.from_pretrained(save_pretrained(as_mixtral, tmp_path / "m"), dtype=torch.float32)
    assert type(ref).__name__ == MIXTRAL
    x, mask, pos = batch()
    want, _ = ref_forward(ref.eval(), x, mask, pos)
    with torch.no_grad():
        assert max_diff(ours(x, attention_mask=mask).logits, want, mask) <= TOL


def test_weight_updates_take_hugging_face_names():
    """A distributed update may name tensors as SGLang does: one expert or one projection is written into its
    slice of our fused tensors; transformers 5's in-memory names (fused experts) work too."""
    ref = reference(qwen3(), seed=1)
    cfg = MoEConfig.from_hf_dict(ref.config.to_dict())
    ours = MoETransformer(cfg).eval()
    shapes = {k: tuple(v.shape) for k, v in ours.state_dict().items()}
    hf_shapes = hf_state_shapes(cfg, shapes)
    assert set(hf_shapes) == set(hf_slots(cfg))
    hub = to_hf_state(cfg, MoETransformer(dataclasses.replace(cfg, seed=9)).state_dict())
    one = {k: v for k, v in hub.items() if ".experts.3." in k and "layers.1." in k}
    one["model.layers.0.self_attn.k_proj.weight"] = hub["model.layers.0.self_attn.k_proj.weight"]
    check_state({**shapes, **hf_shapes}, one)
    with pytest.raises(ConfigError, match="names not in the model"):
        check_state(shapes, one)
    before = {k: v.clone() for k, v in ours.state_dict().items()}
    load_state_into(ours, one)
    after = ours.state_dict()
    changed = {k for k in after if not torch.equal(after[k], before[k])}
    assert changed == {"blocks.1.moe.w_gate", "blocks.1.moe.w_up", "blocks.1.moe.w_down", "blocks.0.attn.qkv.weight"}
    assert torch.equal(after["blocks.1.moe.w_down"][3], one["model.layers.1.mlp.experts.3.down_proj.weight"].T)
    assert torch.equal(after["blocks.1.moe.w_down"][2], before["blocks.1.moe.w_down"][2])
    q = cfg.n_heads * cfg.head_dim
    assert torch.equal(after["blocks.0.attn.qkv.weight"][:q], before["blocks.0.attn.qkv.weight"][:q])
    with pytest.raises(ConfigError, match="has shape"):
        load_state_into(ours, {"model.layers.0.self_attn.q_proj.weight": torch.zeros(3, 3)})

    load_state_into(ours, ref.state_dict())  # transformers' own names, experts fused: the whole model
    x, mask, pos = batch()
    want, _ = ref_forward(ref, x, mask, pos)
    with torch.no_grad():
        assert max_diff(ours(x, attention_mask=mask).logits, want, mask) <= TOL


def test_load_weights_into_checks_the_architecture(family, tmp_path):
    name, _, d, ours = family
    other = MoETransformer(dataclasses.replace(ours.cfg, n_experts=ours.cfg.n_experts + 1))
    with pytest.raises(ConfigError, match="does not match"):
        load_weights_into(other, d)


async def test_the_engine_serves_a_transformers_checkpoint_with_its_logprobs(tmp_path):
    """The embedded sampler on a directory transformers wrote, then updated from another: greedy tokens whose
    logprobs are transformers' log-softmax on the same tokens, and the routing it records is transformers'
    top-k (zero rows for the dense layer)."""
    import numpy as np
    import trio

    from t1async.model.engine import Engine
    from t1async.model.records import EngineConfig, GenRequest

    refs = [reference(qwen3(vocab_size=4096, mlp_only_layers=[1]), seed=s) for s in (2, 3)]  # our tokenizer's vocab
    for i, r in enumerate(refs):
        r.save_pretrained(tmp_path / f"v{i}")
    prompts = [[5, 17, 300, 9, 44], [1000, 2, 3]]
    eng = Engine(tmp_path / "v0", EngineConfig(max_batch=4))
    checks = []
    async with trio.open_nursery() as n:
        await n.start(eng.run)
        for version, ref in enumerate(refs):
            if version:  # the learner's push from disk: another transformers-written directory
                await eng.update_weights_from_disk(str(tmp_path / f"v{version}"), str(version))
            for i, p in enumerate(prompts):
                rq = GenRequest(
                    rid=f"r{version}-{i}",
                    input_ids=tuple(p),
                    max_new_tokens=6,
                    temperature=0.0,
                    ignore_eos=True,
                    return_routing=True,
                )
                checks.append((ref, p, await eng.collect(rq)))
        n.cancel_scope.cancel()
    assert checks[0][2].logprobs != checks[2][2].logprobs  # the update took
    for ref, p, res in checks:
        seq = torch.tensor([p + res.output_ids])
        logits, routing = ref_forward(ref, seq, torch.ones_like(seq), torch.arange(seq.shape[1])[None])
        lp = torch.log_softmax(logits[0], -1)
        want = [lp[len(p) - 1 + i, t].item() for i, t in enumerate(res.output_ids)]
        assert len(res.output_ids) == 6
        assert np.max(np.abs(np.array(want) - np.array(res.logprobs))) <= TOL
        theirs = torch.stack(routing, dim=2)[0, : seq.shape[1] - 1].sort(-1).values.numpy()
        assert np.array_equal(np.sort(res.routing[:, [0, 2]], -1), theirs)
        assert not res.routing[:, 1].any()  # the dense layer: zero rows


def conformance_figures(tmp: str) -> dict[str, dict[str, float]]:
    """Per family: max |Δlogit| vs transformers on the padded batch (their save -> our load), the share of
    (token, layer) top-k sets that agree, max |Δlogit| replaying their routing, and through our save loaded
    back by transformers."""
    from pathlib import Path

    x, mask, pos = batch()
    out = {}
    for name in sorted(FAMILIES):
        ref = reference(FAMILIES[name]())
        d = Path(tmp) / name
        ref.save_pretrained(d)
        ours = load_pretrained(d)
        want, theirs = ref_forward(ref, x, mask, pos)
        c = ours.cfg
        replay = torch.full((*x.shape, c.n_layers, c.top_k), -1, dtype=torch.long)
        agree = []
        with torch.no_grad():
            mine = ours(x, attention_mask=mask)
            for layer, t in zip(c.moe_layers, theirs, strict=True):
                replay[:, :, layer] = t
                same = (mine.free_topk[:, :, layer].sort(-1).values == t.sort(-1).values).all(-1)
                agree.append(same[mask.bool()].float().mean().item())
            replayed = ours(x, attention_mask=mask, replay=replay)
        back = AutoModelForCausalLM.from_pretrained(save_pretrained(ours, d / "ours"), dtype=torch.float32).eval()
        out[name] = {
            "max_abs_dlogit": max_diff(mine.logits, want, mask),
            "routing_agreement": min(agree),
            "max_abs_dlogit_replayed": max_diff(replayed.logits, want, mask),
            "max_abs_dlogit_our_save_in_transformers": max_diff(ref_forward(back, x, mask, pos)[0], mine.logits, mask),
        }
    return out


if __name__ == "__main__":  # the figures in docs/results.md: python tests/test_hf_models.py
    import tempfile

    import transformers

    with tempfile.TemporaryDirectory() as tmp:
        figs = conformance_figures(tmp)
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, fp32 CPU")
    for name, f in figs.items():
        print(f"{name:32s} " + "  ".join(f"{k} {v:.2e}" for k, v in f.items()))


class _Named:
    """What the learner's push reads (``state_dict()``), holding tensors under Hugging Face names."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        self._state = state

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self._state


async def test_the_sampler_takes_a_push_by_hugging_face_names_and_rejects_a_bad_one(tmp_path):
    """/update_weights_from_distributed with hub names (one projection or expert per tensor, as SGLang takes
    them) lands the same weights as the disk path; a hub name with the wrong shape is a clear 400 and leaves
    the weights whole (seen failing on the old code twice: every hub name was 'not in the model', and once
    that was fixed, the buckets staged before the bad one were applied at continue: half a version)."""
    import numpy as np

    from t1async.learner.weightpush import DistributedPusher, WeightPushConfig
    from t1async.protocol.errors import SamplerError
    from t1async.protocol.sampling import SamplingParams
    from t1async.sampler.client import SGLangClient
    from t1async.sampler.launch import SamplerProcess

    reference(qwen3(vocab_size=4096, mlp_only_layers=[1]), seed=2).save_pretrained(tmp_path / "v0")
    new = load_pretrained(tmp_path / "v0")
    with torch.no_grad():
        for p in new.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(7)) * 0.05)
    hub = to_hf_state(new.cfg, new.state_dict())
    assert all(k.startswith(("model.", "lm_head.")) for k in hub)
    proc = SamplerProcess(tmp_path / "v0", max_batch=4)
    url = proc.start()
    try:
        async with SGLangClient([url]) as client:

            async def logprobs() -> list[float]:
                gen = await client.generate([5, 17, 300, 9], SamplingParams(max_new_tokens=5, temperature=0.0))
                return list(gen.logprobs)

            before = await logprobs()
            pusher = DistributedPusher(client, WeightPushConfig(bucket_mb=0.05))
            try:
                bad = dict(hub)
                name = next(k for k in bad if k.endswith("q_proj.weight"))
                bad[name] = bad[name][:-1]
                with pytest.raises(SamplerError, match=f"{name} has shape"):
                    await pusher.push(_Named(bad), policy_version=1)
                # rejected whole: the model is unchanged (its earlier buckets were staged, then dropped)
                np.testing.assert_allclose(await logprobs(), before, rtol=0, atol=1e-5)
                await pusher.push(_Named(hub), policy_version=2)
                pushed = await logprobs()
            finally:
                await pusher.aclose()
            await client.update_weights_from_disk(str(save_pretrained(new, tmp_path / "v3")), 3)
            from_disk = await logprobs()
    finally:
        proc.stop()
    assert np.max(np.abs(np.array(pushed) - np.array(before))) > 1e-3
    np.testing.assert_allclose(pushed, from_disk, rtol=0, atol=1e-6)
