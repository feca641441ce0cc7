"""The learner's weight push over torch.distributed, with SGLang's protocol (design §10; ``--weight-sync
distributed``).

    pusher = DistributedPusher(client, WeightPushConfig(bucket_mb=64))
    await pusher.connect()                 # rank 0 hosts the store; each sampler joins with its TP ranks
    await pusher.push(model, policy_version=7)    # pause -> begin -> buckets (HTTP + broadcasts) -> end -> continue
    await pusher.aclose()                  # /destroy_weights_update_group

The group is 1 + the sum of the samplers' ``tp_size`` (read from each ``/server_info``): SGLang joins every
TP worker at ``rank_offset + tp_rank``, so the offsets are cumulative (``sampler.weightpush.rank_layout``). The
buckets go inside SGLang's weight-update session (``/begin_weight_update`` .. ``/end_weight_update``; a
session a crashed learner left open is closed and opened again). Each bucket is one
``/update_weights_from_distributed`` per sampler plus one broadcast per tensor, sent concurrently (the
sampler receives while its HTTP call waits). ``/end_weight_update`` and ``/continue_generation`` are always
sent, even when a bucket failed, so the samplers never stay paused; a failed push closes the group and is
tried once more over a new one (how a restarted sampler rejoins), then raises SamplerError. A sampler whose
learner died mid-push stays paused on SGLang (no pause timeout there; the embedded one has
``--pause-timeout``) until the next learner's first push continues it: ``/ready`` still answers while paused,
so that push reaches it.

Names are the served model's, as SGLang loads them (``push_tensors``): for a Hugging Face architecture the hub
names (``model.layers.0.self_attn.q_proj.weight``, one expert each: model/hf.py), our value head left out (it
is not part of the architecture and no sampler uses it); for the in-house model our ``state_dict`` names. The
embedded sampler takes either.

Both paths pause with ``pause_mode`` (``--pause-mode``, default ``retract``: running requests are recomputed
with the new weights, none aborted, none mixing policies). On a real SGLang the distributed path sends
``in_place`` for ``retract`` (``sampler.weightpush.pause_mode_for``: SGLang's retract hides the route change), and
``flush_cache: false`` with ``in_place`` (SGLang's flush fails while requests run). The disk path
(``DiskPushClient``, an ``SGLangClient``) does /pause_generation -> /update_weights_from_disk -> /continue_generation.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Any

import anyio
import torch

from t1async.log import get_logger
from t1async.model.hf import hf_slots, slot_view
from t1async.model.moe import MoETransformer
from t1async.protocol.errors import ConfigError, SamplerError
from t1async.sampler import weightpush as W
from t1async.sampler.client import SGLangClient

log = get_logger("learner.weightpush")
PAUSE_MODES = ("retract", "in_place", "abort")  # --pause-mode; the sampler's reading: sampler/weightpush_server.py


def _check_mode(mode: str) -> None:
    if mode not in PAUSE_MODES:
        raise ConfigError(f"--pause-mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")


@dataclass(frozen=True)
class WeightPushConfig:
    bucket_mb: float = 64.0  # --weight-bucket-mb: tensors per /update_weights_from_distributed call
    host: str = "127.0.0.1"  # the address samplers reach this learner's store at
    port: int = 0  # 0: a free port
    group_name: str = W.DEFAULT_GROUP
    backend: str = "gloo"  # nccl for SGLang on GPUs
    timeout_s: float = 120.0
    pause_mode: str = "retract"  # --pause-mode: what /pause_generation does to running requests

    def __post_init__(self) -> None:
        _check_mode(self.pause_mode)
        if not self.bucket_mb > 0:
            raise ConfigError(f"--weight-bucket-mb must be > 0, got {self.bucket_mb}")
        if self.backend not in ("gloo", "nccl"):
            raise ConfigError(f"weight-sync backend must be gloo or nccl, got {self.backend!r}")


def push_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """What a push sends, under the names the sampler serves: a Hugging Face architecture's hub names (views
    into ours, made contiguous one bucket at a time), no value head; else the ``state_dict`` names as they are
    (the in-house model, or any module whose ``state_dict`` is already named for the sampler)."""
    state = model.state_dict()
    if isinstance(model, MoETransformer) and model.cfg.architecture:
        return [(name, slot_view(state[s.name], s).detach()) for name, s in hf_slots(model.cfg).items()]
    return [(k, v.detach()) for k, v in state.items()]


def buckets(named: list[tuple[str, torch.Tensor]], bucket_mb: float) -> list[list[tuple[str, torch.Tensor]]]:
    """Consecutive groups of at most ``bucket_mb`` MiB (a larger tensor goes alone)."""
    limit, size = bucket_mb * 2**20, 0
    out: list[list[tuple[str, torch.Tensor]]] = []
    cur: list[tuple[str, torch.Tensor]] = []
    for name, t in named:
        nbytes = t.numel() * t.element_size()
        if cur and size + nbytes > limit:
            out.append(cur)
            cur, size = [], 0
        cur.append((name, t))
        size += nbytes
    if cur:
        out.append(cur)
    return out


class DistributedPusher:
    def __init__(self, client: Any, config: WeightPushConfig = WeightPushConfig()) -> None:
        self.client, self.cfg = client, config
        self.pg: Any = None
        self.store: Any = None
        self.members: list[str] = []  # the samplers in the current group (those reachable when it was made)
        self.modes: dict[str, str] = {}  # member -> the /pause_generation mode that carries out pause_mode there
        self.pushes = 0
        self.last: dict = {}

    async def connect(self) -> None:
        urls = await W.reachable(self.client, self.client.urls)
        if not urls:
            raise SamplerError(f"no sampler answers /ready ({', '.join(self.client.urls)}): cannot push weights")
        if len(urls) < len(self.client.urls):  # as the disk path: a dead sampler is synced when it is back
            log.warning("sampler.push_skipped", urls=[u for u in self.client.urls if u not in urls], path="distributed")
        infos = await W.server_infos(self.client, urls)
        tps = [W.tp_size(infos[u], u) for u in urls]
        world, offsets = W.rank_layout(tps)
        modes = W.pause_modes(infos, self.cfg.pause_mode)
        self.store = W.store_master(self.cfg.host, self.cfg.port, world, self.cfg.timeout_s)
        port = self.store.port
        result: dict = {}

        async def rank0() -> None:
            result["pg"] = await anyio.to_thread.run_sync(
                lambda: W.open_group(
                    self.store,
                    host=self.cfg.host,
                    port=port,
                    rank=0,
                    world_size=world,
                    group_name=self.cfg.group_name,
                    backend=self.cfg.backend,
                    timeout_s=self.cfg.timeout_s,
                ),
                abandon_on_cancel=True,
            )

        t0 = time.perf_counter()
        async with anyio.create_task_group() as tg:
            tg.start_soon(rank0)
            for u, offset in zip(urls, offsets):
                tg.start_soon(
                    functools.partial(
                        W.init_weights_update_group,
                        self.client,
                        u,
                        master_address=self.cfg.host,
                        master_port=port,
                        rank_offset=offset,
                        world_size=world,
                        group_name=self.cfg.group_name,
                        backend=self.cfg.backend,
                    )
                )
        self.pg, self.members, self.modes = result["pg"], urls, modes
        log.info(
            "learner.weight_group",
            samplers=len(urls),
            world_size=world,
            tp_sizes=tps,
            port=port,
            backend=self.cfg.backend,
            seconds=round(time.perf_counter() - t0, 3),
        )

    async def _pause(self) -> None:
        await W.pause_each(self.client, {u: self.modes[u] for u in self.members})

    async def _begin(self) -> None:
        """``/begin_weight_update`` on every member; a session left open (a learner that died mid-push) is
        ended and begun again."""

        async def one(u: str) -> None:
            try:
                await W.begin_weight_update(self.client, u)
            except SamplerError as exc:
                if "already open" not in str(exc):
                    raise
                log.warning("learner.weight_session_left_open", url=u)
                await W.end_weight_update(self.client, u)
                await W.begin_weight_update(self.client, u)

        async with anyio.create_task_group() as tg:
            for u in self.members:
                tg.start_soon(one, u)

    async def _end(self) -> None:
        errors: list[str] = []

        async def one(u: str) -> None:
            try:
                await W.end_weight_update(self.client, u)
            except SamplerError as exc:
                errors.append(str(exc))

        async with anyio.create_task_group() as tg:
            for u in self.members:
                tg.start_soon(one, u)
        if errors:
            raise SamplerError(f"/end_weight_update failed on {len(errors)} of {len(self.members)}: {errors[0]}")

    async def push(self, model: torch.nn.Module, policy_version: int) -> dict:
        """Send every tensor of ``model``'s state dict to every sampler as ``policy_version``; returns timings.

        A failed push is tried once more over a new group (a sampler that restarted has no group: the new one
        takes it in); a second failure raises SamplerError."""
        try:
            return await self._push_once(model, policy_version)
        except SamplerError as exc:
            log.warning("learner.weight_push_retry", policy_version=policy_version, error=str(exc))
            return await self._push_once(model, policy_version)

    async def _push_once(self, model: torch.nn.Module, policy_version: int) -> dict:
        left_out = [u for u in self.client.urls if u not in self.members]
        if self.pg is not None and left_out and await W.reachable(self.client, left_out):
            await self.aclose()  # a sampler is back: a new group takes it in
        if self.pg is None:
            await self.connect()
        named = push_tensors(model)
        parts = buckets(named, self.cfg.bucket_mb)
        t0 = time.perf_counter()
        await self._pause()
        try:
            await self._begin()
            for part in parts:
                await self._bucket(part, policy_version)
        except BaseException:
            with anyio.CancelScope(shield=True):  # the group may be half-used: drop it, reconnect next time
                for step in (self._end, functools.partial(W.continue_generation, self.client, urls=self.members)):
                    try:
                        await step()
                    except SamplerError as exc:
                        log.warning("learner.continue_failed", error=str(exc))
                await self.aclose()
            raise
        else:
            try:
                await self._end()
            finally:
                await W.continue_generation(self.client, urls=self.members)
        self.pushes += 1
        mb = sum(t.numel() * t.element_size() for _, t in named) / 2**20
        self.last = {
            "seconds": time.perf_counter() - t0,
            "buckets": len(parts),
            "mb": mb,
            "policy_version": policy_version,
        }
        log.info(
            "learner.weights_pushed",
            path="distributed",
            policy_version=policy_version,
            hub_names=isinstance(model, MoETransformer) and bool(model.cfg.architecture),
            buckets=len(parts),
            mb=round(mb, 2),
            seconds=round(self.last["seconds"], 3),
        )
        return self.last

    async def _bucket(self, part: list[tuple[str, torch.Tensor]], policy_version: int) -> None:
        names = [n for n, _ in part]
        dtypes = [W.dtype_name(t.dtype) for _, t in part]
        shapes = [list(t.shape) for _, t in part]
        # a hub name's view (a transposed expert) made whole here; gloo sends from host memory (a learner on a GPU)
        cpu = self.cfg.backend == "gloo"
        tensors = [(t.cpu() if cpu else t).contiguous() for _, t in part]
        errors: list[str] = []
        async with anyio.create_task_group() as tg:

            async def one(u: str) -> None:
                try:
                    await W.update_weights_from_distributed(
                        self.client,
                        u,
                        names=names,
                        dtypes=dtypes,
                        shapes=shapes,
                        group_name=self.cfg.group_name,
                        flush_cache=self.modes.get(u) != "in_place",  # SGLang's flush fails while requests run
                        weight_version=policy_version,
                    )
                except SamplerError as exc:
                    errors.append(str(exc))
                    tg.cancel_scope.cancel()  # a sampler that did not receive would leave the broadcast waiting

            for u in self.members:
                tg.start_soon(one, u)

            async def send() -> None:
                try:
                    await anyio.to_thread.run_sync(W.broadcast, self.pg, tensors, abandon_on_cancel=True)
                except Exception as exc:  # a peer closed its side (a sampler died or restarted): gloo's error
                    errors.append(f"broadcast: {exc}")
                    tg.cancel_scope.cancel()

            tg.start_soon(send)
        if errors:
            raise SamplerError(
                f"weight push v{policy_version} failed on {len(errors)} of {len(self.members)} samplers: {errors[0]}"
            )

    async def aclose(self) -> None:
        if self.pg is None:
            return
        self.pg, members, self.members = None, self.members, []
        with anyio.CancelScope(shield=True):
            for u in members:
                try:
                    await W.destroy_weights_update_group(self.client, u, self.cfg.group_name)
                except SamplerError as exc:  # the sampler is gone: nothing to tear down there
                    log.warning("learner.weight_group_destroy_failed", url=u, error=str(exc))


class DiskPushClient(SGLangClient):
    """An ``SGLangClient`` whose ``update_weights_from_disk`` (the learner's ``--weight-sync disk`` push) runs
    between ``/pause_generation`` in ``pause_mode`` and ``/continue_generation`` on the samplers that answer
    ``/ready`` (paused ones too); continue is always sent, even when the update failed. As the distributed
    push does, ``retract`` is sent as ``in_place`` to a real SGLang (``sampler.weightpush.pause_mode_for``: its retract
    hides the route change). ``in_place`` sends ``flush_cache: false`` (SGLang's flush fails while requests
    run)."""

    def __init__(self, urls: Any, *, pause_mode: str = "retract", **kwargs: Any) -> None:
        _check_mode(pause_mode)
        super().__init__(urls, **kwargs)
        self.pause_mode = pause_mode
        self.flush_on_update = pause_mode != "in_place"  # SGLang's flush fails while in_place requests run

    async def update_weights_from_disk(self, model_path: str, weight_version: int | str | None = None) -> list[dict]:
        urls = await W.reachable(self, self.urls)  # a dead one is skipped (as the update itself does)
        try:
            if urls:
                modes = W.pause_modes(await W.server_infos(self, urls), self.pause_mode)
                self.flush_on_update = "in_place" not in modes.values()
                await W.pause_each(self, modes)
            return await super().update_weights_from_disk(model_path, weight_version)
        finally:
            with anyio.CancelScope(shield=True):
                try:
                    if urls:
                        await W.continue_generation(self, urls=urls)
                except SamplerError as exc:  # its pause expires by itself (the sampler's --pause-timeout)
                    log.warning("learner.continue_failed", error=str(exc), path="disk")
