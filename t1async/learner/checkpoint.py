"""Checkpoints: a model directory the samplers load, plus the trainer state to resume from.

    root/
      v000003/                     one checkpoint per published policy version
        model-0000i-of-0000n.safetensors  \\
        model.safetensors.index.json       \\
        config.json, value_head.safetensors } a model dir: POST /update_weights_from_disk {model_path: this dir}
        tokenizer.json, ...                /
        dcp/                       torch.distributed.checkpoint: model + AdamW state, a shard file per rank
        trainer_state.json         {policy_version, step, optimizer saved?, ranks, format}
      v000004/                     a push-only export (``full=False``): the model dir alone, no resume reads it

The model dir holds the full weights in the training dtype, in files each rank writes from the tensors it
holds whole (``weights.save_sharded``: experts never leave their rank; a tensor split over ranks is gathered
alone, to rank 0); ``dcp/`` holds the sharded model and optimizer state (fp32), which DCP reshards on load,
so a checkpoint written by N ranks resumes on M. The learner writes a checkpoint every ``--checkpoint-every``
steps and a push-only export at the others (learner/service.py). Each is written into a temporary directory
in ``root`` and renamed into place, so a sampler or a resuming learner never sees a half-written one.
``keep`` bounds how many old checkpoints, and how many old exports, stay on disk.
The older single-file format (``trainer_state.safetensors``, FORMAT_V1) still loads on one rank.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FSDPModule

from t1async.log import get_logger
from t1async.model.tokenizer import ChatTokenizer
from t1async.model.weights import load_weights_into, save_sharded
from t1async.protocol.errors import ConfigError

if TYPE_CHECKING:
    from t1async.model.moe import MoETransformer

log = get_logger("t1async.learner.checkpoint")

# one rank (no process group) saves and loads as a single process: what DCP warns it assumes
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")

STATE_TENSORS = "trainer_state.safetensors"
STATE_JSON = "trainer_state.json"
FORMAT = "t1async-trainer-state-v2"  # model + optimizer through torch.distributed.checkpoint
FORMAT_V1 = "t1async-trainer-state-v1"  # optimizer moments in trainer_state.safetensors, one rank
DCP_DIR = "dcp"
_NAME = re.compile(r"^v(\d{6,})$")


@dataclass(frozen=True)
class CheckpointInfo:
    path: Path  # the model directory
    policy_version: int
    step: int


def checkpoint_dir(root: str | Path, policy_version: int) -> Path:
    return Path(root) / f"v{policy_version:06d}"


def list_checkpoints(root: str | Path) -> list[CheckpointInfo]:
    """Complete checkpoints under ``root``, oldest first."""
    r = Path(root)
    if not r.is_dir():
        return []
    out = []
    for p in r.iterdir():
        m = _NAME.match(p.name)
        if m and (p / STATE_JSON).is_file():
            meta = json.loads((p / STATE_JSON).read_text())
            out.append(CheckpointInfo(p, int(m.group(1)), int(meta.get("step", 0))))
    return sorted(out, key=lambda c: c.policy_version)


def latest_checkpoint(root: str | Path) -> CheckpointInfo | None:
    cps = list_checkpoints(root)
    return cps[-1] if cps else None


def set_optimizer_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    tensors: dict[str, torch.Tensor],
    param_groups: list[dict],
    *,
    source: str,
) -> None:
    """Put the state of a single-file checkpoint (``"<param>.<field>"`` tensors) and the param groups'
    hyper-parameters into ``optimizer``."""
    params = dict(model.named_parameters())
    by_param: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        pname, _, field = key.rpartition(".")
        if pname not in params:
            raise ConfigError(f"{source}: state for unknown parameter {pname!r}")
        by_param.setdefault(pname, {})[field] = t
    optimizer.state.clear()
    for pname, st in by_param.items():
        p = params[pname]
        optimizer.state[p] = {k: (v.to(p.device) if k != "step" else v.clone()) for k, v in st.items()}
    for g, saved in zip(optimizer.param_groups, param_groups):
        for k, v in saved.items():
            g[k] = tuple(v) if isinstance(g.get(k), tuple) else v


def _sharded(model: torch.nn.Module) -> bool:
    """Is ``model`` sharded over the ranks by FSDP2 (then every call below is a collective all ranks make)?"""
    return isinstance(model, FSDPModule)


def _is_export(p: Path) -> bool:
    """A push-only export (a model dir named like a checkpoint, without trainer state)."""
    return _NAME.match(p.name) is not None and p.is_dir() and not (p / STATE_JSON).is_file()


def list_exports(root: str | Path) -> list[Path]:
    """The push-only exports under ``root`` (model dirs without trainer state), oldest first."""
    r = Path(root)
    if not r.is_dir():
        return []
    return sorted((p for p in r.iterdir() if _is_export(p)), key=lambda p: p.name)


def save_checkpoint(
    root: str | Path,
    model: MoETransformer,
    optimizer: torch.optim.Optimizer | None,
    *,
    policy_version: int,
    step: int,
    tokenizer: ChatTokenizer | None = None,
    keep: int = 3,
    full: bool = True,
    dtype: torch.dtype | None = None,
) -> CheckpointInfo:
    """Write ``v<version>`` atomically; drop all but the newest ``keep`` of each kind (0 = keep all).

    Always the model dir the samplers read (``weights.save_sharded``: sharded safetensors with an index, in
    ``dtype``, default the model's; with an FSDP-sharded model each rank writes the tensors it holds whole).
    With ``full`` (a checkpoint) also the model and optimizer state through ``torch.distributed.checkpoint``
    (``dcp/``, a shard file per rank, loadable at any number of ranks) and ``trainer_state.json``; without it a
    push-only export, which no resume reads (``list_checkpoints`` skips it). An export of a version at or past
    this one (left by a run that crashed before its next checkpoint) is replaced. With an FSDP-sharded
    ``model`` every rank calls this together."""
    r = Path(root)
    sharded = _sharded(model)
    rank = dist.get_rank() if sharded else 0
    dest = checkpoint_dir(r, policy_version)
    box: list = [None]
    if rank == 0:
        r.mkdir(parents=True, exist_ok=True)
        if (dest / STATE_JSON).is_file():
            box = [
                ConfigError(
                    f"checkpoint {dest} already exists; versions are published once (pick version > {policy_version})"
                )
            ]
        else:
            box = [Path(tempfile.mkdtemp(prefix=f".tmp-v{policy_version:06d}-", dir=r))]
    if sharded:
        dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], Exception):
        raise box[0]
    tmp: Path = box[0]
    t0 = time.perf_counter()
    try:
        written = save_sharded(model, tmp, tokenizer, dtype=dtype)
        state: dict = {}
        if full:
            state["model"] = get_model_state_dict(model)
            if optimizer is not None and optimizer.state:  # an optimizer that never stepped has nothing to save
                state["optim"] = get_optimizer_state_dict(model, optimizer)
            dcp.save(state, checkpoint_id=str(tmp / DCP_DIR), no_dist=not sharded)
        if rank == 0:
            if full:
                meta: dict = {
                    "format": FORMAT,
                    "policy_version": policy_version,
                    "step": step,
                    "optimizer": "optim" in state,
                    "ranks": dist.get_world_size() if sharded else 1,
                }
                (tmp / STATE_JSON).write_text(json.dumps(meta, indent=2, default=list) + "\n")
            for stale in [p for p in list_exports(r) if int(p.name[1:]) >= policy_version]:
                shutil.rmtree(stale, ignore_errors=True)  # a lost future's export: this version replaces it
            tmp.rename(dest)
    finally:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
    if rank == 0 and keep > 0:
        for old in list_checkpoints(r)[:-keep]:
            shutil.rmtree(old.path, ignore_errors=True)
        for old_export in list_exports(r)[:-keep]:
            shutil.rmtree(old_export, ignore_errors=True)
    if rank == 0:
        log.info(
            "checkpoint.saved" if full else "checkpoint.exported",
            path=str(dest),
            policy_version=policy_version,
            step=step,
            weight_bytes_rank0=written,
            t_s=round(time.perf_counter() - t0, 3),
        )
    return CheckpointInfo(dest, policy_version, step)


def weight_diff(a: str | Path, b: str | Path, tol: float = 0.0) -> dict[str, float | int]:
    """How far the weights of model dir ``b`` are from ``a``'s (both as ``save_sharded`` writes them), read one
    tensor at a time: ``max_abs_dw``, ``differ`` (elements not bit-equal) and ``beyond`` (elements off by more
    than ``tol`` plus one rounding step of their dtype at their size). A tensor one dir lacks, or of another
    shape, counts whole as beyond (``max_abs_dw`` inf)."""

    def where(d: Path) -> dict[str, Path]:
        out: dict[str, Path] = {}
        for f in sorted(d.glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as h:
                out.update(dict.fromkeys(h.keys(), f))
        return out

    in_a, in_b = where(Path(a)), where(Path(b))
    worst, differ, beyond = 0.0, 0, 0
    for name in sorted(in_a.keys() | in_b.keys()):
        if name not in in_a or name not in in_b:
            worst, beyond = float("inf"), beyond + 1
            continue
        with safe_open(str(in_a[name]), framework="pt") as ha, safe_open(str(in_b[name]), framework="pt") as hb:
            ta, tb = ha.get_tensor(name), hb.get_tensor(name)
        if ta.shape != tb.shape:
            worst, beyond = float("inf"), beyond + ta.numel()
            continue
        d = (ta.double() - tb.double()).abs()
        if d.numel():
            worst = max(worst, float(d.max()))
        differ += int((ta != tb).sum())
        eps = torch.finfo(ta.dtype).eps if ta.is_floating_point() else 0.0
        beyond += int((d > tol + eps * ta.double().abs()).sum())
    return {"max_abs_dw": worst, "differ": differ, "beyond": beyond}


def check_loadable(path: str | Path, *, sharded: bool) -> dict:
    """The checkpoint's trainer_state.json, or ConfigError (one line) if it cannot be loaded as asked."""
    d = Path(path)
    if not (d / STATE_JSON).is_file():
        raise ConfigError(f"{d} is not a trainer checkpoint: it lacks {STATE_JSON} (a bare model dir has no state)")
    meta = json.loads((d / STATE_JSON).read_text())
    if meta.get("format") == FORMAT_V1 and sharded:
        raise ConfigError(
            f"{d} is an old single-file checkpoint: resume it once with --nproc 1 (which rewrites it in the "
            "sharded format), then with more ranks"
        )
    if meta.get("format") not in (FORMAT, FORMAT_V1):
        raise ConfigError(f"{d / STATE_JSON}: format {meta.get('format')!r}, this loader reads {FORMAT!r}")
    return meta


def load_checkpoint(
    path: str | Path, model: MoETransformer, optimizer: torch.optim.Optimizer | None = None
) -> CheckpointInfo:
    """Load weights (in place, keeping the model's dtype) and, if given, the optimizer state, whatever the
    number of ranks that wrote it. With an FSDP-sharded ``model`` every rank calls this together."""
    d = Path(path)
    sharded = _sharded(model)
    meta = check_loadable(d, sharded=sharded)
    if meta.get("format") == FORMAT_V1:
        _load_v1(d, meta, model, optimizer)
    else:
        state: dict = {"model": get_model_state_dict(model)}
        with_optim = optimizer is not None and bool(meta.get("optimizer"))
        if with_optim:
            assert optimizer is not None
            state["optim"] = get_optimizer_state_dict(model, optimizer)
        dcp.load(state, checkpoint_id=str(d / DCP_DIR), no_dist=not sharded)
        set_model_state_dict(model, state["model"])
        if with_optim:
            assert optimizer is not None
            set_optimizer_state_dict(model, optimizer, state["optim"])
        elif optimizer is not None:
            optimizer.state.clear()
    info = CheckpointInfo(d, int(meta["policy_version"]), int(meta["step"]))
    if not sharded or dist.get_rank() == 0:
        log.info("checkpoint.loaded", path=str(d), policy_version=info.policy_version, step=info.step)
    return info


def _load_v1(d: Path, meta: dict, model: MoETransformer, optimizer: torch.optim.Optimizer | None) -> None:
    """A checkpoint of the single-file format (``trainer_state.safetensors``), one rank."""
    load_weights_into(model, d)
    if optimizer is not None and (d / STATE_TENSORS).is_file():
        set_optimizer_state(
            model,
            optimizer,
            load_file(str(d / STATE_TENSORS)),
            meta.get("param_groups", []),
            source=str(d / STATE_TENSORS),
        )
