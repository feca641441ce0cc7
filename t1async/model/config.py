"""Typed configuration of the embedded MoE transformer.

``MoEConfig`` is a frozen dataclass that round-trips through ``config.json`` (``to_json`` / ``from_json``,
``save`` / ``load``). Unknown keys in a file are ignored (so a config written by a newer version still
loads); missing keys take the defaults below; bad values raise ``ConfigError`` naming the field.

The defaults are the shipped tiny model (``t1async/model/assets/config.json``): ~4.5 M parameters, sized to
sample at a useful speed on two CPU cores.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from t1async.protocol.errors import ConfigError

MODEL_TYPE = "t1async_moe"


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

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_experts", "top_k", "d_ff", "max_seq_len"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"MoEConfig.{name} must be a positive int, got {v!r}")
        if self.d_model % self.n_heads or (self.d_model // self.n_heads) % 2:
            raise ConfigError(
                f"MoEConfig.d_model={self.d_model} must split into n_heads={self.n_heads} heads of even width"
            )
        if self.top_k > self.n_experts:
            raise ConfigError(f"MoEConfig.top_k={self.top_k} exceeds n_experts={self.n_experts}")
        if not self.rope_theta > 0 or not self.norm_eps > 0 or not self.init_std > 0:
            raise ConfigError(
                f"MoEConfig.rope_theta, norm_eps and init_std must be > 0, got "
                f"{self.rope_theta!r}, {self.norm_eps!r}, {self.init_std!r}"
            )

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
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
        if not isinstance(d, dict):
            raise ConfigError(f"model config must be a JSON object, got {type(d).__name__}")
        mt = d.get("model_type", MODEL_TYPE)
        if mt != MODEL_TYPE:
            raise ConfigError(f"model config has model_type={mt!r}; this loader reads {MODEL_TYPE!r} only")
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in d.items() if k in names}
        for k in ("rope_theta", "norm_eps", "init_std"):
            if isinstance(kwargs.get(k), int):
                kwargs[k] = float(kwargs[k])
        return cls(**kwargs)

    @classmethod
    def from_json(cls, text: str) -> MoEConfig:
        try:
            d = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"model config is not valid JSON: {exc}") from exc
        return cls.from_dict(d)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> MoEConfig:
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        if not p.is_file():
            raise ConfigError(f"no model config at {p}: expected a model directory holding config.json")
        return cls.from_json(p.read_text())


# Named model shapes. "tiny" is the shipped default (assets/config.json). "learn" is the model the ``learn``
# warm-start recipe trains from its seeded init (t1async.recipes.warmstart): still a CPU-sized MoE with
# top-k routing, so R3 routing replay stays meaningful.
MODEL_PRESETS: dict[str, MoEConfig] = {
    "tiny": MoEConfig(),
    "learn": MoEConfig(),
}
