"""Model directories: save, load, and the shipped default.

A model directory holds ``config.json`` (``MoEConfig``), ``model.safetensors`` (fp32 or bf16 tensors, keyed
by ``MoETransformer.state_dict()`` names) and the tokenizer files (``tokenizer.json``,
``tokenizer_config.json``), so ``transformers.AutoTokenizer.from_pretrained(dir)`` works on it.

    save_pretrained(model, dir, tokenizer=None)     # tokenizer None -> the shipped one
    model = load_pretrained(dir, dtype=torch.float32)
    load_weights_into(model, dir)                   # in place (the engine's weight update); checks the config
    default_model_dir()                             # the shipped tiny model, materialised on first use

The default model ships as ``assets/config.json`` plus the tokenizer; its weights are the deterministic
init from ``config.seed`` (numpy PCG64, see ``MoETransformer.reset_parameters``), written once to
``$T1ASYNC_CACHE`` or ``$XDG_CACHE_HOME/t1async`` or ``~/.cache/t1async``, under
``models/<hash of the asset files>/``. The write is atomic (temp dir + rename), so concurrent first uses race
harmlessly.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from t1async.model.config import MoEConfig
from t1async.model.moe import MoETransformer
from t1async.model.tokenizer import TOKENIZER_FILES, ChatTokenizer, assets_dir
from t1async.protocol.errors import ConfigError

WEIGHTS_FILE = "model.safetensors"
INIT_VERSION = "numpy-pcg64-v1"  # bump when reset_parameters changes, so cached defaults are rebuilt


def save_pretrained(model: MoETransformer, directory: str | Path, tokenizer: ChatTokenizer | None = None) -> Path:
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    save_file(state, str(d / WEIGHTS_FILE), metadata={"format": "pt", "model_type": "t1async_moe"})
    model.cfg.save(d / "config.json")
    (tokenizer or ChatTokenizer.load()).save(d, model_max_length=model.cfg.max_seq_len)
    return d


def _read_state(directory: Path) -> dict[str, torch.Tensor]:
    f = directory / WEIGHTS_FILE
    if not f.is_file():
        raise ConfigError(f"no weights at {f}: a model directory needs {WEIGHTS_FILE} (see save_pretrained)")
    try:
        return load_file(str(f))
    except Exception as exc:  # safetensors raises SafetensorError / OSError variants
        raise ConfigError(f"cannot read weights {f}: {exc}") from exc


def _same_arch(a: MoEConfig, b: MoEConfig) -> bool:
    return dataclasses.replace(a, seed=0, init_std=1.0) == dataclasses.replace(b, seed=0, init_std=1.0)


def load_weights_into(model: MoETransformer, directory: str | Path) -> None:
    """Copy a model directory's weights into ``model`` in place (keeping the model's dtype)."""
    d = Path(directory)
    cfg = MoEConfig.load(d)
    if not _same_arch(cfg, model.cfg):
        raise ConfigError(f"model at {d} has config {cfg}, which does not match the running model's {model.cfg}")
    state = _read_state(d)
    own = model.state_dict()
    missing, extra = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    if missing or extra:
        raise ConfigError(f"weights at {d} do not fit the model: missing {missing[:5]}, unexpected {extra[:5]}")
    for k, v in state.items():
        if tuple(v.shape) != tuple(own[k].shape):
            raise ConfigError(f"weights at {d}: {k} has shape {tuple(v.shape)}, model expects {tuple(own[k].shape)}")
    with torch.no_grad():
        for k, p in own.items():
            p.copy_(state[k].to(p.dtype))


def check_state(shapes: dict[str, tuple[int, ...]], state: dict[str, torch.Tensor], where: str = "the update") -> None:
    """Raise ConfigError unless every named tensor is in ``shapes`` (a model's state_dict names) with that shape."""
    unknown = sorted(set(state) - set(shapes))
    if unknown:
        raise ConfigError(
            f"{where}: names not in the model: {unknown[:5]} (send names from the same model's state_dict)"
        )
    for k, v in state.items():
        if tuple(v.shape) != tuple(shapes[k]):
            raise ConfigError(f"{where}: {k} has shape {tuple(v.shape)}, model expects {tuple(shapes[k])}")


def load_state_into(model: MoETransformer, state: dict[str, torch.Tensor], where: str = "the update") -> None:
    """Copy some named tensors (a subset of the state dict: one bucket of a distributed update) into ``model``
    in place, casting to the model's dtype. Every name and shape is checked before anything is copied."""
    own = model.state_dict()
    check_state({k: tuple(v.shape) for k, v in own.items()}, state, where)
    with torch.no_grad():
        for k, v in state.items():
            own[k].copy_(v.to(own[k].dtype))


def load_pretrained(directory: str | Path, dtype: torch.dtype = torch.float32) -> MoETransformer:
    d = Path(directory)
    model = MoETransformer(MoEConfig.load(d))
    load_weights_into(model, d)
    return model.to(dtype).eval()


def default_cache_root() -> Path:
    """Where t1async caches models and warm starts: $T1ASYNC_CACHE, else $XDG_CACHE_HOME/t1async (~/.cache)."""
    if os.environ.get("T1ASYNC_CACHE"):
        return Path(os.environ["T1ASYNC_CACHE"])
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "t1async"


def default_model_dir() -> Path:
    """The shipped tiny model as a model directory (weights created from the config's seed on first use)."""
    src = assets_dir()
    h = hashlib.sha256(INIT_VERSION.encode())
    for name in ("config.json", *TOKENIZER_FILES):
        h.update((src / name).read_bytes())
    dest = default_cache_root() / "models" / h.hexdigest()[:16]
    if (dest / WEIGHTS_FILE).is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=dest.parent))
    try:
        model = MoETransformer(MoEConfig.load(src / "config.json"))
        save_pretrained(model, tmp)
        for name in TOKENIZER_FILES:  # the shipped files verbatim
            shutil.copyfile(src / name, tmp / name)
        try:
            tmp.rename(dest)
        except OSError:
            if not (dest / WEIGHTS_FILE).is_file():  # lost a race only if the winner finished
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest
