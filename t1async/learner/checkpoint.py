"""Checkpoints: a model directory the samplers load, plus the trainer state to resume from.

    root/
      v000003/                     one checkpoint per published policy version
        model.safetensors          \\
        config.json                 } a model directory: POST /update_weights_from_disk {model_path: this dir}
        tokenizer.json, ...        /
        trainer_state.safetensors  AdamW moments, keyed "<param name>.exp_avg" / ".exp_avg_sq" / ".step"
        trainer_state.json         {policy_version, step, optimizer hyper-parameters, format}

Everything is safetensors or JSON (no pickle). A checkpoint is written into a temporary directory in
``root`` and renamed into place, so a sampler or a resuming learner never sees a half-written one.
``keep`` bounds how many old checkpoints stay on disk.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load_file, save_file

from t1async.log import get_logger
from t1async.model.tokenizer import ChatTokenizer
from t1async.model.weights import load_weights_into, save_pretrained
from t1async.protocol.errors import ConfigError

if TYPE_CHECKING:
    from t1async.model.moe import MoETransformer

log = get_logger("t1async.learner.checkpoint")

STATE_TENSORS = "trainer_state.safetensors"
STATE_JSON = "trainer_state.json"
FORMAT = "t1async-trainer-state-v1"
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


def optimizer_tensors(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    names = {id(p): n for n, p in model.named_parameters()}
    out: dict[str, torch.Tensor] = {}
    for group in opt.param_groups:
        for p in group["params"]:
            st = opt.state.get(p)
            if not st:
                continue
            for k, v in st.items():
                t = v if isinstance(v, torch.Tensor) else torch.tensor(float(v))
                out[f"{names[id(p)]}.{k}"] = t.detach().contiguous().cpu()
    return out


def set_optimizer_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    tensors: dict[str, torch.Tensor],
    param_groups: list[dict],
    *,
    source: str,
) -> None:
    """Put the state ``optimizer_tensors`` wrote (``"<param>.<field>"`` tensors) and the param groups'
    hyper-parameters into ``optimizer``. Also how the distributed learner's rank 0 syncs the other ranks."""
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


def save_checkpoint(
    root: str | Path,
    model: MoETransformer,
    optimizer: torch.optim.Optimizer | None,
    *,
    policy_version: int,
    step: int,
    tokenizer: ChatTokenizer | None = None,
    keep: int = 3,
) -> CheckpointInfo:
    """Write checkpoint ``v<version>`` atomically; drop all but the newest ``keep`` (0 = keep all)."""
    r = Path(root)
    r.mkdir(parents=True, exist_ok=True)
    dest = checkpoint_dir(r, policy_version)
    if dest.exists():
        raise ConfigError(
            f"checkpoint {dest} already exists; versions are published once (pick version > {policy_version})"
        )
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-v{policy_version:06d}-", dir=r))
    try:
        save_pretrained(model, tmp, tokenizer)
        meta: dict = {"format": FORMAT, "policy_version": policy_version, "step": step, "param_groups": []}
        if optimizer is not None:
            save_file(optimizer_tensors(model, optimizer), str(tmp / STATE_TENSORS))
            meta["param_groups"] = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        (tmp / STATE_JSON).write_text(json.dumps(meta, indent=2, default=list) + "\n")
        tmp.rename(dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if keep > 0:
        for old in list_checkpoints(r)[:-keep]:
            shutil.rmtree(old.path, ignore_errors=True)
    log.info("checkpoint.saved", path=str(dest), policy_version=policy_version, step=step)
    return CheckpointInfo(dest, policy_version, step)


def load_checkpoint(
    path: str | Path, model: MoETransformer, optimizer: torch.optim.Optimizer | None = None
) -> CheckpointInfo:
    """Load weights (in place, keeping the model's dtype) and, if given, the optimizer state."""
    d = Path(path)
    if not (d / STATE_JSON).is_file():
        raise ConfigError(f"{d} is not a trainer checkpoint: it lacks {STATE_JSON} (a bare model dir has no state)")
    meta = json.loads((d / STATE_JSON).read_text())
    if meta.get("format") != FORMAT:
        raise ConfigError(f"{d / STATE_JSON}: format {meta.get('format')!r}, this loader reads {FORMAT!r}")
    load_weights_into(model, d)
    if optimizer is not None and (d / STATE_TENSORS).is_file():
        set_optimizer_state(
            model,
            optimizer,
            load_file(str(d / STATE_TENSORS)),
            meta.get("param_groups", []),
            source=str(d / STATE_TENSORS),
        )
    info = CheckpointInfo(d, int(meta["policy_version"]), int(meta["step"]))
    log.info("checkpoint.loaded", path=str(d), policy_version=info.policy_version, step=info.step)
    return info
