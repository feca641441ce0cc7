"""SGLang's distributed weight update, client side and shared pieces (design §10).

The learner (rank 0) and every sampler's tensor-parallel workers (ranks ``rank_offset + tp_rank``) join one
torch.distributed group, outside any default group, and the learner broadcasts each tensor; an HTTP call
tells the sampler which tensors to expect. The endpoints and body fields are SGLang 0.5.23's
(``sglang/srt/entrypoints/http_server.py``, bodies in ``sglang/srt/managers/io_struct.py``):

- ``POST /init_weights_update_group`` {``master_address``, ``master_port``, ``rank_offset``, ``world_size``,
  ``group_name``, ``backend``}: join the group (returns once every rank has joined). Each server joins with
  ``tp_size`` ranks, ``rank = rank_offset + tp_rank``
  (``sglang/srt/model_executor/model_runner_components/weight_updater.py``), so the world is 1 + the sum of
  the servers' ``tp_size`` (``rank_layout``);
- ``POST /begin_weight_update`` {} and ``POST /end_weight_update`` {}: the session every
  ``/update_weights_from_distributed`` must run inside (outside one it answers ``success: false``, and a
  second begin fails until end: ``sglang/srt/managers/scheduler_components/weight_updater.py``);
- ``POST /update_weights_from_distributed`` {``names``, ``dtypes``, ``shapes``, ``group_name``,
  ``flush_cache``, ``weight_version``}: receive one broadcast per name, in order, from rank 0. With
  ``flush_cache`` the update fails (weights loaded, ``success: false``) while requests run or wait, so a
  push in ``in_place`` mode sends ``flush_cache: false``;
- ``POST /pause_generation`` {``mode``: ``abort`` | ``retract`` | ``in_place``} / ``POST
  /continue_generation``: hold new requests while an update is sent (the modes: design §4);
- ``POST /destroy_weights_update_group`` {``group_name``}.

Replies are ``{"success": bool, "message": str}``, 400 on failure (pause and continue: ``{"message",
"status": "ok"}``). ``open_group`` is how either side joins: a TCPStore that rank 0 hosts (port 0 picks a free
one) and a gloo (CPU) or NCCL (GPU) process group on it, under the store keys SGLang's
``init_custom_process_group`` (``sglang/srt/utils/common.py``) uses, so a learner meets a real SGLang.
"""

from __future__ import annotations

import datetime
import os
import socket
from collections.abc import Sequence
from typing import Any

import anyio
import httpx
import torch
import torch.distributed as dist

from t1async.log import get_logger
from t1async.protocol.errors import SamplerError

log = get_logger("sampler.weightpush")

DEFAULT_GROUP = "weight_update_group"  # SGLang's default group_name
EMBEDDED_VERSION = "t1async-embedded"  # how the embedded sampler's /server_info "version" starts
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}


def dtype_name(dtype: torch.dtype) -> str:
    """SGLang's spelling of a dtype in ``dtypes`` (``"bfloat16"``; ``getattr(torch, name)`` on its side)."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: Any, where: str = "dtypes") -> torch.dtype:
    if isinstance(name, str) and name.removeprefix("torch.") in _DTYPES:
        return _DTYPES[name.removeprefix("torch.")]
    raise ValueError(f"{where}: unknown dtype {name!r}; send one of {sorted(_DTYPES)}")


def store_master(host: str, port: int, world_size: int, timeout_s: float) -> dist.TCPStore:
    """Rank 0's rendezvous store (port 0: a free port, read back from ``.port``)."""
    return dist.TCPStore(
        host, port, world_size, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout_s)
    )


def local_address(peer: str) -> str | None:
    """This machine's address on the route to ``peer`` (a UDP connect sends nothing), or None if none."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((peer, 9))
            return str(s.getsockname()[0])
    except OSError:
        return None


def gloo_group(store: dist.Store, rank: int, world_size: int, timeout: datetime.timedelta, peer: str) -> Any:
    """A gloo group whose sockets are on the address that reaches ``peer`` (rank 0's store host). gloo's
    default is the address this host's name resolves to, often 127.0.x.1: unreachable from the other hosts.
    ``$GLOO_SOCKET_IFNAME``, when set, wins (torch reads it)."""
    addr = None if os.environ.get("GLOO_SOCKET_IFNAME") else local_address(peer)
    if addr is None:
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # the stub names only Options
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=addr)]
    opts._timeout = timeout
    return dist.ProcessGroupGloo(store, rank, world_size, opts)


def rank_layout(tp_sizes: Sequence[int]) -> tuple[int, list[int]]:
    """(world size, each server's ``rank_offset``) for servers of these TP sizes: rank 0 is the learner,
    server ``i`` holds ranks ``offset[i] .. offset[i] + tp_sizes[i] - 1`` (SGLang: ``rank_offset + tp_rank``)."""
    offsets, nxt = [], 1
    for tp in tp_sizes:
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise ValueError(f"a tp_size must be an integer >= 1, got {tp!r}")
        offsets.append(nxt)
        nxt += tp
    return nxt, offsets


def sglang_store(store: dist.Store, group_name: str, backend: str) -> dist.Store:
    """The store view a backend of SGLang's ``init_custom_process_group`` rendezvouses on. SGLang wraps the
    rendezvous store in ``PrefixStore(group_name, store)`` and hands it to torch's
    ``_new_process_group_helper``, which adds ``PrefixStore(f"{group_name}/", ...)`` and, per device of the
    backend, ``PrefixStore(f"{device}/", ...)``: ``cpu`` for gloo (its first device; gloo registers one
    backend for all), ``cuda`` for NCCL (torch.distributed.distributed_c10d). Built by hand, not through the
    helper, so that the learner can leave and rejoin (the helper refuses a group name twice per process)
    and pick gloo's address (``gloo_group``)."""
    device = {"gloo": "cpu", "nccl": "cuda"}[backend]
    return dist.PrefixStore(f"{device}/", dist.PrefixStore(f"{group_name}/", dist.PrefixStore(group_name, store)))


def open_group(
    store: dist.Store | None,
    *,
    host: str,
    port: int,
    rank: int,
    world_size: int,
    group_name: str,
    backend: str = "gloo",
    timeout_s: float = 120.0,
) -> Any:
    """Join the weight-update group (blocks until all ``world_size`` ranks joined). Rank 0 passes its store."""
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' (CPU) or 'nccl' (GPU), got {backend!r}")
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
    prefixed = sglang_store(store, group_name, backend)
    if backend == "gloo":
        pg = gloo_group(prefixed, rank, world_size, timeout, host)
    else:  # a real SGLang on GPUs; the embedded sampler is CPU-only and takes gloo
        opts = dist.ProcessGroupNCCL.Options()
        opts.is_high_priority_stream = False
        opts._timeout = timeout
        opts.group_name = group_name  # type: ignore[assignment]  # torch's GroupName is a str NewType
        pg = dist.ProcessGroupNCCL(prefixed, rank, world_size, opts)
    if hasattr(pg, "_set_sequence_number_for_group"):  # as the helper does for gloo and NCCL
        pg._set_sequence_number_for_group()
    return pg


def broadcast(pg: Any, tensors: Sequence[torch.Tensor], root: int = 0) -> None:
    """Broadcast each tensor in order from ``root`` (both sides call this with same-shaped tensors)."""
    for t in tensors:
        pg.broadcast(t, root).wait()


# ------------------------------------------------------------------------------- client calls (SGLangClient)


async def _post(client: Any, url: str, path: str, body: dict) -> dict:
    """POST once to one sampler (never retried: a resent update would wait for a broadcast already sent);
    a non-2xx status or ``success: false`` raises SamplerError with the server's message."""
    try:
        resp = await client.post_once(url, path, body)
    except httpx.TransportError as exc:
        raise SamplerError(f"{url}{path}: {type(exc).__name__}: {exc}") from exc
    try:
        out = resp.json()
    except ValueError:
        out = {"success": resp.status_code < 300, "message": resp.text}
    if not isinstance(out, dict):
        out = {"success": resp.status_code < 300, "message": str(out)}
    if resp.status_code >= 300 or out.get("success") is False:
        err = out.get("error")
        msg = out.get("message") or (err.get("message") if isinstance(err, dict) else err) or resp.text
        raise SamplerError(f"{url}{path} failed (HTTP {resp.status_code}): {msg}")
    return out


async def init_weights_update_group(
    client: Any,
    url: str,
    *,
    master_address: str,
    master_port: int,
    rank_offset: int,
    world_size: int,
    group_name: str = DEFAULT_GROUP,
    backend: str = "gloo",
) -> dict:
    body = {
        "master_address": master_address,
        "master_port": master_port,
        "rank_offset": rank_offset,
        "world_size": world_size,
        "group_name": group_name,
        "backend": backend,
    }
    return await _post(client, url, "/init_weights_update_group", body)


async def update_weights_from_distributed(
    client: Any,
    url: str,
    *,
    names: Sequence[str],
    dtypes: Sequence[str],
    shapes: Sequence[Sequence[int]],
    group_name: str = DEFAULT_GROUP,
    flush_cache: bool = True,
    weight_version: int | str | None = None,
) -> dict:
    body: dict = {
        "names": list(names),
        "dtypes": list(dtypes),
        "shapes": [list(s) for s in shapes],
        "group_name": group_name,
        "flush_cache": flush_cache,
    }
    if weight_version is not None:
        body["weight_version"] = str(weight_version)
    return await _post(client, url, "/update_weights_from_distributed", body)


async def begin_weight_update(client: Any, url: str) -> dict:
    """Open SGLang's weight-update session (``BeginWeightUpdateReqInput``: ``selector`` left at ``all``)."""
    return await _post(client, url, "/begin_weight_update", {})


async def end_weight_update(client: Any, url: str) -> dict:
    """Close the session ``begin_weight_update`` opened (``EndWeightUpdateReqInput``: no fields)."""
    return await _post(client, url, "/end_weight_update", {})


async def get_json(client: Any, url: str, *paths: str, timeout_s: float = 10.0) -> dict:
    """GET the first of ``paths`` the server has (SGLang 0.5.23 serves ``/server_info`` and ``/model_info``,
    older ones only the ``/get_`` names); raises SamplerError naming the URL when none answers 200 JSON."""
    cause = ""
    for path in paths:
        try:
            resp = await client.get_once(url, path, timeout_s=timeout_s)
        except httpx.HTTPError as exc:
            raise SamplerError(f"{url}{path}: {type(exc).__name__}: {exc}") from exc
        if resp.status_code == 404:
            cause = f"{path}: HTTP 404"
            continue
        try:
            body = resp.json()
        except ValueError:
            body = None
        if resp.status_code != 200 or not isinstance(body, dict):
            raise SamplerError(f"{url}{path} failed (HTTP {resp.status_code}): {resp.text[:200]}")
        return body
    raise SamplerError(f"{url} has none of {', '.join(paths)} ({cause})")


async def server_info(client: Any, url: str) -> dict:
    """``/server_info`` (else ``/get_server_info``): SGLang's start-up configuration (``tp_size``, ...)."""
    return await get_json(client, url, "/server_info", "/get_server_info")


def tp_size(info: dict, url: str) -> int:
    """The ranks a server joins the weight-update group with, from its ``/server_info`` (SGLang's resolved
    ``ServerArgs``; absent: 1). Pipeline parallelism, and data parallelism without DP attention, give several
    workers the same ``tp_rank`` (SGLang ranks them ``rank_offset + tp_rank``): refused, one server per replica."""
    tp, pp, dp = info.get("tp_size", 1), info.get("pp_size", 1), info.get("dp_size", 1)
    if pp != 1 or (dp != 1 and not info.get("enable_dp_attention")):
        raise SamplerError(
            f"{url} runs pp_size {pp}, dp_size {dp}: SGLang ranks the weight-update group by tp_rank alone, so "
            "its workers would collide; start one server per replica (--dp-size 1 --pp-size 1) for "
            "--weight-sync distributed"
        )
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise SamplerError(f"{url}/server_info reports tp_size {tp!r}, not an integer >= 1")
    return tp


def pause_mode_for(info: dict, mode: str) -> str:
    """The ``/pause_generation`` mode that carries out ``--pause-mode`` on the server of this ``/server_info``.
    The embedded sampler's ``retract`` re-reports every route it recomputed (a route fork, design §6); SGLang's
    re-prefills the retracted requests with the new weights' routes and returns them beside the old logprobs
    of the tokens sampled before the pause, with no sign of it: on SGLang, ``retract`` is ``in_place``."""
    embedded = str(info.get("version", "")).startswith(EMBEDDED_VERSION)
    return "in_place" if mode == "retract" and not embedded else mode


async def server_infos(client: Any, urls: Sequence[str]) -> dict[str, dict]:
    """``/server_info`` of every one of ``urls``, concurrently."""
    infos: dict[str, dict] = {}

    async def one(u: str) -> None:
        infos[u] = await server_info(client, u)

    async with anyio.create_task_group() as tg:
        for u in urls:
            tg.start_soon(one, u)
    return infos


def pause_modes(infos: dict[str, dict], mode: str) -> dict[str, str]:
    """``{url: pause_mode_for(its info, mode)}``, with a warning naming the servers where the mode changed."""
    modes = {u: pause_mode_for(info, mode) for u, info in infos.items()}
    changed = [u for u, m in modes.items() if m != mode]
    if changed:
        log.warning(
            "learner.pause_mode_changed",
            asked=mode,
            urls=changed,
            now="in_place",
            why="SGLang's retract re-prefills running requests with the new weights' routes, unreported",
        )
    return modes


async def pause_each(client: Any, modes: dict[str, str]) -> None:
    """``/pause_generation`` on each url of ``modes`` in its own mode."""
    for mode in sorted(set(modes.values())):
        await pause_generation(client, mode=mode, urls=[u for u, m in modes.items() if m == mode])


async def destroy_weights_update_group(client: Any, url: str, group_name: str = DEFAULT_GROUP) -> dict:
    return await _post(client, url, "/destroy_weights_update_group", {"group_name": group_name})


async def _every(client: Any, path: str, body: dict, urls: Sequence[str] | None = None) -> None:
    urls = list(client.urls if urls is None else urls)
    errors: list[str] = []

    async def one(u: str) -> None:
        try:
            await _post(client, u, path, body)
        except SamplerError as exc:
            errors.append(str(exc))

    async with anyio.create_task_group() as tg:
        for u in urls:
            tg.start_soon(one, u)
    if errors:
        raise SamplerError(f"{path} failed on {len(errors)} of {len(urls)} samplers: {errors[0]}")


async def pause_generation(client: Any, mode: str = "retract", urls: Sequence[str] | None = None) -> None:
    """``/pause_generation`` on every sampler (or ``urls``). ``retract`` keeps running requests alive and
    re-prefills them with the new weights at continue; ``in_place`` freezes them with their KV (new weights
    over old KV after an update); ``abort`` (SGLang's default) aborts them. What each guarantees per engine:
    design §4."""
    await _every(client, "/pause_generation", {"mode": mode}, urls)


async def continue_generation(client: Any, urls: Sequence[str] | None = None) -> None:
    await _every(client, "/continue_generation", {}, urls)


async def reachable(client: Any, urls: Sequence[str], timeout_s: float = 5.0) -> list[str]:
    """Those of ``urls`` whose HTTP server answers ``/ready`` now (in the given order), 200 or 503: SGLang's
    ``/ready`` is 503 while paused, and its ``/health`` generates a token, which waits out a pause. A sampler
    a crashed learner left paused must stay reachable, for the next push's continue to free it."""
    ok: set[str] = set()

    async def one(u: str) -> None:
        try:
            if (await client.get_once(u, "/ready", timeout_s=timeout_s)).status_code in (200, 503):
                ok.add(u)
        except httpx.HTTPError:
            pass

    async with anyio.create_task_group() as tg:
        for u in urls:
            tg.start_soon(one, u)
    return [u for u in urls if u in ok]
