"""Model directories: save, load, and the shipped default.

A model directory holds ``config.json`` (``MoEConfig``), the weights (``model.safetensors``, or shards listed
by ``model.safetensors.index.json``; fp32 or bf16) and the tokenizer files (``tokenizer.json``,
``tokenizer_config.json``), so ``transformers.AutoTokenizer.from_pretrained(dir)`` works on it. Two formats:

- a Hugging Face architecture (``cfg.architecture``, design §2 "Models"): the Hugging Face ``config.json``
  and tensors under hub names (hf.py), what SGLang and ``transformers.AutoModelForCausalLM.from_pretrained``
  load; our value head (not part of the architecture) beside them in ``value_head.safetensors``;
- the in-house format (``architecture`` ""): our ``config.json`` and ``MoETransformer.state_dict()`` names,
  value head included.

Loading reads either, whatever wrote it (a transformers checkpoint, fused v5 expert names or not, a hub
download); a directory without ``value_head.safetensors`` keeps the model's value head as it is.

    save_pretrained(model, dir, tokenizer=None, max_shard_bytes=None)   # tokenizer None -> the shipped one
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
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from t1async.model.config import MoEConfig
from t1async.model.hf import canonical_hf_state, hf_slots, is_hf_state, slot_view, to_hf_state
from t1async.model.moe import MoETransformer
from t1async.model.tokenizer import TOKENIZER_FILES, ChatTokenizer, assets_dir
from t1async.protocol.errors import ConfigError

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
VALUE_HEAD_FILE = "value_head.safetensors"
INIT_VERSION = "numpy-pcg64-v1"  # bump when reset_parameters changes, so cached defaults are rebuilt
_VALUE_HEAD = ("value_head.weight", "value_head.bias")


def _write_state(d: Path, state: dict[str, torch.Tensor], meta: dict[str, str], max_shard_bytes: int | None) -> None:
    """One ``model.safetensors``, or shards of at most ``max_shard_bytes`` (a tensor never split) and the
    Hugging Face index naming each tensor's shard."""
    if max_shard_bytes is None:
        save_file(state, str(d / WEIGHTS_FILE), metadata=meta)
        return
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for k in sorted(state):
        n = state[k].numel() * state[k].element_size()
        if shards[-1] and size + n > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = state[k]
        size += n
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(d / name), metadata=meta)
        weight_map.update(dict.fromkeys(shard, name))
    total = sum(v.numel() * v.element_size() for v in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (d / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def save_pretrained(
    model: MoETransformer,
    directory: str | Path,
    tokenizer: ChatTokenizer | None = None,
    *,
    max_shard_bytes: int | None = None,
) -> Path:
    """Write ``model`` as a model directory (the format of its ``cfg.architecture``, see the module doc);
    ``max_shard_bytes`` splits the weights into shards with an index."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    for old in (WEIGHTS_FILE, INDEX_FILE, VALUE_HEAD_FILE, *(p.name for p in d.glob("model-*-of-*.safetensors"))):
        (d / old).unlink(missing_ok=True)  # no stale file of another layout may shadow the new weights
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    cfg = model.cfg
    if cfg.architecture:
        save_file({k: state[k] for k in _VALUE_HEAD}, str(d / VALUE_HEAD_FILE), metadata={"format": "pt"})
        _write_state(d, to_hf_state(cfg, state), {"format": "pt"}, max_shard_bytes)
    else:
        if cfg.tie_embeddings:
            del state["lm_head.weight"]  # the embedding (a file holds a tensor once)
        _write_state(d, state, {"format": "pt", "model_type": "t1async_moe"}, max_shard_bytes)
    cfg.save(d / "config.json", torch_dtype=str(next(iter(state.values())).dtype).removeprefix("torch."))
    (tokenizer or ChatTokenizer.load()).save(d, model_max_length=cfg.max_seq_len)
    return d


def _load(f: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(f))
    except Exception as exc:  # safetensors raises SafetensorError / OSError variants
        raise ConfigError(f"cannot read weights {f}: {exc}") from exc


def _read_state(directory: Path) -> dict[str, torch.Tensor]:
    """The weights of a model directory: ``model.safetensors`` or the shards its index names."""
    f, idx = directory / WEIGHTS_FILE, directory / INDEX_FILE
    if f.is_file():
        return _load(f)
    if not idx.is_file():
        raise ConfigError(
            f"no weights at {directory}: a model directory needs {WEIGHTS_FILE} or {INDEX_FILE} (see save_pretrained)"
        )
    try:
        files = sorted(set(json.loads(idx.read_text())["weight_map"].values()))
    except (ValueError, KeyError, AttributeError) as exc:
        raise ConfigError(f"{idx} is not a safetensors index (a JSON object with a weight_map): {exc}") from exc
    state: dict[str, torch.Tensor] = {}
    for name in files:
        state.update(_load(directory / name))
    return state


def _same_arch(a: MoEConfig, b: MoEConfig) -> bool:
    # the architecture names the file format only: the in-house model and a Mixtral of its shape are one model
    def key(c: MoEConfig) -> MoEConfig:
        return dataclasses.replace(c, seed=0, init_std=1.0, architecture="", hf_extra=())

    return key(a) == key(b)


def _own_targets(model: MoETransformer, names, where: str) -> dict[str, torch.Tensor]:
    """For each tensor name (ours or Hugging Face's), the model tensor (a view for a Hugging Face slice) it
    writes; ConfigError on a name the model does not have."""
    own = model.state_dict()
    slots = hf_slots(model.cfg)
    out, unknown = {}, []
    for k in names:
        if k in own:
            out[k] = own[k]
        elif k in slots:
            out[k] = slot_view(own[slots[k].name], slots[k])
        elif k == "lm_head.weight" and model.cfg.tie_embeddings:
            out[k] = own["embed.weight"]  # a tied head saved anyway: the embedding's copy
        else:
            unknown.append(k)
    if unknown:
        raise ConfigError(
            f"{where}: names not in the model: {sorted(unknown)[:5]} "
            f"(send names from the same model's state_dict, or its Hugging Face names)"
        )
    return out


def _copy_checked(targets: dict[str, torch.Tensor], state: dict[str, torch.Tensor], where: str) -> None:
    for k, v in state.items():
        if tuple(v.shape) != tuple(targets[k].shape):
            raise ConfigError(f"{where}: {k} has shape {tuple(v.shape)}, model expects {tuple(targets[k].shape)}")
    with torch.no_grad():
        for k, v in state.items():
            targets[k].copy_(v.to(targets[k].dtype))


def load_weights_into(model: MoETransformer, directory: str | Path) -> None:
    """Copy a model directory's weights into ``model`` in place (keeping the model's dtype)."""
    d = Path(directory)
    cfg = MoEConfig.load(d)
    if not _same_arch(cfg, model.cfg):
        raise ConfigError(f"model at {d} has config {cfg}, which does not match the running model's {model.cfg}")
    state = _read_state(d)
    if is_hf_state(state):
        state = canonical_hf_state(model.cfg, state)
        if model.cfg.tie_embeddings:
            state.pop("lm_head.weight", None)
        want = set(hf_slots(model.cfg))
        if (d / VALUE_HEAD_FILE).is_file():
            state.update(_load(d / VALUE_HEAD_FILE))
            want.update(_VALUE_HEAD)
    else:
        want = set(model.state_dict())
        if model.cfg.tie_embeddings and "lm_head.weight" not in state:
            want.discard("lm_head.weight")
    missing, extra = sorted(want - set(state)), sorted(set(state) - want)
    if missing or extra:
        raise ConfigError(f"weights at {d} do not fit the model: missing {missing[:5]}, unexpected {extra[:5]}")
    _copy_checked(_own_targets(model, state, f"weights at {d}"), state, f"weights at {d}")


def check_state(shapes: dict[str, tuple[int, ...]], state: dict[str, torch.Tensor], where: str = "the update") -> None:
    """Raise ConfigError unless every named tensor is in ``shapes`` with that shape. ``shapes`` is a model's
    state_dict names (an engine's ``state_shapes()``); to accept Hugging Face names too, pass
    ``{**shapes, **hf_state_shapes(cfg, shapes)}`` (hf.py)."""
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
    in place, casting to the model's dtype. Names are ours (``state_dict``) or Hugging Face's (hf.py: one
    projection or one expert, written into its slice of our fused tensor). Every name and shape is checked
    before anything is copied. Hugging Face names may be transformers 5's in-memory ones (fused experts)."""
    if is_hf_state(state):
        state = canonical_hf_state(model.cfg, state)
    _copy_checked(_own_targets(model, state, where), state, where)


def load_pretrained(directory: str | Path, dtype: torch.dtype = torch.float32) -> MoETransformer:
    """The model of a directory, in ``dtype``. Built on the meta device and allocated once in ``dtype`` (no
    random init, no fp32 copy of a bf16 model); a directory without a value head (a Hugging Face checkpoint)
    gets a fresh one (``MoETransformer.reset_value_head``)."""
    d = Path(directory)
    cfg = MoEConfig.load(d)
    with torch.device("meta"):
        model = MoETransformer(cfg, init=False)
    model = model.to(dtype).to_empty(device="cpu")
    if cfg.tie_embeddings:  # to_empty gives each reference its own storage: tie again
        model.lm_head.weight = model.embed.weight
    if cfg.architecture and not (d / VALUE_HEAD_FILE).is_file():
        model.reset_value_head()
    load_weights_into(model, d)
    return model.eval()


def default_cache_root() -> Path:
    """Where t1async caches models and warm starts: $T1ASYNC_CACHE, else $XDG_CACHE_HOME/t1async (~/.cache)."""
    if os.environ.get("T1ASYNC_CACHE"):
        return Path(os.environ["T1ASYNC_CACHE"])
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "t1async"


def default_config() -> MoEConfig:
    """The shipped default model's config (a tiny Qwen3-MoE, ``t1async/model/assets/config.json``)."""
    return MoEConfig.load(assets_dir() / "config.json")


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
        model = MoETransformer(default_config())
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
