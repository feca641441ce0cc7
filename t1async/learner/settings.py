"""``learner sft``'s settings (light to import): the command line reads them, and ``cluster up`` writes them
as ``<run-dir>/config/warm-start.toml`` for the warm start it runs."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from t1async.config import setting
from t1async.learner.options import Device, TrainDtype


@dataclass(frozen=True)
class SftSettings:
    """``learner sft``'s settings: ``--config FILE.toml`` and/or flags (flags win)."""

    tasks: Path | None = setting(
        None, "a directory of task directories (Terminal-Bench 1 or 2 format); or --synth", metavar="DIR"
    )
    synth: int | None = setting(None, "generate this many synthetic tasks (sandbox_agent.synth); or --tasks", ge=1)
    steps: int = setting(200, "optimizer steps", ge=1)
    out: Path | None = setting(None, "output model directory, loadable by the sampler (required)", metavar="DIR")
    model: Path | None = setting(None, "starting model directory (default: the shipped embedded model)")
    lr: float = setting(1e-3, "peak learning rate", gt=0)
    batch_tokens: int = setting(8192, "padded tokens per step", ge=2)
    max_len: int = setting(4096, "truncate demonstrations to this many tokens", ge=2)
    concurrency: int = setting(2, "oracle runs in parallel", ge=1)
    threads: int = setting(2, "torch CPU threads", ge=1)
    seed: int = setting(0, "seed for the synthetic tasks (--synth) and the batch order")
    json: bool = setting(False, "print the summary as JSON on the last stdout line")
    device: Device = setting(Device.CPU, "where to train: cpu, or cuda (untested, no GPU ran in our tests)")
    train_dtype: TrainDtype = setting(
        TrainDtype.FLOAT32, "float32, or bfloat16: bf16 autocast over fp32 master weights (as the learner's)"
    )
