"""Typed configuration of the embedded MoE transformer.

``MoEConfig`` is a frozen dataclass that round-trips through ``config.json`` (``to_json`` / ``from_json``,
``save`` / ``load``). Unknown keys in a file are ignored (so a config written by a newer version still
loads); missing keys take the defaults below; bad values raise ``ConfigError`` naming the field.

The defaults are the in-house tiny model (a Mixtral of one key head per query head, ~4.5 M parameters, sized
to sample at a useful speed on two CPU cores); the shipped default (``t1async/model/assets/config.json``) is
a Qwen3-MoE of the same widths. The same dataclass describes the Hugging Face MoE architectures the
model runs natively (``SUPPORTED_ARCHITECTURES``; design §2 "Models"): ``load`` reads either our own
``config.json`` (``model_type`` ``t1async_moe``) or a Hugging Face one (``architectures``), and
``to_hf_dict`` writes the latter for a config with an ``architecture``.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from t1async.protocol.errors import ConfigError

MODEL_TYPE = "t1async_moe"

QWEN3_MOE = "Qwen3MoeForCausalLM"
QWEN2_MOE = "Qwen2MoeForCausalLM"
MIXTRAL = "MixtralForCausalLM"
OLMOE = "OlmoeForCausalLM"
# architecture -> model_type
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    QWEN3_MOE: "qwen3_moe",
    QWEN2_MOE: "qwen2_moe",
    MIXTRAL: "mixtral",
    OLMOE: "olmoe",
}

# the Hugging Face config keys MoEConfig reads or writes; any other key of a loaded config.json (token ids,
# training-time options) is kept verbatim in ``hf_extra`` and written back by ``to_hf_dict``
_HF_KEYS = frozenset(
    "architectures model_type vocab_size hidden_size num_hidden_layers num_attention_heads num_key_value_heads "
    "head_dim num_experts_per_tok max_position_embeddings rope_theta rope_scaling rope_parameters rms_norm_eps "
    "tie_word_embeddings hidden_act initializer_range t1async_seed torch_dtype dtype transformers_version "
    "num_experts num_local_experts moe_intermediate_size intermediate_size norm_topk_prob decoder_sparse_step "
    "mlp_only_layers attention_bias mlp_bias use_sliding_window sliding_window qkv_bias "
    "shared_expert_intermediate_size clip_qkv".split()
)

# the fields added for the Hugging Face architectures, with the values that make them a no-op (the in-house
# model): ``to_dict`` leaves them out at these values, so configs (and the recipe digests hashing them) written
# before stay byte-identical
_EXTENDED_DEFAULTS: dict[str, Any] = {
    "n_kv_heads": 0,
    "head_dim": 0,
    "qk_norm": False,
    "norm_topk_prob": True,
    "dense_layers": (),
    "dense_d_ff": 0,
    "tie_embeddings": False,
    "qkv_bias": False,
    "shared_d_ff": 0,
    "qk_norm_full": False,
    "clip_qkv": 0.0,
    "architecture": "",
    "hf_extra": (),
}


@dataclass(frozen=True)
class MoEConfig:
    vocab_size: int = 4096
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_experts: int = 8
    top_k: int = 2
    d_ff: int = 256  # hidden width of one expert (SwiGLU)
    max_seq_len: int = 32768
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    seed: int = 0  # deterministic weight init (see weights.init_weights)
    init_std: float = 0.02
    # Hugging Face architectures (the defaults are the in-house model; see _EXTENDED_DEFAULTS)
    n_kv_heads: int = 0  # key/value heads (grouped-query attention); 0 = n_heads
    head_dim: int = 0  # width of one attention head; 0 = d_model // n_heads
    qk_norm: bool = False  # RMSNorm over each query and key head before the rotary embedding (Qwen3)
    norm_topk_prob: bool = True  # gates renormalised over the chosen experts; False: their softmax-over-all probs
    dense_layers: tuple[int, ...] = ()  # layers with a dense SwiGLU MLP instead of experts (Qwen3 mlp_only_layers)
    dense_d_ff: int = 0  # hidden width of a dense layer's MLP (HF intermediate_size); 0 = d_ff
    tie_embeddings: bool = False  # lm_head shares the embedding matrix
    qkv_bias: bool = False  # biases on the query, key and value projections (Qwen2)
    shared_d_ff: int = 0  # hidden width of a shared expert every token uses, gated by a sigmoid (Qwen2); 0 = none
    qk_norm_full: bool = False  # with qk_norm: one RMSNorm over all query heads, one over all key heads (OLMoE)
    clip_qkv: float = 0.0  # clamp q, k, v (after the q/k norm) to [-clip_qkv, clip_qkv] (OLMoE); 0 = off
    architecture: str = ""  # "" = the in-house format; else a key of SUPPORTED_ARCHITECTURES (HF save format)
    hf_extra: tuple[tuple[str, str], ...] = ()  # other keys of a loaded HF config.json: (key, JSON value), sorted

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_experts", "top_k", "d_ff", "max_seq_len"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"MoEConfig.{name} must be a positive int, got {v!r}")
        for name in ("n_kv_heads", "head_dim", "dense_d_ff", "shared_d_ff"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ConfigError(f"MoEConfig.{name} must be an int >= 0 (0 = the default), got {v!r}")
        if not self.head_dim and self.d_model % self.n_heads:
            raise ConfigError(
                f"MoEConfig.d_model={self.d_model} must split into n_heads={self.n_heads} heads (or set head_dim)"
            )
        # resolve the 0 = default fields, so every user reads plain numbers
        object.__setattr__(self, "head_dim", self.head_dim or self.d_model // self.n_heads)
        object.__setattr__(self, "n_kv_heads", self.n_kv_heads or self.n_heads)
        object.__setattr__(self, "dense_d_ff", self.dense_d_ff or self.d_ff)
        object.__setattr__(self, "dense_layers", tuple(sorted(set(self.dense_layers))))
        if self.head_dim % 2:
            raise ConfigError(f"MoEConfig.head_dim={self.head_dim} must be even (rotary embeddings rotate pairs)")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(f"MoEConfig.n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads}")
        if any(not isinstance(i, int) or not 0 <= i < self.n_layers for i in self.dense_layers):
            raise ConfigError(
                f"MoEConfig.dense_layers={self.dense_layers} must be layer indices in [0, {self.n_layers})"
            )
        if self.top_k > self.n_experts:
            raise ConfigError(f"MoEConfig.top_k={self.top_k} exceeds n_experts={self.n_experts}")
        if not self.clip_qkv >= 0 or (self.qk_norm_full and not self.qk_norm):
            raise ConfigError(
                f"MoEConfig.clip_qkv must be >= 0 (0 = off), got {self.clip_qkv!r}; qk_norm_full needs qk_norm"
            )
        if not self.rope_theta > 0 or not self.norm_eps > 0 or not self.init_std > 0:
            raise ConfigError(
                f"MoEConfig.rope_theta, norm_eps and init_std must be > 0, got "
                f"{self.rope_theta!r}, {self.norm_eps!r}, {self.init_std!r}"
            )
        if self.architecture and self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"MoEConfig.architecture={self.architecture!r} is not supported; use one of "
                f"{', '.join(SUPPORTED_ARCHITECTURES)} (or '' for the in-house format)"
            )
        if self.architecture == MIXTRAL and (self.qk_norm or not self.norm_topk_prob or self.dense_layers):
            raise ConfigError(
                "MoEConfig: MixtralForCausalLM has no q/k norm, no dense layers and renormalised top-k gates "
                "(qk_norm=False, dense_layers=(), norm_topk_prob=True)"
            )
        if self.architecture in (MIXTRAL, QWEN3_MOE, OLMOE) and (self.qkv_bias or self.shared_d_ff):
            raise ConfigError(f"MoEConfig: {self.architecture} has no qkv bias and no shared expert")
        if self.architecture != OLMOE and self.architecture and (self.qk_norm_full or self.clip_qkv):
            raise ConfigError(f"MoEConfig: {self.architecture} has no whole-projection q/k norm and no clip_qkv")
        if self.architecture == OLMOE and (not self.qk_norm_full or self.dense_layers):
            raise ConfigError("MoEConfig: OlmoeForCausalLM has q/k norms over whole projections and no dense layers")
        if self.architecture == QWEN2_MOE and self.qk_norm:
            raise ConfigError("MoEConfig: Qwen2MoeForCausalLM has no q/k norm (qk_norm=False)")

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """The layers with routed experts (every layer but ``dense_layers``)."""
        return tuple(i for i in range(self.n_layers) if i not in self.dense_layers)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        ext = dataclasses.asdict(dataclasses.replace(self, **_EXTENDED_DEFAULTS))  # the same, defaults resolved
        for k in _EXTENDED_DEFAULTS:  # left out when they change nothing (older files and digests stay the same)
            if d[k] == ext[k]:
                del d[k]
            elif isinstance(d[k], tuple):
                d[k] = list(d[k])
        d["model_type"] = MODEL_TYPE
        # HF-style aliases, informational (what SGLang/transformers tools look for)
        d["num_hidden_layers"] = self.n_layers
        d["num_experts"] = self.n_experts
        d["num_experts_per_tok"] = self.top_k
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_dict(cls, d: dict) -> MoEConfig:
        """Our ``config.json`` (``model_type`` ``t1async_moe``) or a Hugging Face one (see ``from_hf_dict``)."""
        if not isinstance(d, dict):
            raise ConfigError(f"model config must be a JSON object, got {type(d).__name__}")
        mt = d.get("model_type", MODEL_TYPE)
        if mt != MODEL_TYPE or "architectures" in d:
            return cls.from_hf_dict(d)
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in d.items() if k in names}
        for k in ("rope_theta", "norm_eps", "init_std", "clip_qkv"):
            if isinstance(kwargs.get(k), int):
                kwargs[k] = float(kwargs[k])
        if isinstance(kwargs.get("dense_layers"), list):
            kwargs["dense_layers"] = tuple(kwargs["dense_layers"])
        if isinstance(kwargs.get("hf_extra"), list):
            kwargs["hf_extra"] = tuple(tuple(kv) for kv in kwargs["hf_extra"])
        return cls(**kwargs)

    @classmethod
    def from_hf_dict(cls, d: dict) -> MoEConfig:
        """A Hugging Face ``config.json`` of a supported architecture (``SUPPORTED_ARCHITECTURES``)."""
        by_type = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}
        archs = d.get("architectures") or ([by_type[d["model_type"]]] if d.get("model_type") in by_type else [])
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            named = archs or [d.get("model_type")]
            raise ConfigError(
                f"unsupported model architecture {named}: supported are {', '.join(SUPPORTED_ARCHITECTURES)} "
                f"and model_type {MODEL_TYPE!r}"
            )

        def get(key: str, default: Any = None) -> Any:
            v = d.get(key)
            return default if v is None else v

        for key, ok in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
            if get(key, ok) != ok:
                raise ConfigError(f"{arch}: {key}={d[key]!r} is not supported (only {ok!r})")
        rope: dict = {}
        for r in (d.get("rope_scaling") or {}, d.get("rope_parameters") or {}):  # transformers 5 writes the latter
            if r.get("rope_type", r.get("type", "default")) != "default":
                raise ConfigError(f"{arch}: rope scaling {r!r} is not supported (only the default rotary embedding)")
            rope.update(r)
        if d.get("use_sliding_window") or (arch == MIXTRAL and d.get("sliding_window") is not None):
            raise ConfigError(f"{arch}: sliding-window attention is not supported (set sliding_window to null)")
        n_layers = int(get("num_hidden_layers"))
        kw: dict[str, Any] = {
            "architecture": arch,
            "vocab_size": get("vocab_size"),
            "d_model": get("hidden_size"),
            "n_layers": n_layers,
            "n_heads": get("num_attention_heads"),
            "n_kv_heads": get("num_key_value_heads", 0),
            "head_dim": get("head_dim", 0),
            "top_k": get("num_experts_per_tok"),
            "max_seq_len": get("max_position_embeddings", 32768),
            "rope_theta": float(get("rope_theta", rope.get("rope_theta", 1e6 if arch == MIXTRAL else 1e4))),
            "norm_eps": float(get("rms_norm_eps", 1e-6)),
            "tie_embeddings": bool(get("tie_word_embeddings", False)),
            "seed": get("t1async_seed", 0),
            "init_std": float(get("initializer_range", 0.02)),
            "hf_extra": tuple(sorted((k, json.dumps(v, sort_keys=True)) for k, v in d.items() if k not in _HF_KEYS)),
        }
        if arch == OLMOE:
            kw.update(
                n_experts=get("num_experts", get("num_local_experts")),
                d_ff=get("intermediate_size"),
                norm_topk_prob=bool(get("norm_topk_prob", False)),
                qk_norm=True,
                qk_norm_full=True,
                clip_qkv=float(get("clip_qkv", 0.0)),
                norm_eps=float(get("rms_norm_eps", 1e-5)),
            )
        elif arch in (QWEN3_MOE, QWEN2_MOE):
            step = int(get("decoder_sparse_step", 1))
            only = set(get("mlp_only_layers", []))
            kw.update(
                n_experts=get("num_experts", get("num_local_experts")),
                d_ff=get("moe_intermediate_size"),
                dense_d_ff=get("intermediate_size", 0),
                norm_topk_prob=bool(get("norm_topk_prob", False)),
                dense_layers=tuple(i for i in range(n_layers) if i in only or (i + 1) % step != 0),
            )
            if arch == QWEN3_MOE:
                kw["qk_norm"] = True
            else:
                kw["qkv_bias"] = bool(get("qkv_bias", True))
                kw["shared_d_ff"] = get("shared_expert_intermediate_size")
        else:
            kw.update(n_experts=get("num_local_experts"), d_ff=get("intermediate_size"))
        missing = [k for k, v in kw.items() if v is None]
        if missing:
            raise ConfigError(f"{arch} config lacks the fields behind {missing}: is it a complete config.json?")
        return cls(**kw)

    def to_hf_dict(self, torch_dtype: str = "float32") -> dict:
        """This config as a Hugging Face ``config.json`` of ``architecture`` (transformers and SGLang read it),
        with the ``hf_extra`` keys of the config it was loaded from and the dtype of the saved tensors."""
        if not self.architecture:
            raise ConfigError("MoEConfig.architecture is '' (the in-house format): no Hugging Face config to write")
        d: dict[str, Any] = {k: json.loads(v) for k, v in self.hf_extra}
        d.update(
            {
                "architectures": [self.architecture],
                "model_type": SUPPORTED_ARCHITECTURES[self.architecture],
                "vocab_size": self.vocab_size,
                "hidden_size": self.d_model,
                "num_hidden_layers": self.n_layers,
                "num_attention_heads": self.n_heads,
                "num_key_value_heads": self.n_kv_heads,
                "head_dim": self.head_dim,
                "num_experts_per_tok": self.top_k,
                "max_position_embeddings": self.max_seq_len,
                "rope_theta": self.rope_theta,
                "rope_scaling": None,
                "rms_norm_eps": self.norm_eps,
                "tie_word_embeddings": self.tie_embeddings,
                "hidden_act": "silu",
                "initializer_range": self.init_std,
                "t1async_seed": self.seed,
                "torch_dtype": torch_dtype,
            }
        )
        if self.architecture == OLMOE:
            d.update(
                num_experts=self.n_experts,
                intermediate_size=self.d_ff,
                norm_topk_prob=self.norm_topk_prob,
                clip_qkv=self.clip_qkv or None,
                attention_bias=False,
            )
        elif self.architecture in (QWEN3_MOE, QWEN2_MOE):
            d.update(
                num_experts=self.n_experts,
                moe_intermediate_size=self.d_ff,
                intermediate_size=self.dense_d_ff,
                norm_topk_prob=self.norm_topk_prob,
                decoder_sparse_step=1,
                mlp_only_layers=list(self.dense_layers),
                attention_bias=False,
                use_sliding_window=False,
            )
            if self.architecture == QWEN2_MOE:
                del d["attention_bias"]
                d.update(qkv_bias=self.qkv_bias, shared_expert_intermediate_size=self.shared_d_ff)
        else:
            d.update(num_local_experts=self.n_experts, intermediate_size=self.d_ff, sliding_window=None)
        return d

    def save(self, path: str | Path, torch_dtype: str = "float32") -> None:
        """Write ``config.json``: the Hugging Face one for an ``architecture`` (``torch_dtype`` names the
        tensors' dtype there), else ours."""
        if self.architecture:
            Path(path).write_text(json.dumps(self.to_hf_dict(torch_dtype), indent=2, sort_keys=True) + "\n")
        else:
            Path(path).write_text(self.to_json())

    @classmethod
    def from_json(cls, text: str) -> MoEConfig:
        try:
            d = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"model config is not valid JSON: {exc}") from exc
        return cls.from_dict(d)

    @classmethod
    def load(cls, path: str | Path) -> MoEConfig:
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        if not p.is_file():
            raise ConfigError(f"no model config at {p}: expected a model directory holding config.json")
        return cls.from_json(p.read_text())
