"""The N-rank learner: the model sharded over the ranks by FSDP2 (``fully_shard``), design §10.

    learner serve --nproc 2 ...      torchrun starts the ranks; rank 0 is the service, ranks 1..N-1 follow it

Every rank holds 1/N of the parameters, gradients and AdamW state (``fully_shard`` over each block, then the
root: embedding, final norm, LM and value heads), and only that: the model is built on the meta device,
sharded, and each rank reads its own rows of the model dir (``build_sharded``). FSDP gathers a block's
weights for its forward and backward and reduce-scatters its gradients, so those collectives run inside every
micro-batch: every rank runs the same number of micro-batch passes. Rank 0 splits the step's segments into N
token-balanced parts (``balance``; under ``--prefix-kv reuse`` ``place``, which keeps an open episode on the rank
that holds its kept keys and values). Each rank plans its own micro-batches (with its kept prefixes, learner.prefixkv:
a segment forwarded after kept keys is a micro-batch of its own, and a cut may first be primed by a forward of
its own), and the ranks agree on the counts (``_agree_primes`` before the first priming forward, ``_pad``
before the first micro-batch: each an all-reduce of the maximum); a rank with fewer runs 2-token priming
forwards and zero-weight micro-batches (a 2-token forward and backward whose loss is multiplied by 0), so any
split works.
Each rank's loss is divided by the step's global loss-token count, so the summed gradient is one rank's.

Rank 0 alone consumes the stream, journals, serves credits and pushes weights (the learner service). Every
read or write of the weights is a collective under FSDP, so rank 0 sends a command and every rank does it
together (``_command``; ranks 1..N-1 wait for the next in ``serve_rank``): ``step`` (with the rank's segments),
``save`` (the model dir written by every rank from its shards, plus with a full checkpoint the sharded state
through torch.distributed.checkpoint), ``export_model`` (the full weights, for the weight push), ``load``,
``load_weights``, ``load_reference`` (--kl-ref-coef's reference, sharded like the policy), ``restore`` (after a
failed step), ``score``, the critic warm-up's ``warmup_step`` (each rank its part, the moments summed) and
``_warmup_refit`` (learner/critic.py), and ``stop``. Besides FSDP's own
collectives the ranks meet three times a step: the advantage moments (advantages whitened over the whole step),
a failure flag before each optimizer step, and a gather of the metric tensors to rank 0; before those, on the
micro-batch count (``_pad``) and with reuse the priming count (``_agree_primes``).

A rank's own error in a step reaches every rank at the next meeting (a flag), so the step fails everywhere
(the service dead-letters it and restores the weights on every rank). An error inside one rank's FSDP
forward/backward is not recoverable that way (the others wait in the collective): it ends that rank, and a
rank that dies is ``RankFailedError``: the learner exits (non-zero) and torchrun stops the other ranks.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections import defaultdict
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from t1async.learner import malloc
from t1async.learner.batch import Batch, SegmentLike, plan_microbatches
from t1async.learner.checkpoint import CheckpointInfo, check_loadable
from t1async.learner.critic import Moments
from t1async.learner.stepmetrics import StepMetrics
from t1async.learner.trainer import Scored, Trainer, state_bytes
from t1async.learner.trainer_config import TrainDtype, TrainerConfig
from t1async.log import get_logger
from t1async.model.moe import MoETransformer
from t1async.model.tokenizer import ChatTokenizer
from t1async.model.weights import load_local
from t1async.protocol.errors import ConfigError, T1Error
from t1async.protocol.sampling import common_prefix_len

log = get_logger("t1async.learner.distributed")

# a block returns its hidden state with views beside it; nothing here writes into them in place
warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")


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


def place(segments: Sequence[SegmentLike], homes: Mapping[str, tuple[int, np.ndarray]], n: int) -> list[list[int]]:
    """Split segment indices into ``n`` parts for ``--prefix-kv reuse``: an episode's segments go together, to
    the rank where they finish first (the least ``load + cost``). At the episode's home (``homes[episode]``:
    the rank that trained its last cut, and the tokens of that cut) the cost is only the positions past those
    that rank forwarded (the rest comes from its kept keys and values); elsewhere, all of them (a move is
    correct, only slower: the new rank re-forwards). Episodes in descending order of their whole length (LPT);
    indices stay in ascending order within a part."""
    groups: dict[str, list[int]] = {}
    for i, s in enumerate(segments):
        groups.setdefault(s.episode, []).append(i)
    whole = {ep: sum(len(segments[i].tokens) for i in idx) for ep, idx in groups.items()}
    parts: list[list[int]] = [[] for _ in range(n)]
    load = [0] * n
    for ep in sorted(groups, key=lambda ep: (-whole[ep], groups[ep][0])):
        cost = [whole[ep]] * n
        if (home := homes.get(ep)) is not None and 0 <= home[0] < n:
            cost[home[0]] = sum(
                len(segments[i].tokens) - common_prefix_len(home[1], segments[i].tokens) for i in groups[ep]
            )
        r = min(range(n), key=lambda r: (load[r] + cost[r], r))
        parts[r].extend(groups[ep])
        load[r] += cost[r]
    return [sorted(p) for p in parts]


def collective(what: str, fn, *args, **kwargs):  # noqa: ANN001, ANN202 - a thin wrapper over dist calls
    """``fn(*args, **kwargs)``, a ``torch.distributed`` call; a failed peer becomes ``RankFailedError``."""
    try:
        return fn(*args, **kwargs)
    except RuntimeError as exc:  # gloo/NCCL: a peer closed its connection, or the group timed out
        raise RankFailedError(f"distributed learner: {what} failed ({exc}); a rank died or hung, see its log") from exc


def mixed_precision(config: TrainerConfig) -> MixedPrecisionPolicy:
    """FSDP2's dtypes: with ``--train-dtype bfloat16`` the gathered weights are bf16 (half the all-gather and
    the unsharded copies) and gradients are reduced in fp32 (the sharded master weights and AdamW stay fp32);
    with float32 everything is fp32."""
    import os

    if config.train_dtype == TrainDtype.BFLOAT16 and not os.environ.get("T1_NO_MP"):
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def shard(model: MoETransformer, config: TrainerConfig | None = None, device_type: str | None = None) -> None:
    """``fully_shard`` each block, then the root (embedding, norm, heads), over all ranks of the default group,
    with ``mixed_precision(config)``. Each block's weights are freed again after its forward
    (``reshard_after_forward``); the root's stay gathered until its backward (or ``reshard()``): the LM head
    and value head run after the model's forward (``MoETransformer.token_logprobs``, the detached critic),
    outside FSDP's hooks. ``device_type``: the mesh's (default: where the parameters are; give it for a model
    on the meta device)."""
    device_type = device_type or next(model.parameters()).device.type
    mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    mp = mixed_precision(config or TrainerConfig())
    units = [fully_shard(blk, mesh=mesh, reshard_after_forward=True, mp_policy=mp) for blk in model.blocks]
    units.append(fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=mp))
    for u in units:  # the gradients are summed, not averaged: each rank's loss has the global normaliser
        u.set_gradient_divide_factor(1.0)
        u.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM


def padding_batch(device: torch.device) -> Batch:
    """A zero-weight micro-batch: two tokens, no loss token, no routing; ``index`` empty (no step rows)."""
    return Batch(
        tokens=torch.zeros(1, 2, dtype=torch.long, device=device),
        lengths=torch.tensor([2], device=device),
        loss_mask=torch.zeros(1, 2, dtype=torch.bool, device=device),
        behav_logp=torch.zeros(1, 2, dtype=torch.float32, device=device),
        versions=torch.full((1, 2), -1, dtype=torch.long, device=device),
        recorded=None,
        index=(),
    )


def build_sharded(model_dir: str | Path, config: TrainerConfig, device: str = "cpu") -> tuple[MoETransformer, int]:
    """Every rank together: the model of ``model_dir`` built on the meta device (nothing allocated, no random
    numbers), sharded (``shard``), allocated by ``to_empty`` (this rank's 1/N only) and filled by reading this
    rank's rows from the safetensors files (``weights.load_local``: its experts, its rows of the rest, the
    value head too). No rank ever holds the full model. Returns the model and the bytes this rank read."""
    from t1async.model.config import MoEConfig

    cfg = MoEConfig.load(model_dir)
    with torch.device("meta"):
        model = MoETransformer(cfg, init=False)
    shard(model, config, device)
    model.to_empty(device=device)
    t0 = time.perf_counter()
    read = load_local(model, model_dir)
    log.info(
        "learner.rank_loaded",
        rank=dist.get_rank(),
        model=str(model_dir),
        bytes_read=read,
        t_s=round(time.perf_counter() - t0, 3),
    )
    return model, read


class DistributedTrainer(Trainer):
    """A Trainer whose model is sharded over the ranks of the default process group. Built on every rank
    together, from a model sharded by ``shard`` (``build_sharded``: each rank reads its own shards); rank 0
    then calls the Trainer API (each call a command every rank joins), ranks 1..N-1 run ``serve_rank``."""

    def __init__(self, model: MoETransformer, config: TrainerConfig | None = None, *, read_bytes: int = 0) -> None:
        if not isinstance(model, FSDPModule):
            raise TypeError("DistributedTrainer takes a model sharded by distributed.shard (build_sharded)")
        super().__init__(model, config or TrainerConfig())
        self.read_bytes = read_bytes  # what this rank read of the model dir it was built from

        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self._part_tokens: list[int] = []
        self._n_micro = 0  # micro-batches every rank runs this step (agreed in ``_pad``)
        self._inside = False  # running a command every rank runs (no command to send)
        self._shell: MoETransformer | None = None  # rank 0: the full weights, last gathered
        self._shell_ok = False  # ... and they are the current weights
        # rank 0, --prefix-kv reuse: open episode -> (the rank that trained its last cut, that cut's tokens)
        self._homes: dict[str, tuple[int, np.ndarray]] = {}

    def set_reference(self, model: MoETransformer) -> None:
        raise TypeError(
            "DistributedTrainer.set_reference: a whole model on one rank is what the N-rank learner never holds; "
            "use load_reference(model_dir), which every rank reads its own shards of"
        )

    def load_reference(self, model_dir: str | Path) -> None:
        """Every rank together: the frozen reference of ``--kl-ref-coef``, built and sharded like the policy
        (``build_sharded``: each rank reads its own rows of ``model_dir``), so no rank holds a whole copy of it
        either. Its forward gathers a block at a time, as the policy's does. The ranks then agree that every
        one built it: a rank without it would leave the others waiting in the first step's gathers."""
        if self.config.kl_ref_coef <= 0:
            raise ConfigError("Trainer.load_reference: kl_ref_coef is 0, so no step would read the reference")
        with self._together("load_reference", str(model_dir)):
            ref: MoETransformer | None = None
            error: Exception | None = None
            try:
                ref, _ = build_sharded(model_dir, self.config, self.device.type)
                self._check_reference(ref, f"the reference model {model_dir}")
            except Exception as exc:  # noqa: BLE001 - every rank must hear of it before any step
                error = exc
            flag = self._on_device(torch.tensor([float(error is not None)]))
            collective("agreeing that every rank built the reference", dist.all_reduce, flag)
            if error is not None:
                raise error
            if float(flag.cpu()[0]):
                raise RankStepError(
                    f"another rank could not build the reference model of {model_dir}: its log says why"
                )
            assert ref is not None
            ref.requires_grad_(False)
            self.ref = ref.train(self.model.training)

    def _ref_logp(self, b: Batch) -> Tensor:
        """The reference's log-probs (every rank, every micro-batch, padding ones too: its forward is FSDP's
        gathers); then its root (embedding, norm, heads) is freed again, which the policy's backward does for
        the policy's but no backward does for the reference's."""
        try:
            return super()._ref_logp(b)
        finally:
            assert isinstance(self.ref, FSDPModule)
            self.ref.reshard()

    @classmethod
    def from_dir(cls, model_dir: str | Path, config: TrainerConfig, device: str = "cpu") -> DistributedTrainer:
        """Every rank together: the trainer of ``model_dir``'s weights, each rank reading its own shards."""
        model, read = build_sharded(model_dir, config, device)
        return cls(model, config, read_bytes=read)

    # ------------------------------------------------------------------------------------- commands

    def _command(self, kind: str, *args: Any, per_rank: Sequence[Any] | None = None, **kwargs: Any) -> Any:
        """Rank 0: tell every rank to run ``kind(*args, **kwargs)`` now (``per_rank``: one argument each).
        Returns rank 0's own arguments."""
        msgs = [(kind, (a,) if per_rank is not None else args, kwargs) for a in (per_rank or [None] * self.world)]
        mine: list[Any] = [None]
        collective(f"sending {kind!r} to the ranks", dist.scatter_object_list, mine, msgs, src=0)
        return mine[0][1]

    @contextlib.contextmanager
    def _together(self, kind: str, *args: Any, **kwargs: Any) -> Iterator[None]:
        """Run the body on every rank: rank 0 (not already in a command) sends the command first."""
        outer = self._inside
        if not outer and self.rank == 0:
            self._command(kind, *args, **kwargs)
        self._inside = True
        try:
            yield
        finally:
            self._inside = outer

    def save(
        self,
        root: str | Path,
        policy_version: int,
        *,
        keep: int = 3,
        tokenizer: ChatTokenizer | None = None,
        full: bool = True,
    ) -> CheckpointInfo:
        """Every rank writes its part (learner.checkpoint.save_checkpoint): nothing is gathered but the tensors
        split over ranks, one at a time."""
        with self._together("save", str(root), policy_version, keep=keep, full=full):
            return super().save(root, policy_version, keep=keep, tokenizer=tokenizer, full=full)

    def export_model(self) -> MoETransformer:
        """Rank 0: a model (on the meta device but for its weights) holding the full weights, gathered from
        the ranks; the same object each call. Ranks 1..N-1 join the gather and get their own (sharded) model."""
        if self.rank == 0 and self._shell_ok and not self._inside:
            assert self._shell is not None
            return self._shell
        with self._together("export_model"):
            full = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            if self.rank != 0:
                return self.model
            if self._shell is None:
                with torch.device("meta"):
                    self._shell = MoETransformer(self.mcfg, init=False)
            self._shell.load_state_dict(full, assign=True)
            self._shell_ok = True
            return self._shell

    def load(self, path: str | Path) -> CheckpointInfo:
        if self.rank == 0 and not self._inside:
            check_loadable(path, sharded=True)  # before the command: a refused checkpoint stops no rank
        with self._together("load", str(path)):
            self._shell_ok = False
            return super().load(path)

    def load_weights(self, model_dir: str | Path) -> None:
        """A model dir's weights: every rank reads its own shards (``weights.load_local``)."""
        with self._together("load_weights", str(model_dir)):
            self._shell_ok = False
            load_local(self.model, model_dir)
            self._forget_prefixes()

    def restore(self, checkpoints: Path, policy_version: int, initial: Path) -> str:
        with self._together("restore", checkpoints, policy_version, initial):
            return super().restore(checkpoints, policy_version, initial)

    def score(
        self, segments: Sequence[SegmentLike], *, replay: bool | None = None
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        """Every rank scores every segment (the same forwards, so FSDP's gathers match); rank 0's result."""
        with self._together("score", list(segments), replay=replay):
            try:
                return super().score(segments, replay=replay)
            finally:
                assert isinstance(self.model, FSDPModule)
                self.model.reshard()

    def rank_memory(self) -> list[dict[str, int]]:
        """Every rank's ``trainer.state_bytes`` and ``read_bytes`` (rank 0 gets the list, in rank order; the
        others [])."""
        with self._together("rank_memory"):
            gathered: list[Any] = [None] * self.world
            mine = {**state_bytes(self), "read_bytes": self.read_bytes}
            collective(
                "gathering the ranks' memory", dist.gather_object, mine, gathered if self.rank == 0 else None, dst=0
            )
            return gathered if self.rank == 0 else []

    def stop_ranks(self) -> None:
        """Tell ranks 1..N-1 to leave ``serve_rank`` (rank 0, at shutdown)."""
        self._command("stop")

    # ------------------------------------------------------------------------------------- the step

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
            microbatches=self._n_micro,
            busy_s=[round(b, 3) for b in self.rank_busy_s],
        )
        return metrics

    def _scatter(self, segments: Sequence[SegmentLike], policy_version: int) -> Sequence[SegmentLike]:
        """Split the step's segments into token-balanced parts and send each rank its part (the ``step``
        command), with the micro-batch count every rank runs. Returns rank 0's part."""
        self._shell_ok = False
        if self.prefix is None:
            parts = balance([len(s.tokens) for s in segments], self.world)
        else:
            parts = place(segments, self._homes, self.world)
            for r, p in enumerate(parts):
                for i in p:  # the latest cut of an episode wins (as Trainer._covered); an ended one is forgotten
                    s = segments[i]
                    if s.done:
                        self._homes.pop(s.episode, None)
                    else:
                        self._homes[s.episode] = (r, np.asarray(s.tokens))
            if len(self._homes) > 100_000:  # episodes abandoned without an end: forget the oldest
                for ep in list(self._homes)[:50_000]:
                    del self._homes[ep]
        self._part_tokens = [sum(len(segments[i].tokens) for i in p) for p in parts]
        msgs = [([segments[i] for i in p], policy_version, self._baseline) for p in parts]
        local, _, _ = self._command("step", per_rank=msgs)[0]
        return local

    def _agree_primes(self) -> None:
        """Before any priming forward: the most any rank runs (each chose its own, from its kept prefixes); a rank
        with fewer runs 2-token forwards without gradient (as ``Trainer._prime``'s), so FSDP's gathers match."""
        n = self._on_device(torch.tensor([self._primes], dtype=torch.int64))
        collective("agreeing on the priming forwards", dist.all_reduce, n, op=dist.ReduceOp.MAX)
        pad = padding_batch(self.device)
        for _ in range(int(n.cpu()[0]) - self._primes):
            with torch.no_grad():
                self.model(pad.tokens, logits=False, checkpoint_blocks=False)

    def _pad(self, batches: list[Batch]) -> list[Batch]:
        """The ranks agree on the step's micro-batch count (each planned its own, with its kept prefixes: a
        segment after kept keys is a micro-batch of its own): the most any rank has. A rank with fewer runs
        zero-weight micro-batches, so every FSDP collective is joined."""
        n = self._on_device(torch.tensor([len(batches)], dtype=torch.int64))
        collective("agreeing on the micro-batch count", dist.all_reduce, n, op=dist.ReduceOp.MAX)
        self._n_micro = int(n.cpu()[0])
        return batches + [padding_batch(self.device)] * (self._n_micro - len(batches))

    def _forget_prefixes(self) -> None:
        super()._forget_prefixes()
        self._homes.clear()  # nothing is kept anywhere now: place by tokens alone

    def _one_pass(self, batches: Sequence[Batch]) -> bool:
        """Every rank must run as many forwards: decided on the micro-batch count they share (``_pad``), not on
        this rank's positions. Not on ``one_pass_tokens`` either: the root's LM head runs outside FSDP's hooks
        and is resharded by the first micro-batch's backward, so a second kept graph could not run its own
        (seen: "setStorage ... storage of size 0")."""
        return len(batches) == 1 and self.config.ppo_epochs == 1

    # ------------------------------------------------------------------------------------- the critic warm-up

    def _warmup_heldout(self, segments: Sequence[SegmentLike]) -> float | None:
        """Rank 0: every rank runs ``warmup_step`` on its token-balanced part of the step's segments."""
        parts = balance([len(s.tokens) for s in segments], self.world)
        mbt = self.config.microbatch_tokens
        counts = [len(plan_microbatches([len(segments[i].tokens) for i in p], mbt)) if p else 0 for p in parts]
        msgs = [([segments[i] for i in p], max(counts)) for p in parts]
        local = self._command("warmup_step", per_rank=msgs)[0]
        self._inside = True
        try:
            return self.warmup_step(local)
        finally:
            self._inside = False

    def warmup_step(self, part: tuple[list[SegmentLike], int]) -> float:
        """Every rank: the warm-up's forwards of this rank's segments (as many forwards as the busiest rank's),
        the moments summed over the ranks, the head's held-out explained variance on all of them."""
        assert self._warmup is not None
        segs, n_micro = part
        return self._warmup.step(segs, self.config, n_micro=n_micro, reduce=self._sum_moments)

    def _warmup_refit(self) -> float | None:
        with self._together("_warmup_refit"):
            self._shell_ok = False  # the head changes on every rank
            return super()._warmup_refit()

    def _sum_moments(self, mom: Moments | None) -> Moments | None:
        """Every rank's warm-up moments summed (float64), with a failure flag: None is a rank whose part raised
        (its own error goes on); the other ranks raise RankStepError."""
        d = int(self.model.value_head.in_features)
        flat = np.append((mom if mom is not None else Moments.zeros(d)).flat(), float(mom is None))
        buf = self._on_device(torch.from_numpy(flat))
        collective("reducing the critic warm-up's moments", dist.all_reduce, buf)
        total = buf.cpu().numpy()
        if mom is None:
            return None
        if total[-1] > 0:
            raise RankStepError(
                f"{int(total[-1])} other rank(s) of {self.world} failed the critic warm-up; see their log"
            )
        return Moments.of_flat(total[:-1], d)

    # ------------------------------------------------------------------------------------- ranks 1..N-1

    def serve_rank(self) -> None:
        """Run every command rank 0 sends until it says stop (ranks 1..N-1)."""
        while True:
            mine: list[Any] = [None]
            collective("waiting for rank 0's next command", dist.scatter_object_list, mine, None, src=0)
            kind, args, kwargs = mine[0]
            if kind == "stop":
                log.info("learner.rank_stopped", rank=self.rank, steps=self.steps)
                return
            self._inside = True
            try:
                if kind == "step":
                    local, policy_version, self._baseline = args[0]
                    self._shell_ok = False
                    self._train(local, policy_version, None, all_segments=local, t0=time.perf_counter())
                else:
                    getattr(self, kind)(*args, **kwargs)
            except RankFailedError:
                raise
            except Exception as exc:  # noqa: BLE001 - rank 0 fails it too, and restores every rank
                log.warning(
                    "learner.rank_command_failed", rank=self.rank, command=kind, error=f"{type(exc).__name__}: {exc}"
                )
            finally:
                self._inside = False
            malloc.trim()  # a flat RSS between steps, as on rank 0

    # ------------------------------------------------------------------------------------- meetings

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
        buf = self._on_device(buf)
        collective("reducing the advantage moments", dist.all_reduce, buf)
        buf = buf.cpu()
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
        except RuntimeError as exc:  # inside FSDP's collectives: a peer is gone
            raise RankFailedError(
                f"distributed learner: the step's update failed ({exc}); see every rank's log"
            ) from exc
        except Exception as exc:
            self._failed = exc
            self._reduce_grads()  # the meeting the other ranks are in: it fails the step on all of them
            raise

    def _reduce_grads(self) -> None:
        """The failure flag, before each optimizer step (FSDP's reduce-scatter already summed the gradients)."""
        flag = self._on_device(torch.tensor([float(self._failed is not None)]))
        t_wait = time.perf_counter()
        collective("meeting before the optimizer step", dist.all_reduce, flag)
        self._t_wait += time.perf_counter() - t_wait
        self._raise_if_failed(float(flag.cpu()[0]))

    def _raise_if_failed(self, failed: float) -> None:
        if self._failed is not None:
            raise self._failed
        if failed > 0:
            raise RankStepError(f"{int(failed)} other rank(s) of {self.world} failed this step; see their log")

    def _on_device(self, t: Tensor) -> Tensor:
        return t.to(self.device) if dist.get_backend() == "nccl" else t
