"""``bench.mismatch --model qwen3-moe-tiny``: a tiny seeded Qwen3-MoE model dir, built without a download.

Our own ``MoEConfig`` for ``Qwen3MoeForCausalLM`` (no ``transformers`` needed), written with our
``save_pretrained`` in the Hugging Face layout (``config.json``, ``model.safetensors`` under the hub's names,
the shipped tokenizer). The shape has what makes a real Qwen3-MoE differ from the in-house model: grouped-query
attention with an explicit ``head_dim``, RMSNorm on each query and key head, softmax-over-all gates
renormalised at the top-k, and one dense ``mlp_only_layers`` layer.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from pathlib import Path

from t1async.model.config import QWEN3_MOE, MoEConfig
from t1async.model.moe import MoETransformer
from t1async.model.weights import WEIGHTS_FILE, save_pretrained

TINY_NAMES = ("qwen3-moe-tiny",)  # --model values that build a model instead of naming a dir

QWEN3_MOE_TINY = MoEConfig(
    architecture=QWEN3_MOE,
    vocab_size=4096,  # the shipped tokenizer's
    d_model=128,
    n_layers=4,
    n_heads=4,
    n_kv_heads=2,
    head_dim=48,  # not d_model / n_heads, as in Qwen3-30B-A3B (head_dim 128, d_model 2048, 32 heads)
    n_experts=8,
    top_k=2,
    d_ff=96,  # moe_intermediate_size
    dense_d_ff=256,  # intermediate_size (the dense layer's MLP)
    dense_layers=(0,),  # mlp_only_layers
    qk_norm=True,
    norm_topk_prob=True,
    max_seq_len=8192,
    rope_theta=1e6,
    norm_eps=1e-6,
    seed=0,
)


def tiny_model_dir(name: str, cache: Path) -> Path:
    """The model dir of ``name`` (one of ``TINY_NAMES``) under ``cache``, built once (atomically) and reused;
    keyed by the config, so a changed shape is a new dir."""
    if name not in TINY_NAMES:
        raise ValueError(f"unknown built-in model {name!r}; one of {', '.join(TINY_NAMES)}")
    cfg = QWEN3_MOE_TINY
    key = hashlib.sha256(cfg.to_json().encode()).hexdigest()[:12]
    dest = cache / "models" / f"{name}-{key}"
    if (dest / WEIGHTS_FILE).is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=dest.parent))
    try:
        save_pretrained(MoETransformer(cfg), tmp)  # seeded init (cfg.seed)
        try:
            tmp.rename(dest)
        except OSError:
            if not (dest / WEIGHTS_FILE).is_file():  # lost a race only if the winner finished
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest
