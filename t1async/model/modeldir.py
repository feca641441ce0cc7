"""What makes a directory a model dir the sampler, the learner and the actors can load (no torch imported).

``check_model_dir`` is the one check every ``--model DIR`` flag runs before anything starts, so a wrong path
is one line naming what is missing instead of a traceback from deep inside a loader.
"""

from __future__ import annotations

from pathlib import Path

from t1async.model.config import MoEConfig
from t1async.model.tokenizer import TOKENIZER_FILES
from t1async.protocol.errors import ConfigError


def check_model_dir(path: Path, flag: str = "--model", *, weights: bool = True, tokenizer: bool = True) -> Path:
    """``path`` if it is a supported model dir: a directory with a supported ``config.json`` (our in-house
    format or a Hugging Face MoE architecture, design §2 "Models"), with ``tokenizer`` the tokenizer files and
    with ``weights`` ``*.safetensors`` weights; else ``ConfigError`` naming what is missing. (The sampler asks
    for no tokenizer: it is token-in, and its engine falls back to the shipped one.)"""
    p = Path(path)
    if not p.is_dir():
        raise ConfigError(f"{flag} {p}: no such directory; give a model dir (config.json, weights, tokenizer)")
    missing = [n for n in ("config.json", *(TOKENIZER_FILES if tokenizer else ())) if not (p / n).is_file()]
    if weights and not any(f.name != "value_head.safetensors" for f in p.glob("*.safetensors")):  # ours, not HF's
        missing.append("model.safetensors (or shards)")
    if missing:
        raise ConfigError(f"{flag} {p} is not a model dir: it lacks {', '.join(missing)}")
    try:
        MoEConfig.load(p)
    except ConfigError as exc:
        raise ConfigError(f"{flag} {p}: {exc}") from exc
    return p
