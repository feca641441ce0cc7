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
import re
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from t1async.model.config import OLMOE, QWEN2_MOE, QWEN3_MOE, MoEConfig
from t1async.model.hf import (
    Slot,
    canonical_hf_state,
    hf_slots,
    hf_state_shapes,
    is_hf_state,
    slot_view,
    to_hf_state,
)
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
    if max_shard_bytes is None:  # one file, still with an index: an engine that globs *.safetensors (vLLM)
        save_file(state, str(d / WEIGHTS_FILE), metadata=meta)  # then loads only it, never value_head's file
        total = sum(v.numel() * v.element_size() for v in state.values())
        index = {"metadata": {"total_size": total}, "weight_map": dict.fromkeys(sorted(state), WEIGHTS_FILE)}
        (d / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
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


def _weight_files(directory: Path) -> list[Path]:
    """The weight files of a model directory: ``model.safetensors``, or the shards its index names."""
    f, idx = directory / WEIGHTS_FILE, directory / INDEX_FILE
    if f.is_file():
        return [f]
    if not idx.is_file():
        raise ConfigError(
            f"no weights at {directory}: a model directory needs {WEIGHTS_FILE} or {INDEX_FILE} (see save_pretrained)"
        )
    try:
        names = sorted(set(json.loads(idx.read_text())["weight_map"].values()))
    except (ValueError, KeyError, AttributeError) as exc:
        raise ConfigError(f"{idx} is not a safetensors index (a JSON object with a weight_map): {exc}") from exc
    return [directory / n for n in names]


def weights_digest(directory: str | Path) -> str:
    """A short digest (16 hex) of a model directory's weight files, their bytes: what says two builds of one
    recipe are the same model. The cache names a warm start by its recipe only, so a build made on another
    machine or by other code sits under the same name whatever its weights."""
    h = hashlib.sha256()
    for f in _weight_files(Path(directory)):
        with f.open("rb") as fh:
            while chunk := fh.read(1 << 20):
                h.update(chunk)
    return h.hexdigest()[:16]


def local_rows(p: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The part of parameter ``p`` this process holds (an FSDP2 DTensor's local shard: rows of dim 0) and the
    global index of its first row; a plain tensor is all its own rows, from 0."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if isinstance(p, DTensor):
        shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
        return p.to_local(), int(offset[0])
    return p, 0


@dataclasses.dataclass(frozen=True)
class _Piece:
    """One tensor of a weight file and where it goes: our parameter ``ours``, through ``slot`` (hf.py), or the
    whole parameter (``slot`` None: our own name, or transformers 5's fused experts ``fused``)."""

    file: Path
    name: str
    ours: str
    slot: Slot | None = None
    fused: str = ""  # "gate_up" ([E, 2f, d] -> w_gate, w_up) or "down" ([E, d, f] -> w_down)


_FUSED_FILE = re.compile(r"(model\.layers\.(\d+))\.(?:mlp|block_sparse_moe)\.experts\.(gate_up_proj|down_proj)")


def _plan(model: MoETransformer, d: Path) -> list[_Piece]:
    """Every tensor of ``d``'s weight files (headers only: no data read) and where it goes in ``model``; the
    names and shapes checked against the model first (ConfigError naming the first misfit)."""
    cfg = model.cfg
    shapes: dict[Path, dict[str, tuple[int, ...]]] = {}
    for f in _weight_files(d) + ([d / VALUE_HEAD_FILE] if (d / VALUE_HEAD_FILE).is_file() else []):
        try:
            with safe_open(str(f), "pt") as h:
                shapes[f] = {k: tuple(h.get_slice(k).get_shape()) for k in h.keys()}  # noqa: SIM118
        except Exception as exc:  # safetensors raises SafetensorError / OSError variants
            raise ConfigError(f"cannot read weights {f}: {exc}") from exc
    own = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    names = {k for s in shapes.values() for k in s}
    where = f"weights at {d}"
    pieces: list[_Piece] = []
    expect: dict[str, tuple[int, ...]] = {}
    if is_hf_state(names):
        slots = hf_slots(cfg)
        expect = hf_state_shapes(cfg, own)
        moe = "mlp" if cfg.architecture in (QWEN3_MOE, QWEN2_MOE, OLMOE) else "block_sparse_moe"
        want, got = set(slots), set[str]()
        if d / VALUE_HEAD_FILE in shapes:
            want.update(_VALUE_HEAD)
        for f, s in shapes.items():
            for k in s:
                m = _FUSED_FILE.fullmatch(k)
                hub = k if moe == "mlp" or ".mlp." not in k else k.replace(".mlp.", f".{moe}.")
                if m is not None:  # transformers 5's fused experts: [E, 2f, d] or [E, d, f]
                    o = f"blocks.{m.group(2)}.moe."
                    e, dm, ff = cfg.n_experts, cfg.d_model, cfg.d_ff
                    fused, ours, shape = (
                        ("gate_up", o + "w_gate", (e, 2 * ff, dm))
                        if m.group(3) == "gate_up_proj"
                        else ("down", o + "w_down", (e, dm, ff))
                    )
                    expect[k] = shape
                    pieces.append(_Piece(f, k, ours, fused=fused))
                    g, u, dn = _expert_names(cfg)
                    p = f"{m.group(1)}.{moe}.experts"
                    got.update(
                        f"{p}.{i}.{x}.weight" for i in range(e) for x in ((g, u) if fused == "gate_up" else (dn,))
                    )
                elif hub in slots:
                    pieces.append(_Piece(f, k, slots[hub].name, slots[hub]))
                    expect[k] = expect[hub]
                    got.add(hub)
                elif k in _VALUE_HEAD:
                    pieces.append(_Piece(f, k, k))
                    expect[k] = own[k]
                    got.add(k)
                elif k == "lm_head.weight" and cfg.tie_embeddings:
                    continue  # a tied head saved anyway: the embedding's copy
                else:
                    got.add(k)
    else:
        want = set(own)
        if cfg.tie_embeddings:
            want.discard("lm_head.weight")
        got = set()
        for f, s in shapes.items():
            for k in s:
                got.add(k)
                if k in own and not (k == "lm_head.weight" and cfg.tie_embeddings):
                    pieces.append(_Piece(f, k, k))
                    expect[k] = own[k]
    missing, extra = sorted(want - got), sorted(got - want)
    if missing or extra:
        raise ConfigError(f"weights at {d} do not fit the model: missing {missing[:5]}, unexpected {extra[:5]}")
    for pc in pieces:
        if shapes[pc.file][pc.name] != expect[pc.name]:
            raise ConfigError(
                f"{where}: {pc.name} has shape {shapes[pc.file][pc.name]}, model expects {expect[pc.name]}"
            )
    return pieces


def _expert_names(cfg: MoEConfig) -> tuple[str, str, str]:
    if cfg.architecture in (QWEN3_MOE, QWEN2_MOE, OLMOE):
        return "gate_proj", "up_proj", "down_proj"
    return "w1", "w3", "w2"


def _read_piece(h, pc: _Piece, params: dict[str, torch.Tensor], cfg: MoEConfig) -> int:  # noqa: ANN001 - safe_open
    """Copy the rows of one file tensor that this process holds into its parameter; returns the bytes read."""
    local, lo = local_rows(params[pc.ours])
    hi = lo + local.shape[0]
    sl = h.get_slice(pc.name)
    s = pc.slot
    if pc.fused:  # [E, ...]: this process's experts
        if hi <= lo:
            return 0
        x = sl[lo:hi].to(local.dtype)
        if pc.fused == "down":
            local.copy_(x.transpose(1, 2))
        else:
            up, _ = local_rows(params[pc.ours.replace("w_gate", "w_up")])
            ff = cfg.d_ff
            local.copy_(x[:, :ff].transpose(1, 2))
            up.copy_(x[:, ff:].transpose(1, 2))
        return x.numel() * x.element_size()
    if s is not None and s.expert is not None:  # one expert: all of it, or none of it, is here
        if not lo <= s.expert < hi:
            return 0
        x = sl[:]
        local[s.expert - lo].copy_(x.T if s.transpose else x)
    elif s is not None and s.rows is not None:  # rows [a, b) of ours (one projection of the fused qkv)
        a, b = max(s.rows[0], lo), min(s.rows[1], hi)
        if b <= a:
            return 0
        x = sl[a - s.rows[0] : b - s.rows[0]]
        local[a - lo : b - lo].copy_(x)
    elif s is not None and s.transpose:  # ours [d, f] is theirs [f, d] transposed: our rows are their columns
        if hi <= lo:
            return 0
        x = sl[:, lo:hi]
        local.copy_(x.T)
    else:
        if hi <= lo:
            return 0
        x = sl[lo:hi]
        local.copy_(x)
    return x.numel() * x.element_size()


def load_local(model: MoETransformer, directory: str | Path) -> int:
    """Copy a model directory's weights into ``model`` in place (keeping its dtype), reading from the
    safetensors files only the rows this process holds: all of them for a plain model, the rank's shards
    for one sharded by FSDP2 (``fully_shard``, then ``to_empty``), where every rank calls this. Hugging Face
    names map into our fused and stacked tensors (hf.py): a rank reads only its own experts and its rows of
    the rest; no process holds a full copy. A Hugging Face directory without ``value_head.safetensors``
    gets ``MoETransformer.reset_value_head``'s head (the same on every rank). Returns the bytes read."""
    d = Path(directory)
    cfg = MoEConfig.load(d)
    if not _same_arch(cfg, model.cfg):
        raise ConfigError(f"model at {d} has config {cfg}, which does not match the running model's {model.cfg}")
    pieces = _plan(model, d)
    params = model.state_dict(keep_vars=True)
    read = 0
    with torch.no_grad():
        by_file: dict[Path, list[_Piece]] = {}
        for pc in pieces:
            by_file.setdefault(pc.file, []).append(pc)
        for f, ps in by_file.items():  # one file mapped at a time: its touched pages go when it closes
            with safe_open(str(f), "pt") as h:
                for pc in ps:
                    read += _read_piece(h, pc, params, model.cfg)
        if cfg.architecture and not any(pc.name in _VALUE_HEAD for pc in pieces):
            _fresh_value_head(model, params)
    return read


def _fresh_value_head(model: MoETransformer, params: dict[str, torch.Tensor]) -> None:
    """``reset_value_head``'s weights, computed whole (a [1, d] head) and copied into this process's rows."""
    import types

    head = torch.nn.Linear(model.cfg.d_model, 1)
    MoETransformer.reset_value_head(types.SimpleNamespace(cfg=model.cfg, value_head=head))  # type: ignore[arg-type]
    for k, full in (("value_head.weight", head.weight), ("value_head.bias", head.bias)):
        local, lo = local_rows(params[k])
        local.copy_(full.detach()[lo : lo + local.shape[0]])


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
    load_local(model, d)  # straight from the files into the model: no second copy of the weights
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


EXPORT_SHARD_BYTES = 1 << 30  # a rank starts a new weight file past this many bytes (its write buffer)


def _rank_range(n: int, rank: int, world: int) -> tuple[int, int]:
    """FSDP2's rows of dim 0 for ``rank`` (torch.chunk: ceil(n / world) each, the last ones short or empty)."""
    c = -(-n // world)
    return min(rank * c, n), min((rank + 1) * c, n)


def _need(shape: tuple[int, ...], slot: Slot | None) -> tuple[int, int]:
    """The rows of our tensor (dim 0) that one Hugging Face tensor of ``slot`` reads (None: all of it)."""
    if slot is not None and slot.expert is not None:
        return slot.expert, slot.expert + 1
    if slot is not None and slot.rows is not None and not slot.transpose:
        return slot.rows
    return 0, shape[0]


def _hub_of(full_rows: torch.Tensor, lo: int, slot: Slot | None) -> torch.Tensor:
    """A Hugging Face tensor from rows ``[lo, ...)`` of our tensor (``full_rows`` holds at least its rows)."""
    if slot is None:
        return full_rows
    t = full_rows
    if slot.expert is not None:
        t = t[slot.expert - lo]
    elif slot.rows is not None:
        t = t[slot.rows[0] - lo : slot.rows[1] - lo]
    return t.T if slot.transpose else t


def save_sharded(
    model: MoETransformer,
    directory: str | Path,
    tokenizer: ChatTokenizer | None = None,
    *,
    dtype: torch.dtype | None = None,
    shard_bytes: int = EXPORT_SHARD_BYTES,
) -> int:
    """Write ``model`` as a model directory (the format of ``save_pretrained``) in ``dtype`` (default: the
    model's), in weight files with a ``model.safetensors.index.json``, without gathering the model on one
    rank where the format allows. With a model sharded by FSDP2 every rank calls this together: each writes
    the tensors that lie whole in its rows (a routed expert, a projection of the fused qkv), in files of at
    most ``shard_bytes``; a tensor split over ranks (the embedding, a norm, a dense projection) is gathered
    one at a time and written by rank 0. No random numbers are drawn, nothing is built. Returns the bytes
    this rank wrote (weights only). ``directory`` must exist and be empty of weights (a fresh temp dir)."""
    from torch.distributed.tensor import DTensor

    d = Path(directory)
    cfg = model.cfg
    params = model.state_dict(keep_vars=True)
    sharded = any(isinstance(p, DTensor) for p in params.values())
    rank, world = (torch.distributed.get_rank(), torch.distributed.get_world_size()) if sharded else (0, 1)
    want_dtype = dtype or next(iter(params.values())).dtype
    # (our name, file name, slot) in a fixed order every rank shares
    items: list[tuple[str, str, Slot | None]]
    head: list[tuple[str, str, Slot | None]] = []
    if cfg.architecture:
        items = [(s.name, name, s) for name, s in hf_slots(cfg).items()]
        head = [(k, k, None) for k in _VALUE_HEAD]  # value_head.safetensors
    else:
        items = [(k, k, None) for k in params if not (k == "lm_head.weight" and cfg.tie_embeddings)]
    by_param: dict[str, list[tuple[str, Slot | None]]] = {}
    for ours, name, s in items + head:
        by_param.setdefault(ours, []).append((name, s))
    buf: dict[str, torch.Tensor] = {}
    head_buf: dict[str, torch.Tensor] = {}
    files: list[tuple[str, list[str], int]] = []  # (file, names, bytes) this rank wrote
    written = 0
    meta = {"format": "pt"} if cfg.architecture else {"format": "pt", "model_type": "t1async_moe"}

    def flush() -> None:
        nonlocal written
        if not buf:
            return
        f = f".part-{rank:05d}-{len(files):05d}.safetensors"
        save_file(buf, str(d / f), metadata=meta)
        n = sum(v.numel() * v.element_size() for v in buf.values())
        files.append((f, sorted(buf), n))
        written += n
        buf.clear()

    size = 0
    with torch.no_grad():
        for ours, pieces in by_param.items():
            p = params[ours]
            shape = tuple(p.shape)
            local, lo = local_rows(p)
            ranges = [_need(shape, s) for _, s in pieces]
            split = any(
                not any(r0 <= a and b <= r1 for r0, r1 in (_rank_range(shape[0], q, world) for q in range(world)))
                for a, b in ranges
            )
            full = p.full_tensor() if split and isinstance(p, DTensor) else None  # every rank joins the gather
            for (name, s), (a, b) in zip(pieces, ranges):
                if full is not None or not sharded:
                    if rank != 0:
                        continue
                    src, base = (full if full is not None else local), 0
                elif lo <= a and b <= lo + local.shape[0]:
                    src, base = local, lo
                else:
                    continue  # another rank holds it whole
                t = _hub_of(src, base, s).to(want_dtype).contiguous().clone()
                if cfg.architecture and name in _VALUE_HEAD:
                    head_buf[name] = t
                    continue
                n = t.numel() * t.element_size()
                if buf and size + n > shard_bytes:
                    flush()
                    size = 0
                buf[name] = t
                size += n
            del full
        flush()
    every: list = [files]
    if sharded:
        every = [None] * world
        torch.distributed.all_gather_object(every, files)
    if rank == 0:
        parts = [f for r in every for f in r]
        weight_map, total = {}, 0
        for i, (f, names, n) in enumerate(parts):
            final = f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors"
            (d / f).rename(d / final)
            weight_map.update(dict.fromkeys(names, final))
            total += n
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (d / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        if head_buf:
            save_file(head_buf, str(d / VALUE_HEAD_FILE), metadata={"format": "pt"})
            written += sum(v.numel() * v.element_size() for v in head_buf.values())
        cfg.save(d / "config.json", torch_dtype=str(want_dtype).removeprefix("torch."))
        (tokenizer or ChatTokenizer.load()).save(d, model_max_length=cfg.max_seq_len)
    if sharded:
        torch.distributed.barrier()  # every file is in place before any rank returns
    return written
