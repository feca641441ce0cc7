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
