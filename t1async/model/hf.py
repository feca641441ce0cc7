"""Hugging Face parameter names for ``MoETransformer`` (design §2 "Models").

Our parameters are fused where that is faster (one ``qkv`` projection, experts stacked into [E, d, f] tensors
for the grouped matmul); a Hugging Face checkpoint names every projection and every expert apart, in the hub
layout that SGLang's loaders and ``transformers.from_pretrained`` both read::

    model.embed_tokens.weight                      embed.weight
    model.layers.N.input_layernorm.weight          blocks.N.attn_norm.weight
    model.layers.N.self_attn.{q,k,v}_proj.weight   rows of blocks.N.attn.qkv.weight (queries, keys, values)
    model.layers.N.self_attn.o_proj.weight         blocks.N.attn.out.weight
    model.layers.N.self_attn.{q,k,v}_proj.bias     rows of blocks.N.attn.qkv.bias            (Qwen2)
    model.layers.N.self_attn.{q,k}_norm.weight     blocks.N.attn.{q,k}_norm.weight           (Qwen3, OLMoE)
    model.layers.N.post_attention_layernorm.weight blocks.N.moe_norm.weight
    model.layers.N.{M}.gate.weight                 blocks.N.moe.router.weight
    model.layers.N.{M}.experts.E.{G,U,D}.weight    blocks.N.moe.w_{gate,up,down}[E], transposed
    model.layers.N.mlp.shared_expert.{G,U,D}.weight blocks.N.moe.shared.w_{gate,up,down}, transposed (Qwen2)
    model.layers.N.mlp.shared_expert_gate.weight   blocks.N.moe.shared_gate.weight           (Qwen2)
    model.layers.N.mlp.{gate,up,down}_proj.weight  blocks.N.moe.w_{gate,up,down}, transposed (dense layers)
    model.norm.weight                              norm.weight
    lm_head.weight                                 lm_head.weight (left out when tied to the embedding)

with {M} = ``mlp`` and {G,U,D} = ``gate_proj, up_proj, down_proj`` for Qwen3-MoE, Qwen2-MoE and OLMoE,
``block_sparse_moe`` and ``w1, w3, w2`` for Mixtral (and for the in-house config, which is a Mixtral). The
value head is ours: it is never among these names (weights.py saves it in its own file).

``hf_slots(cfg)`` maps each Hugging Face name to a ``Slot`` (our name, expert index, row range, transposed);
``slot_view`` is that tensor as a view into ours, so a load or a weight update writes in place.
``canonical_hf_state`` also accepts the names transformers 5 uses in memory (experts fused into
``experts.gate_up_proj`` [E, 2f, d] and ``experts.down_proj`` [E, d, f], Mixtral's ``block_sparse_moe`` as ``mlp``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from torch import Tensor

from t1async.model.config import OLMOE, QWEN2_MOE, QWEN3_MOE, MoEConfig

__all__ = ["Slot", "canonical_hf_state", "hf_slots", "hf_state_shapes", "is_hf_state", "slot_view", "to_hf_state"]


@dataclass(frozen=True)
class Slot:
    name: str  # our state_dict name
    expert: int | None = None  # index along dim 0 (one routed expert of a stacked tensor)
    rows: tuple[int, int] | None = None  # [lo, hi) rows (one projection of the fused qkv)
    transpose: bool = False  # ours is the transpose of theirs (x @ w against F.linear's x @ w.T)


def _moe_names(cfg: MoEConfig) -> tuple[str, tuple[str, str, str]]:
    if cfg.architecture in (QWEN3_MOE, QWEN2_MOE, OLMOE):
        return "mlp", ("gate_proj", "up_proj", "down_proj")
    return "block_sparse_moe", ("w1", "w3", "w2")  # Mixtral, and the in-house model (a Mixtral)


def hf_slots(cfg: MoEConfig) -> dict[str, Slot]:
    """Every Hugging Face (hub layout) parameter name of ``cfg``'s model, and where it lives in ours."""
    h, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    moe, (g, u, dn) = _moe_names(cfg)
    out = {"model.embed_tokens.weight": Slot("embed.weight"), "model.norm.weight": Slot("norm.weight")}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = Slot("lm_head.weight")
    for i in range(cfg.n_layers):
        p, o = f"model.layers.{i}.", f"blocks.{i}."
        out[p + "input_layernorm.weight"] = Slot(o + "attn_norm.weight")
        out[p + "post_attention_layernorm.weight"] = Slot(o + "moe_norm.weight")
        qkv = o + "attn.qkv.weight"
        out[p + "self_attn.q_proj.weight"] = Slot(qkv, rows=(0, h))
        out[p + "self_attn.k_proj.weight"] = Slot(qkv, rows=(h, h + kv))
        out[p + "self_attn.v_proj.weight"] = Slot(qkv, rows=(h + kv, h + 2 * kv))
        out[p + "self_attn.o_proj.weight"] = Slot(o + "attn.out.weight")
        if cfg.qkv_bias:
            for x in "qkv":
                out[f"{p}self_attn.{x}_proj.bias"] = Slot(
                    o + "attn.qkv.bias", rows=out[f"{p}self_attn.{x}_proj.weight"].rows
                )
        if cfg.qk_norm:
            out[p + "self_attn.q_norm.weight"] = Slot(o + "attn.q_norm.weight")
            out[p + "self_attn.k_norm.weight"] = Slot(o + "attn.k_norm.weight")
        if i in cfg.dense_layers:
            for ours, theirs in (("w_gate", "gate_proj"), ("w_up", "up_proj"), ("w_down", "down_proj")):
                out[f"{p}mlp.{theirs}.weight"] = Slot(f"{o}moe.{ours}", transpose=True)
            continue
        out[f"{p}{moe}.gate.weight"] = Slot(o + "moe.router.weight")
        if cfg.shared_d_ff:
            out[f"{p}mlp.shared_expert_gate.weight"] = Slot(o + "moe.shared_gate.weight")
            for ours, theirs in (("w_gate", "gate_proj"), ("w_up", "up_proj"), ("w_down", "down_proj")):
                out[f"{p}mlp.shared_expert.{theirs}.weight"] = Slot(f"{o}moe.shared.{ours}", transpose=True)
        for e in range(cfg.n_experts):
            for ours, theirs in (("w_gate", g), ("w_up", u), ("w_down", dn)):
                out[f"{p}{moe}.experts.{e}.{theirs}.weight"] = Slot(f"{o}moe.{ours}", expert=e, transpose=True)
    return out


def slot_view(t: Tensor, slot: Slot) -> Tensor:
    """The Hugging Face tensor of ``slot`` as a view of our tensor ``t`` (writing into it writes into ours)."""
    if slot.expert is not None:
        t = t[slot.expert]
    if slot.rows is not None:
        t = t[slot.rows[0] : slot.rows[1]]
    return t.T if slot.transpose else t


def hf_state_shapes(cfg: MoEConfig, own: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """The shape of every Hugging Face name, from our state_dict's shapes ``own`` (a model's, or an engine's
    ``state_shapes()``): what a weight update may send under Hugging Face names (``weights.check_state``)."""
    out = {}
    for name, s in hf_slots(cfg).items():
        shape = list(own[s.name])
        if s.expert is not None:
            shape = shape[1:]
        if s.rows is not None:
            shape[0] = s.rows[1] - s.rows[0]
        out[name] = tuple(reversed(shape)) if s.transpose else tuple(shape)
    return out


def to_hf_state(cfg: MoEConfig, state: dict[str, Tensor]) -> dict[str, Tensor]:
    """Our state dict (``model.state_dict()``) as Hugging Face hub tensors (contiguous copies), value head left out."""
    return {name: slot_view(state[s.name], s).contiguous() for name, s in hf_slots(cfg).items()}


def is_hf_state(names) -> bool:
    """Whether tensor names are Hugging Face ones (``model.*``) rather than ours (``lm_head.weight`` is both)."""
    return any(n.startswith("model.") for n in names)


_FUSED = re.compile(r"(model\.layers\.\d+)\.(?:mlp|block_sparse_moe)\.experts\.(gate_up_proj|down_proj)")


def canonical_hf_state(cfg: MoEConfig, state: dict[str, Tensor]) -> dict[str, Tensor]:
    """Hugging Face tensors under their hub names: transformers 5's in-memory names (fused experts
    ``gate_up_proj`` [E, 2f, d] / ``down_proj`` [E, d, f], Mixtral's ``mlp`` for ``block_sparse_moe``) are
    split and renamed (views, no copy); hub names pass through."""
    moe, (g, u, dn) = _moe_names(cfg)
    out: dict[str, Tensor] = {}
    for k, v in state.items():
        m = _FUSED.fullmatch(k)
        if m is None:
            if moe != "mlp" and ".mlp." in k:
                k = k.replace(".mlp.", f".{moe}.")
            out[k] = v
            continue
        p = f"{m.group(1)}.{moe}.experts"
        if m.group(2) == "gate_up_proj":
            f = v.shape[1] // 2
            for e in range(v.shape[0]):
                out[f"{p}.{e}.{g}.weight"], out[f"{p}.{e}.{u}.weight"] = v[e, :f], v[e, f:]
        else:
            for e in range(v.shape[0]):
                out[f"{p}.{e}.{dn}.weight"] = v[e]
    return out
