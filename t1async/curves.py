"""Curves where RL users look for them: TensorBoard event files in the run dir, and W&B when asked.

``Curves(logdir)`` writes scalars with ``torch.utils.tensorboard.SummaryWriter`` (the ``tensorboard`` package,
a dependency) under ``logdir``; with ``wandb=True`` and ``wandb`` importable it logs the same scalars to Weights
& Biases too (``WANDB_MODE=offline`` works: the run lands in ``<logdir>/wandb``). The learner writes
``<run-dir>/tensorboard/learner`` (one point per step: reward, resolved rate, loss, |Δlogp|, staleness, drift
counts, throughput), and the in-loop eval of ``cluster up --eval-every N`` writes ``<run-dir>/tensorboard/eval``
(pass@1, mean tests passed, per family) at the policy version it evaluated:

    tensorboard --logdir runs/latest/tensorboard

``read_scalars(logdir)`` reads the event files back (tag -> [(step, value)]), for tests and reports. A
value that is not a finite number is skipped (no NaN points on the curve).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from t1async.log import get_logger

__all__ = ["Curves", "learner_scalars", "read_scalars"]

log = get_logger("t1async.curves")


class Curves:
    def __init__(
        self, logdir: str | Path, *, wandb: bool = False, name: str = "t1async", config: Mapping[str, Any] | None = None
    ) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.logdir = Path(logdir)
        self.logdir.mkdir(parents=True, exist_ok=True)
        self.writer = SummaryWriter(log_dir=str(self.logdir), flush_secs=10)
        self.wandb = None
        if wandb:
            try:
                import wandb as wb
            except ImportError:
                log.warning("tb.wandb_missing", hint="pip install wandb (WANDB_MODE=offline needs no account)")
            else:
                self.wandb = wb.init(
                    project="t1async", name=name, dir=str(self.logdir), config=dict(config or {}), reinit=True
                )
        log.info("tb.open", logdir=str(self.logdir), wandb=self.wandb is not None)

    def scalars(self, step: int, values: Mapping[str, Any]) -> None:
        """One point per tag at ``step``; non-numbers and non-finite values are skipped. Flushed at once, so a
        SIGKILL loses nothing already written."""
        clean = {
            k: float(v)
            for k, v in values.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v))
        }
        for k, v in clean.items():
            self.writer.add_scalar(k, v, global_step=step)
        self.writer.flush()
        if self.wandb is not None and clean:
            self.wandb.log(clean, step=step)

    def close(self) -> None:
        self.writer.close()
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None


def learner_scalars(step: Mapping[str, Any], metrics: Mapping[str, Any]) -> dict[str, float]:
    """The learner's per-step curves from its last step's numbers (``TrainMetrics.to_dict()`` and friends)
    and its metrics record (``Learner.metrics()``)."""
    turns = step.get("turns") or 0
    out: dict[str, Any] = {
        "train/reward_per_turn": step["reward_sum"] / turns if turns and "reward_sum" in step else None,
        "train/loss": step.get("loss"),
        "train/mismatch": step.get("mismatch") if step.get("mismatch_tokens") else None,
        "train/mean_abs_dlogp": step.get("mean_abs_dlogp"),
        "train/policy_shift": step.get("policy_shift"),
        "train/routing_drift": step.get("routing_drift"),
        "train/step_s": step.get("t_step_wall_s"),
        "episodes/reward_mean": metrics.get("reward_mean"),
        "episodes/resolved_rate": metrics.get("resolved_rate"),
        "episodes/ended": metrics.get("episodes_ended"),
        "staleness/max": metrics.get("max_staleness"),
        "staleness/masked_tokens": metrics.get("stale_masked_tokens"),
        "throughput/turns_per_s": metrics.get("turns_per_s"),
        "throughput/tokens_per_s": metrics.get("tokens_per_s"),
    }
    for k, v in (metrics.get("drift") or {}).items():
        out[f"drift/{k}"] = v
    return {k: v for k, v in out.items() if v is not None}


def read_scalars(logdir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in the event files under ``logdir`` (recursively): tag -> [(step, value)] by step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict[str, list[tuple[int, float]]] = {}
    for f in sorted(Path(logdir).rglob("events.out.tfevents.*")):
        acc = EventAccumulator(str(f), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags().get("scalars", []):
            out.setdefault(tag, []).extend((e.step, e.value) for e in acc.Scalars(tag))
    return {k: sorted(v) for k, v in out.items()}
