"""Peak memory per rank of one training step, planned on fake tensors: no weights, no GPU, a few minutes.

    python -m bench.memory_plan --config bench/configs/qwen3-30b-a3b.json --world 8 --tokens 32768 [--json]

It builds the learner's model (``MoETransformer``) from a Hugging Face ``config.json`` under
``torch._subclasses.FakeTensorMode`` (tensors with shapes and dtypes but no storage), shards it as
``learner.distributed.shard`` does (``fully_shard`` per block, then the root) over a fake process group of
``--world`` ranks (``torch.testing._internal.distributed.fake_pg``: collectives that move nothing), and runs
one training step of one rank under FSDP2's memory tracker (``FSDPMemTracker``): the trainer's own forward
(``Trainer._forward``: autocast, ``checkpoint_blocks``, the chunked log-prob head, the value head), the PPO +
value loss (``ppo.ppo_loss``), its backward, gradient clipping and the AdamW step as ``Trainer`` builds it.
The step traced is one after the first: AdamW's two moments exist before it starts (AdamW makes them in its
first step), so they are held through the forward and backward; ``--first-step`` traces the first step instead,
whose peak is lower by about the moments' size. The tracker sees every tensor the step allocates and frees
on that rank, so its peak is the step's peak tensor memory, broken down into sharded and gathered
parameters, gradients, optimizer state, activations, backward temporaries and collective buffers.

Checked on real tensors (docs/results.md, tests/test_memory_plan.py): the same step run on CPU at world 1
(gloo) under the same tracker gives the plan's bytes phase by phase, and its rise in VmHWM is within a few
per cent of the plan's rise over the held state.

What it leaves out, and what it assumes:

- the CUDA context, NCCL's buffers and the caching allocator's fragmentation (a few GB on a real GPU: keep
  that much under ``--budget-gb``); the scoring forward of a step with several micro-batches (no gradient, so
  below the training pass's peak); ``--prefix-kv`` keys and values kept between steps;
- tensors hold no values, so the routing is assumed balanced (``torch.bincount`` of the chosen experts gives
  every expert the same share of the tokens; the memory of the expert MLPs depends on the total, not on
  the split) and the gradient norm is never read (the clip is applied, its value is not looked at);
- the trace runs on this machine's CPU with a fake ``cpu`` device: attention is the fused CPU kernel, which
  like CUDA's flash kernel keeps no [T, T] score matrix; CUDA's 512-byte allocation rounding is left out.
  AdamW is the implementation ``Trainer`` builds (fused, on CUDA as on CPU); ``--optimizer`` picks another.
- ``--budget-gb`` defaults to 75: an 80 GB H100 shows 79.6 GiB to CUDA, and the rest is left for the context,
  NCCL and the caching allocator's fragmentation.

``--tokens`` is what one rank trains in the step, as micro-batches of ``--microbatch-tokens`` (one sequence
each; default: all of ``--tokens`` in one). Two micro-batches are traced when there are several: the
second runs with the first one's gradients held, and every later one is the same. ``--layers N`` traces
N of the config's layers (and N + 1) and extends the breakdown to all of them linearly, for a model whose
expert loop makes a full trace slow; the output says when it did. With ``--search``, when the peak is over
``--budget-gb``, it tries the flags that lower it (bf16 parameters, activation checkpointing, smaller
micro-batches, fused AdamW) one more at a time and reports the first set that fits. A micro-batch is one
sequence here, so a smaller ``--microbatch-tokens`` only holds for episodes that short.

JSON (``--json``, the last line): ``peak_gb_per_rank``, ``params``, ``world``, ``tokens``, ``breakdown_gb``,
``flags``, ``fits``, ``budget_gb``, ``traced_layers``, ``layers``, ``scaled``, ``first_step``; with
``--search``, ``fit``
(the flags and peak of the first plan that fits, or null). GB are GiB (2**30 bytes).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import math
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench._common import emit_json, print_table

GiB = float(1 << 30)
OPTIMIZERS = ("trainer", "foreach", "fused", "forloop")

# the tracker's categories, under our names
_CATEGORIES = {
    "Sharded Param": "sharded_params",
    "Unsharded Param": "gathered_params",
    "Buffer": "buffers",
    "Sharded Grad": "sharded_grads",
    "Unsharded Grad": "gathered_grads",
    "Activation": "activations",
    "Temp": "temporaries",
    "All Gather": "all_gather",
    "Reduce Scatter": "reduce_scatter",
    "OptState": "optimizer_state",
    "Inputs": "inputs",
}


@dataclass(frozen=True)
class PlanFlags:
    """What changes the peak: the learner's flags, as this planner names them."""

    param_dtype: str = "float32"  # bfloat16: FSDP MixedPrecisionPolicy(bf16, reduce fp32) + bf16 autocast
    checkpoint_blocks: bool = True  # TrainerConfig.checkpoint_blocks (recompute each block in the backward)
    microbatch_tokens: int = 0  # 0 = all of --tokens in one micro-batch
    optimizer: str = "trainer"  # AdamW as Trainer builds it on CUDA, or foreach / fused / forloop

    def argv(self, tokens: int) -> list[str]:
        """These flags on the command line (the ones away from the defaults)."""
        out = []
        if self.param_dtype != "float32":
            out += ["--param-dtype", self.param_dtype]
        if not self.checkpoint_blocks:
            out.append("--no-checkpoint-blocks")
        if self.microbatch_tokens and self.microbatch_tokens < tokens:
            out += ["--microbatch-tokens", str(self.microbatch_tokens)]
        if self.optimizer != "trainer":
            out += ["--optimizer", self.optimizer]
        return out


@dataclass(frozen=True)
class Plan:
    """One rank's step, phase by phase: each phase's peak (``forward_1``, ``backward_1``, [``forward_2``,
    ``backward_2``,] ``clip``, ``optimizer``) as bytes per category (``_CATEGORIES``' names) and ``total``."""

    phases: dict[str, dict[str, int]]
    traced_layers: int
    layers: int
    microbatches: int
    optimizer: str  # the AdamW implementation that ran
    trace_s: float

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=lambda k: self.phases[k]["total"])

    @property
    def peak_bytes(self) -> int:
        return self.phases[self.peak_phase]["total"]

    @property
    def breakdown(self) -> dict[str, int]:
        """The categories at the peak."""
        return {k: v for k, v in self.phases[self.peak_phase].items() if k != "total"}

    @property
    def scaled(self) -> bool:
        return self.traced_layers != self.layers


def load_config(path: Path):  # noqa: ANN201 - MoEConfig, imported late (torch start-up stays out of --help)
    from t1async.model.config import MoEConfig
    from t1async.protocol.errors import ConfigError

    try:
        return MoEConfig.load(path)
    except ConfigError as exc:
        raise SystemExit(f"bench.memory_plan: {exc}") from None


def count_params(cfg) -> int:  # noqa: ANN001
    """The parameters of ``cfg``'s full model (value head included), counted on the meta device."""
    from t1async.model.moe import MoETransformer

    with torch.device("meta"):
        model = MoETransformer(cfg, init=False)
    return sum(p.numel() for p in model.parameters())


@contextmanager
def fake_group(world: int) -> Iterator[None]:
    """A default process group of ``world`` fake ranks (this process is rank 0): collectives return at once."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("bench.memory_plan needs its own process group: one is already initialised")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


class _FakeGaps(torch.utils._python_dispatch.TorchDispatchMode):
    """Two ops the fake mode cannot plan alone:

    - ``bincount`` of the chosen experts, read back by ``tolist`` (``ExpertPath.LOOP``, the loop over the
      experts: how many tokens each gets; fake tensors hold no values): here the balanced split, which
      ``tolist`` returns while this mode is on;
    - ``_grouped_mm`` on float32: its meta function takes bf16 only (the checks of CUDA's fast kernel; CUDA
      falls back to per-group matmuls for other dtypes, and the CPU kernel takes fp32): here an output of the
      shape and dtype the op returns, from torch's own shape rule."""

    def __enter__(self):  # noqa: ANN204
        from torch._subclasses.fake_tensor import FakeTensor

        self._tolist = FakeTensor.tolist

        def tolist(t):  # noqa: ANN001, ANN202
            planned = getattr(t, "_planned_counts", None)
            return list(planned) if planned is not None else self._tolist(t)

        FakeTensor.tolist = tolist
        return super().__enter__()

    def __exit__(self, *exc):  # noqa: ANN002, ANN204
        from torch._subclasses.fake_tensor import FakeTensor

        FakeTensor.tolist = self._tolist
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        from torch.distributed.tensor import DTensor

        if any(t is DTensor for t in types):
            return NotImplemented
        kwargs = kwargs or {}
        if func is torch.ops.aten.bincount.default:
            x = args[0]
            weights = args[1] if len(args) > 1 else kwargs.get("weights")
            bins = int(args[2] if len(args) > 2 else kwargs.get("minlength", 0))
            if weights is not None or bins < 1:
                raise NotImplementedError("bench.memory_plan: only bincount(ids, minlength=n_experts) is planned")
            n = x.numel()
            out = torch.empty(bins, dtype=torch.int64, device=x.device)
            out._planned_counts = [n // bins + (i < n % bins) for i in range(bins)]
            return out
        if func is torch.ops.aten._grouped_mm.default and args[0].dtype != torch.bfloat16:
            from torch._meta_registrations import _create_grouped_mm_output_tensor

            a, b = args[0], args[1]
            offs = args[2] if len(args) > 2 else kwargs.get("offs")
            out_dtype = (args[4] if len(args) > 4 else kwargs.get("out_dtype")) or a.dtype
            return _create_grouped_mm_output_tensor(a, b, offs, out_dtype)
        return func(*args, **kwargs)


def _tracker(model, optimizer):  # noqa: ANN001, ANN202
    """FSDP2's memory tracker, deaf to DTensor's sharding propagation.

    A DTensor op (the optimizer step, the gradient norm) first works out its output's global shape by running
    the op on empty tensors of the *global* shapes, in the fake mode that is active: here ours, so the tracker
    would count a full-size copy of every tensor in the op (of all the gradients, for the norm's foreach op)
    that never exists on a GPU. While DTensor propagates, this tracker runs the op without tracking it."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.tensor import DTensor

    class Tracker(FSDPMemTracker):
        quiet = 0

        def phase_peak(self) -> dict[str, int]:
            """The peak snapshot since the last call (its categories and "Total"), then the peak starts again
            from the current memory."""
            snap = self.get_tracker_snapshot("peak")
            peak = dict(next(iter(snap.values()), {"Total": 0}))
            self._peak_mem_snap = self.get_tracker_snapshot("current")
            self._peak_mem = {dev: s["Total"] for dev, s in self._peak_mem_snap.items()}
            return peak

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            if not self.quiet:
                return super().__torch_dispatch__(func, types, args, kwargs)
            if any(t is DTensor for t in types):
                return NotImplemented
            return func(*args, **(kwargs or {}))

    return Tracker(model, optimizer)


@contextmanager
def _quiet_propagation(tracker) -> Iterator[None]:  # noqa: ANN001
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    orig = ShardingPropagator._propagate_tensor_meta_non_cached

    @functools.wraps(orig)
    def quiet(self, *args, **kwargs):  # noqa: ANN001, ANN202
        tracker.quiet += 1
        try:
            return orig(self, *args, **kwargs)
        finally:
            tracker.quiet -= 1

    ShardingPropagator._propagate_tensor_meta_non_cached = quiet  # type: ignore[method-assign]
    try:
        yield
    finally:
        ShardingPropagator._propagate_tensor_meta_non_cached = orig  # type: ignore[method-assign]


def _shard(model, mesh, param_dtype: torch.dtype | None) -> None:  # noqa: ANN001
    """``learner.distributed.shard``: each block, then the root (kept gathered after its forward), gradients
    summed (each rank's loss carries the global normaliser), with the mixed-precision policy asked for."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = (
        MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
        if param_dtype is not None
        else MixedPrecisionPolicy()
    )
    units = [fully_shard(blk, mesh=mesh, reshard_after_forward=True, mp_policy=mp) for blk in model.blocks]
    units.append(fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=mp))
    for u in units:
        u.set_gradient_divide_factor(1.0)


def _optimizer(trainer, choice: str) -> str:  # noqa: ANN001
    """Set the trainer's AdamW to the implementation CUDA would run (or ``choice``); returns its name."""
    opt = trainer.optimizer
    d = opt.defaults
    if choice == "trainer":
        if d.get("fused"):
            return "fused"
        if d.get("foreach") is False:
            return "forloop"
        choice = "foreach"  # torch's default for DTensor parameters on CUDA (the CPU default is the loop)
    for g in opt.param_groups:
        g["fused"] = choice == "fused"
        g["foreach"] = choice == "foreach"
    opt.defaults.update(fused=choice == "fused", foreach=choice == "foreach")
    return choice


def trace(
    cfg,  # noqa: ANN001
    *,
    world: int,
    tokens: int,
    flags: PlanFlags,
    layers: int | None = None,
    first_step: bool = False,
) -> Plan:
    """One rank's peak over one training step of ``cfg``'s model (its first ``layers`` layers), traced: a step
    after the first (AdamW's moments held throughout), or with ``first_step`` the first (they appear in its
    optimizer step)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import init_device_mesh

    from t1async.learner.trainer_config import TrainDtype, TrainerConfig

    n_layers = cfg.n_layers if layers is None else layers
    traced = dataclasses.replace(
        cfg, n_layers=n_layers, dense_layers=tuple(i for i in cfg.dense_layers if i < n_layers)
    )
    mbt = min(flags.microbatch_tokens or tokens, tokens)
    n_micro = math.ceil(tokens / mbt)
    bf16 = flags.param_dtype == "bfloat16"
    tcfg = TrainerConfig(
        train_dtype=TrainDtype.BFLOAT16 if bf16 else TrainDtype.FLOAT32,
        checkpoint_blocks=flags.checkpoint_blocks,
        microbatch_tokens=max(mbt, 2),
    )
    t0 = time.perf_counter()
    with fake_group(world), warnings.catch_warnings():
        # a block returns its hidden state with views beside it (as in learner.distributed)
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
        mesh = init_device_mesh("cpu", (world,))  # holds a real (tiny) tensor of rank ids: made outside the fake mode
        with FakeTensorMode() as fake:
            phases, opt_name = _step_peak(
                traced, mesh, fake, tcfg, flags, tokens=tokens, mbt=mbt, n_micro=n_micro, held_state=not first_step
            )
    return Plan(
        phases={
            ph: {
                **{name: int(snap.get(key, 0)) for key, name in _CATEGORIES.items()},
                "total": int(snap.get("Total", 0)),
            }
            for ph, snap in phases.items()
        },
        traced_layers=n_layers,
        layers=cfg.n_layers,
        microbatches=n_micro,
        optimizer=opt_name,
        trace_s=time.perf_counter() - t0,
    )


def _hold_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """AdamW's moments as every step after the first holds them: one step on zero gradients (AdamW creates its
    state in its first step), then the gradients dropped as ``Trainer`` drops them before a step."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _step_peak(  # noqa: ANN202
    cfg,  # noqa: ANN001
    mesh,  # noqa: ANN001
    fake,  # noqa: ANN001
    tcfg,  # noqa: ANN001
    flags: PlanFlags,
    *,
    tokens: int,
    mbt: int,
    n_micro: int,
    held_state: bool,
    started: Callable[[], None] | None = None,
):
    """Under ``fake`` (a ``FakeTensorMode``; None: on real tensors, initialised, as a check of the plan): build
    and shard the model (with AdamW's state already held when ``held_state``: a step after the first), then one
    step under the tracker (``started()`` called as it begins); (peak snapshot per phase, optimizer)."""
    from t1async.learner import ppo
    from t1async.learner.batch import Batch
    from t1async.learner.trainer import Trainer
    from t1async.model.moe import MoETransformer

    model = MoETransformer(cfg, init=fake is None)  # fake: shapes only, nothing allocated
    _shard(model, mesh, torch.bfloat16 if tcfg.train_dtype == "bfloat16" else None)
    trainer = Trainer(model, tcfg)
    opt_name = _optimizer(trainer, flags.optimizer)
    shape = (1, mbt)
    batches = [
        Batch(
            tokens=torch.zeros(shape, dtype=torch.long),
            lengths=torch.tensor([mbt]),
            loss_mask=torch.ones(shape, dtype=torch.bool),
            behav_logp=torch.zeros(shape),
            versions=torch.zeros(shape, dtype=torch.long),
            recorded=None,
            index=(0,),
        )
        for _ in range(min(n_micro, 2))
    ]
    prox, adv, old_v, ret = (torch.zeros(shape) for _ in range(4))  # what the scoring pass leaves per micro-batch
    if held_state:
        _hold_optimizer_state(trainer.optimizer)
    tracker = _tracker(model, trainer.optimizer)
    tracker.track_inputs((batches, prox, adv, old_v, ret))
    model.train()
    phases: dict[str, dict[str, int]] = {}
    with _quiet_propagation(tracker), tracker, _FakeGaps() if fake is not None else contextlib.nullcontext():
        trainer.optimizer.zero_grad(set_to_none=True)
        tracker.phase_peak()
        if started is not None:
            started()
        for i, b in enumerate(batches):
            if i:
                tracker.reset_mod_stats()  # the tracker refuses a second root forward otherwise
            _, logp, vals, ent = trainer._forward(b, replay=False, with_entropy=tcfg.entropy_coef > 0)
            terms = ppo.ppo_loss(
                logp,
                prox,
                b.behav_logp,
                adv,
                vals,
                old_v,
                ret,
                b.loss_mask,
                tcfg,
                normaliser=float(tokens),
                entropy=ent,
            )
            phases[f"forward_{i + 1}"] = tracker.phase_peak()
            terms.loss.backward()
            del logp, vals, ent, terms
            phases[f"backward_{i + 1}"] = tracker.phase_peak()
        # Trainer._optimizer_step without reading the norm (a fake tensor has no value)
        params = [p for p in model.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None], 2.0)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        torch.nn.utils.clip_grads_with_norm_(params, tcfg.grad_clip, norm)
        phases["clip"] = tracker.phase_peak()
        trainer.optimizer.step()
        phases["optimizer"] = tracker.phase_peak()
    return phases, opt_name


def _vm(key: str) -> int:
    """This process's ``/proc/self/status`` line ``key`` (VmRSS, VmHWM) in bytes."""
    with open("/proc/self/status") as f:
        return next(int(x.split()[1]) * 1024 for x in f if x.startswith(key + ":"))


def measure(cfg, *, tokens: int, flags: PlanFlags) -> dict[str, Any]:  # noqa: ANN001
    """The step ``trace`` plans, run on real tensors on this CPU at world 1 (a gloo group of one): each phase's
    peak by the same tracker (``phases``, bytes by category as in ``Plan``), the tensors held before the step
    (``held``: parameters and AdamW's moments), and the process's resident memory before the step and its
    peak during it (``rss_before``, ``rss_peak``: VmRSS, then VmHWM after resetting it; with glibc, run with
    ``MALLOC_MMAP_THRESHOLD_=65536`` so freed tensors leave the resident set)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from t1async.learner.trainer_config import TrainDtype, TrainerConfig

    if dist.is_initialized():
        raise RuntimeError("bench.memory_plan: measure needs its own process group: one is already initialised")
    mbt = min(flags.microbatch_tokens or tokens, tokens)
    tcfg = TrainerConfig(
        train_dtype=TrainDtype(flags.param_dtype),
        checkpoint_blocks=flags.checkpoint_blocks,
        microbatch_tokens=max(mbt, 2),
    )
    rss: dict[str, int] = {}

    def started() -> None:  # the resident set as the step starts; VmHWM reset to it
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        rss["before"] = _vm("VmRSS")

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
            n_micro = math.ceil(tokens / mbt)
            snaps, _ = _step_peak(
                cfg, mesh, None, tcfg, flags, tokens=tokens, mbt=mbt, n_micro=n_micro, held_state=True, started=started
            )
        rss["peak"] = _vm("VmHWM")
    finally:
        dist.destroy_process_group()
    phases = {
        ph: {**{name: int(snap.get(key, 0)) for key, name in _CATEGORIES.items()}, "total": int(snap.get("Total", 0))}
        for ph, snap in snaps.items()
    }
    first = phases[next(iter(phases))]
    held = first["sharded_params"] + first["optimizer_state"] + first["buffers"]
    return {"phases": phases, "held": held, "rss_before": rss["before"], "rss_peak": rss["peak"]}


def plan(
    cfg,  # noqa: ANN001
    *,
    world: int,
    tokens: int,
    flags: PlanFlags,
    layers: int | None = None,
    first_step: bool = False,
) -> Plan:
    """``trace`` of the whole model, or of ``layers`` and ``layers + 1`` layers extended to all of them: each
    phase's categories linearly in the layer count (the sharded state, the kept block inputs and the FSDP
    units' buffers grow by one layer's worth a layer; the peak is then the largest phase at full depth)."""
    if layers is None or layers + 1 >= cfg.n_layers:
        return trace(cfg, world=world, tokens=tokens, flags=flags, first_step=first_step)
    a = trace(cfg, world=world, tokens=tokens, flags=flags, layers=layers, first_step=first_step)
    b = trace(cfg, world=world, tokens=tokens, flags=flags, layers=layers + 1, first_step=first_step)
    extra = cfg.n_layers - layers
    return dataclasses.replace(
        a,
        phases={ph: {k: v + extra * (b.phases[ph][k] - v) for k, v in cats.items()} for ph, cats in a.phases.items()},
        trace_s=a.trace_s + b.trace_s,
    )


def _ladder(base: PlanFlags, tokens: int) -> Iterator[PlanFlags]:
    """Flags that lower the peak, one more at a time: bf16 parameters, checkpointing, fused AdamW, then halved
    micro-batches down to 1024 tokens."""
    f = base
    for change in (
        {"param_dtype": "bfloat16"},
        {"checkpoint_blocks": True},
        {} if f.optimizer == "trainer" else {"optimizer": "fused"},  # Trainer's own AdamW is the fused one
    ):
        nxt = dataclasses.replace(f, **change)
        if nxt != f:
            f = nxt
            yield f
    mbt = f.microbatch_tokens or tokens
    while mbt > 1024:
        mbt //= 2
        f = dataclasses.replace(f, microbatch_tokens=mbt)
        yield f


def _gb(n: float) -> float:
    return round(n / GiB, 2)


def _report(p: Plan, flags: PlanFlags, args: argparse.Namespace, params: int) -> dict[str, Any]:
    return {
        "config": str(args.config),
        "params": params,
        "world": args.world,
        "tokens": args.tokens,
        "peak_gb_per_rank": _gb(p.peak_bytes),
        "peak_bytes_per_rank": p.peak_bytes,
        "breakdown_gb": {k: _gb(v) for k, v in p.breakdown.items()},
        "peak_phase": p.peak_phase,
        "phases_gb": {k: _gb(v["total"]) for k, v in p.phases.items()},
        "flags": {
            "param_dtype": flags.param_dtype,
            "checkpoint_blocks": flags.checkpoint_blocks,
            "microbatch_tokens": min(flags.microbatch_tokens or args.tokens, args.tokens),
            "microbatches": p.microbatches,
            "optimizer": p.optimizer,
        },
        "budget_gb": args.budget_gb,
        "fits": p.peak_bytes / GiB <= args.budget_gb,
        "traced_layers": p.traced_layers,
        "layers": p.layers,
        "scaled": p.scaled,
        "first_step": args.first_step,
        "trace_s": round(p.trace_s, 1),
    }


def _measured(p: Plan, m: dict[str, Any]) -> dict[str, Any]:
    """``measure``'s figures beside the plan's, in MiB (a model small enough to run here): each phase's peak by
    the tracker on real tensors, and the step's rise in resident memory over what it held as it began (VmHWM
    minus VmRSS then) beside the plan's peak less the parameters and AdamW state held."""
    mib = float(1 << 20)
    return {
        "phases_mib": {k: round(v["total"] / mib, 1) for k, v in m["phases"].items()},
        "tracker_equal_to_plan": all(m["phases"][k]["total"] == v["total"] for k, v in p.phases.items()),
        "held_mib": round(m["held"] / mib, 1),
        "rss_rise_mib": round((m["rss_peak"] - m["rss_before"]) / mib, 1),
        "plan_rise_mib": round((p.peak_bytes - m["held"]) / mib, 1),
        "rss_before_mib": round(m["rss_before"] / mib, 1),
    }


def _print(rep: dict[str, Any], title: str) -> None:
    b = rep["breakdown_gb"]
    rows: list[tuple[str, Any]] = [
        ("params (full model)", f"{rep['params']:,} ({rep['params'] / 1e9:.2f} B)"),
        ("world / tokens per rank", f"{rep['world']} / {rep['tokens']}"),
        (
            "step",
            "the first (AdamW's moments made in it)" if rep["first_step"] else "a later one (AdamW's moments held)",
        ),
        ("flags", " ".join(f"{k}={v}" for k, v in rep["flags"].items())),
        ("peak per rank (GiB)", f"{rep['peak_gb_per_rank']} (in {rep['peak_phase']})"),
    ]
    rows += [(f"  {k}", v) for k, v in b.items() if v]
    rows.append(("peak by phase (GiB)", " ".join(f"{k}={v}" for k, v in rep["phases_gb"].items())))
    rows.append(("fits budget", f"{rep['fits']} (budget {rep['budget_gb']} GiB)"))
    if rep["scaled"]:
        rows.append(
            (
                "layers",
                f"traced {rep['traced_layers']} and {rep['traced_layers'] + 1} of {rep['layers']}, extended linearly",
            )
        )
    rows.append(("trace (s)", rep["trace_s"]))
    print_table(title, rows)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.memory_plan", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", type=Path, required=True, help="a Hugging Face config.json (or a model dir)")
    ap.add_argument("--world", type=int, default=8, help="ranks the model is sharded over (default 8)")
    ap.add_argument("--tokens", type=int, default=32768, help="tokens one rank trains in the step (default 32768)")
    ap.add_argument("--microbatch-tokens", type=int, default=0, help="tokens per micro-batch (default: --tokens)")
    ap.add_argument(
        "--param-dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="gathered weights' dtype: bfloat16 = FSDP MixedPrecisionPolicy(bf16, reduce fp32) and bf16 "
        "autocast, as the learner's --train-dtype bfloat16 (master weights and AdamW stay fp32)",
    )
    ap.add_argument(
        "--checkpoint-blocks",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="activation checkpointing of each block (the trainer's default: on)",
    )
    ap.add_argument(
        "--optimizer",
        choices=OPTIMIZERS,
        default="trainer",
        help="AdamW implementation: as the Trainer builds it on CUDA (default), or foreach, fused, forloop",
    )
    ap.add_argument(
        "--layers",
        type=int,
        default=3,
        help="trace N and N+1 of the config's layers and extend to all of them linearly (default 3, at least 3: "
        "from the third on every layer adds the same); 0 = trace every layer",
    )
    ap.add_argument(
        "--budget-gb",
        type=float,
        default=75.0,
        help="GiB of tensors a rank may hold (default 75: an 80 GB H100 less its context, NCCL, fragmentation)",
    )
    ap.add_argument(
        "--first-step",
        action="store_true",
        help="trace the first step (AdamW makes its moments in it) instead of a later one (they are held throughout)",
    )
    ap.add_argument("--search", action="store_true", help="over budget: try the flags that lower the peak")
    ap.add_argument(
        "--measure",
        action="store_true",
        help="--world 1 only: also run the step on real tensors on this CPU and print what it held beside the plan",
    )
    ap.add_argument("--json", action="store_true", help="print the result as JSON on the last line")
    args = ap.parse_args(argv)
    if args.world < 1 or args.tokens < 2 or args.microbatch_tokens < 0 or args.layers in (1, 2) or args.layers < 0:
        raise SystemExit(
            "bench.memory_plan: needs --world >= 1, --tokens >= 2, --microbatch-tokens >= 0, --layers 0 or >= 3"
        )
    if args.measure and (args.world != 1 or args.first_step):
        raise SystemExit(
            "bench.memory_plan: --measure runs one rank's later step here: give --world 1, no --first-step"
        )
    cfg = load_config(args.config)
    params = count_params(cfg)
    torch.set_num_threads(1)
    flags = PlanFlags(
        param_dtype=args.param_dtype,
        checkpoint_blocks=args.checkpoint_blocks,
        microbatch_tokens=args.microbatch_tokens,
        optimizer=args.optimizer,
    )
    layers = args.layers or None
    p = plan(cfg, world=args.world, tokens=args.tokens, flags=flags, layers=layers, first_step=args.first_step)
    rep = _report(p, flags, args, params)
    _print(rep, f"memory plan: {args.config.name}, one training step on one of {args.world} ranks")
    if args.search:
        rep["fit"] = None
        if not rep["fits"]:
            for f in _ladder(flags, args.tokens):
                qp = plan(cfg, world=args.world, tokens=args.tokens, flags=f, layers=layers, first_step=args.first_step)
                q = _report(qp, f, args, params)
                print(
                    f"  {' '.join(f.argv(args.tokens)) or '(defaults)'}: {q['peak_gb_per_rank']} GiB", file=sys.stderr
                )
                if q["fits"]:
                    q["argv"] = f.argv(args.tokens)
                    rep["fit"] = q
                    _print(q, "fits with: " + " ".join(q["argv"]))
                    break
    if args.measure:
        rep["measured"] = _measured(p, measure(cfg, tokens=args.tokens, flags=flags))
        print_table("measured: the same step on real tensors, this CPU, world 1", list(rep["measured"].items()))
    if args.json:
        emit_json(rep)


if __name__ == "__main__":
    main()
