"""Tiny model directories for tests: the shipped tokenizer's vocabulary, a CPU-instant MoE, saved as the
learner and samplers load it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from t1async.model.config import QWEN3_MOE, MoEConfig
from t1async.model.moe import MoETransformer
from t1async.model.tokenizer import ChatTokenizer
from t1async.model.weights import save_pretrained

# the shipped default's architecture (Qwen3-MoE: q/k norm, grouped-query attention), at test size
TINY: dict[str, Any] = {
    "architecture": QWEN3_MOE,
    "qk_norm": True,
    "d_model": 32,
    "n_layers": 2,
    "n_heads": 2,
    "n_kv_heads": 1,
    "n_experts": 4,
    "top_k": 2,
    "d_ff": 32,
}


def tiny_model_dir(path: Path, **overrides: Any) -> Path:
    """Save a seeded tiny MoE (``TINY``, then ``overrides``) with the shipped tokenizer into ``path``."""
    tok = ChatTokenizer.load()
    cfg = MoEConfig(**{"vocab_size": tok.vocab_size, "max_seq_len": 8192, "seed": 0, **TINY, **overrides})
    save_pretrained(MoETransformer(cfg), path, tok)
    return path


def transformers_moe_dir(d: Path, family: str = "qwen3", tokenizer: Path | None = None) -> Path:
    """A tiny MoE dir as ``transformers`` writes it (random weights, seeded; no download), with the tokenizer
    files of ``tokenizer`` (a model dir; default: the shipped ones) beside it and a vocabulary of that
    tokenizer's size. A model none of our code wrote, for tests that take ``--model DIR``. ``family``:

    - ``qwen3``: ``Qwen3MoeForCausalLM``, 3 layers of which layer 1 is dense, 4 experts, top-2, GQA 4/2;
    - ``olmoe``: ``OlmoeForCausalLM``, 2 layers, 4 experts, top-2 gates from the softmax over all experts (not
      renormalised), one q and one k norm over the whole projection, ``clip_qkv``."""
    import shutil

    import torch
    import transformers

    from t1async.model.weights import default_model_dir

    src = tokenizer or default_model_dir()
    common: dict[str, Any] = dict(
        vocab_size=ChatTokenizer.load(src).vocab_size,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
    )
    cfg: Any  # (keyword dicts: transformers' signatures do not list every config key)
    if family == "qwen3":
        qwen3: dict[str, Any] = dict(
            intermediate_size=96,
            moe_intermediate_size=32,
            num_hidden_layers=3,
            head_dim=16,
            norm_topk_prob=True,
            mlp_only_layers=[1],  # one dense layer: its routing rows are zeros on both sides
        )
        cfg = transformers.Qwen3MoeConfig(**common, **qwen3)
    elif family == "olmoe":
        cfg = transformers.OlmoeConfig(**common, intermediate_size=32, num_hidden_layers=2, clip_qkv=4.0)
    else:
        raise ValueError(f"unknown family {family!r}: qwen3 or olmoe")
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(d)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / f, d / f)
    return d


def transformers_qwen3_dir(d: Path, tokenizer: Path | None = None) -> Path:
    """``transformers_moe_dir`` of the ``qwen3`` family."""
    return transformers_moe_dir(d, "qwen3", tokenizer)
