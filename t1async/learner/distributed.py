"""The N-rank learner: data parallel over torch.distributed (gloo on CPU, NCCL on GPU), design §10.

    learner serve --nproc 2 ...      rank 0 is the service process; it starts ranks 1..N-1 itself

Rank 0 alone consumes the stream, journals, serves credits, assembles, checkpoints and pushes weights (the
learner service, unchanged). Each step it splits the step's segments into N token-balanced parts
(``balance``), scatters them (``scatter_object_list``), and every rank trains its part with the one
``Trainer.step`` (rank 0) or its body ``Trainer._train`` (ranks 1..N-1): the scoring forward, its
micro-batches' backward. ``DistributedTrainer`` only supplies the meetings, Trainer's hooks (no-ops on one
rank). The ranks meet three times a step: the advantage moments (so advantages are whitened over the whole
step's loss tokens), one gradient all-reduce per PPO epoch (sum: every rank's loss is already divided by the
step's global loss-token count), and a gather of the metric tensors to rank 0. Every rank then clips the
same summed gradient and takes the same AdamW step, so the weights stay identical everywhere (the DDP
algorithm; replicated weights, so a checkpoint is rank 0's, loadable at any N).

Why not torch's DDP wrapper or FSDP2 ``fully_shard`` (which does run on CPU + gloo in torch 2.13): both
issue collectives inside every forward/backward, so every rank must run the same number of micro-batch
passes in the same order, and FSDP2 makes every weight read (checkpoint, weight push, ``Trainer.score``,
restoring after a failed step) a collective the other ranks must join. Here ranks get different numbers of
micro-batches (balanced by tokens, not count) and only the step touches the other ranks.

A rank's own error in a step reaches every rank at the next meeting (a flag in the collective), so the step
fails everywhere (the service dead-letters it) and rank 0 re-sends its weights and optimizer state with the
next step. A rank that dies is ``RankFailedError``: the learner exits (non-zero) and the other ranks with it.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from t1async.learner import memory
from t1async.learner.batch import SegmentLike
from t1async.learner.checkpoint import optimizer_tensors, set_optimizer_state
from t1async.learner.stepmetrics import StepMetrics
from t1async.learner.trainer import Scored, Trainer
from t1async.learner.trainer_config import TrainerConfig
from t1async.log import get_logger
from t1async.model.moe import MoETransformer
from t1async.protocol.errors import T1Error

log = get_logger("t1async.learner.distributed")


class RankFailedError(T1Error):
    """A rank of the distributed learner died or its group broke: the learner cannot go on."""


class RankStepError(T1Error):
    """Another rank's part of this step raised (its log says what): the step failed on every rank."""


def balance(lengths: Sequence[int], n: int) -> list[list[int]]:
    """Split segment indices into ``n`` parts of near-equal token counts: longest first, each to the part
    with the fewest tokens so far (LPT). Indices stay in ascending order within a part."""
    parts: list[list[int]] = [[] for _ in range(n)]
    load = [0] * n
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = min(range(n), key=lambda r: (load[r], r))
        parts[r].append(i)
        load[r] += lengths[i]
    return [sorted(p) for p in parts]


def collective(what: str, fn, *args, **kwargs):  # noqa: ANN001, ANN202 - a thin wrapper over dist calls
    """``fn(*args, **kwargs)``, a ``torch.distributed`` call; a failed peer becomes ``RankFailedError``."""
    try:
        return fn(*args, **kwargs)
    except RuntimeError as exc:  # gloo/NCCL: a peer closed its connection, or the group timed out
        raise RankFailedError(f"distributed learner: {what} failed ({exc}); a rank died or hung, see its log") from exc


class DistributedTrainer(Trainer):
    """A Trainer whose ranks meet over the default process group: ``Trainer.step`` (on rank 0) trains over
    all of them, the other ranks run ``serve_rank``. Needs ``dist.init_process_group`` done on every rank.
    Only the meetings are its own (``_scatter``, ``_adv_moments``, ``_reduce_grads``, ``_gather``)."""

    def __init__(self, model: MoETransformer, config: TrainerConfig | None = None) -> None:
        super().__init__(model, config or TrainerConfig())
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self._resync = True  # send rank 0's weights and optimizer state with the next step
        self._part_tokens: list[int] = []  # rank 0: each rank's tokens in the last step (balance)

    # ------------------------------------------------------------------------------------------- rank 0

    def step(
        self, segments: Sequence[SegmentLike], policy_version: int, *, drift: Mapping[str, int] | None = None
    ) -> StepMetrics:
        metrics = super().step(segments, policy_version, drift=drift)
        log.info(
            "learner.dist_step",
            step=metrics.step,
            ranks=self.world,
            t_step_s=round(metrics.t_step_s, 3),
            tokens=self._part_tokens,
            busy_s=[round(b, 3) for b in self.rank_busy_s],
        )
        return metrics

    def _scatter(self, segments: Sequence[SegmentLike], policy_version: int) -> Sequence[SegmentLike]:
        """Split the step's segments into token-balanced parts, one per rank, and send each rank its part
        (with rank 0's weights and optimizer state when they need re-sending). Returns rank 0's part."""
        parts = balance([len(s.tokens) for s in segments], self.world)
        self._part_tokens = [sum(len(segments[i].tokens) for i in p) for p in parts]
        msgs = [("step", [segments[i] for i in p], policy_version, self._resync, self._baseline) for p in parts]
        mine: list[Any] = [None]
        collective("scattering the step's segments", dist.scatter_object_list, mine, msgs, src=0)
        if self._resync:
            self._sync_state()
            self._resync = False
        return mine[0][1]

    def _step_raised(self, exc: Exception) -> None:
        if not isinstance(exc, RankFailedError):
            self._resync = True  # the service restores rank 0's weights; the next step re-sends them

    def stop_ranks(self) -> None:
        """Tell ranks 1..N-1 to exit their loop (rank 0, at shutdown)."""
        stop: list[Any] = [("stop", [], 0, False, {})] * self.world
        collective("stopping the ranks", dist.scatter_object_list, [None], stop, src=0)

    # ------------------------------------------------------------------------------------- ranks 1..N-1

    def serve_rank(self) -> None:
        """Train every step rank 0 scatters until it says stop (ranks 1..N-1)."""
        while True:
            mine: list[Any] = [None]
            collective("waiting for rank 0's next step", dist.scatter_object_list, mine, None, src=0)
            kind, local, policy_version, resync, self._baseline = mine[0]
            if kind == "stop":
                log.info("learner.rank_stopped", rank=self.rank, steps=self.steps)
                return
            if resync:
                self._sync_state()
            try:
                self._train(local, policy_version, None, all_segments=local, t0=time.perf_counter())
            except RankFailedError:
                raise
            except Exception as exc:  # noqa: BLE001 - rank 0 fails the step too; it re-sends its weights next
                log.warning(
                    "learner.rank_step_failed",
                    rank=self.rank,
                    policy_version=policy_version,
                    error=f"{type(exc).__name__}: {exc}",
                )
            memory.trim()  # a flat RSS between steps, as on rank 0

    # ------------------------------------------------------------------------------------- every rank

    def _sync_state(self) -> None:
        """Rank 0's weights, optimizer state and step count to every rank."""
        with torch.no_grad():
            for t in self.model.state_dict().values():
                collective("syncing the weights", dist.broadcast, t, src=0)
        box: list[Any] = [None]
        if self.rank == 0:
            groups = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
            box = [(optimizer_tensors(self.model, self.optimizer), groups, self.steps)]
        collective("syncing the optimizer", dist.broadcast_object_list, box, src=0)
        if self.rank != 0:
            tensors, groups, self.steps = box[0]
            set_optimizer_state(self.model, self.optimizer, tensors, groups, source="rank 0")

    def _gather(self, part: tuple[Any, ...]) -> list[tuple[Any, ...]] | None:
        gathered: list[Any] = [None] * self.world
        dst_list = gathered if self.rank == 0 else None
        collective("gathering the step's metrics", dist.gather_object, part, dst_list, dst=0)
        return gathered if self.rank == 0 else None

    def _adv_moments(self, adv_all: Tensor) -> tuple[int, float, float]:
        """Count, mean and std over every rank's loss tokens (float64 sums); also where a rank's scoring
        error reaches the others."""
        a = adv_all.detach().double().cpu()
        buf = torch.tensor(
            [a.numel(), float(a.sum()), float((a * a).sum()), float(self._failed is not None)], dtype=torch.float64
        )
        collective("reducing the advantage moments", dist.all_reduce, self._on_device(buf))
        self._raise_if_failed(float(buf[3]))
        n = int(buf[0])
        if n == 0:
            return 0, 0.0, 0.0
        mean = float(buf[1]) / n
        return n, mean, max(float(buf[2]) / n - mean * mean, 0.0) ** 0.5 if n > 1 else 0.0

    def _update(self, scored: list[Scored], n_loss: int) -> tuple[defaultdict[str, float], float, float, float]:
        try:
            return super()._update(scored, n_loss)
        except (RankFailedError, RankStepError):
            raise
        except Exception as exc:
            self._failed = exc
            self._reduce_grads()  # the meeting the other ranks are in: it fails the step on all of them
            raise

    def _reduce_grads(self) -> None:
        """Sum every parameter's gradient over the ranks in one all-reduce. A parameter no rank has a
        gradient for (an expert no token was routed to) keeps None, as it would on one rank."""
        params = list(self.model.parameters())
        flags = torch.tensor([float(self._failed is not None)] + [float(p.grad is not None) for p in params])
        grads = [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params]
        buf = torch.cat([self._on_device(flags).to(grads[0].dtype), *grads])
        t_wait = time.perf_counter()
        collective("reducing the gradients", dist.all_reduce, buf)
        self._t_wait += time.perf_counter() - t_wait
        self._raise_if_failed(float(buf[0]))
        off = len(params) + 1
        for i, p in enumerate(params):
            n = p.numel()
            p.grad = buf[off : off + n].view_as(p).clone() if float(buf[1 + i]) > 0 else None
            off += n

    def _raise_if_failed(self, failed: float) -> None:
        if self._failed is not None:
            raise self._failed
        if failed > 0:
            raise RankStepError(f"{int(failed)} other rank(s) of {self.world} failed this step; see their log")

    def _on_device(self, t: Tensor) -> Tensor:
        return t.to(self.device) if dist.get_backend() == "nccl" else t


def init_group(rank: int, world: int, host: str, port: int, *, backend: str, timeout_s: float) -> None:
    """Join the learner's process group (rank 0 hosts the TCPStore on ``host:port``)."""
    store = dist.TCPStore(host, port, world, is_master=rank == 0, timeout=timedelta(seconds=timeout_s))
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))
