"""SGLang's distributed weight update, client side and shared pieces (design §10).

The learner (rank 0) and every sampler (ranks ``rank_offset..``) join one torch.distributed group, outside
any default group, and the learner broadcasts each tensor; an HTTP call tells the sampler which tensors to
expect. The endpoints and body fields are SGLang's (``python/sglang/srt/managers/io_struct.py``):

- ``POST /init_weights_update_group`` {``master_address``, ``master_port``, ``rank_offset``, ``world_size``,
  ``group_name``, ``backend``}: join the group (returns once every rank has joined);
- ``POST /update_weights_from_distributed`` {``names``, ``dtypes``, ``shapes``, ``group_name``,
  ``flush_cache``, ``weight_version``}: receive one broadcast per name, in order, from rank 0;
- ``POST /pause_generation`` {``mode``: ``abort`` | ``retract`` | ``in_place``} / ``POST
  /continue_generation``: hold new requests while an update is sent (the modes: weightsync_server.py);
- ``POST /destroy_weights_update_group`` {``group_name``}.

All return ``{"success": bool, "message": str}`` (pause and continue: SGLang's ``{"message", "status"}``
and ``success``). ``open_group`` is how either side joins: a TCPStore that
rank 0 hosts (port 0 picks a free one) and a gloo (CPU) or NCCL (GPU) process group on it.
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

log = get_logger("sampler.weightsync")

DEFAULT_GROUP = "weight_update_group"  # SGLang's default group_name
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
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
    prefixed = dist.PrefixStore(group_name, store)
    if backend == "gloo":
        return gloo_group(prefixed, rank, world_size, timeout, host)
    if backend == "nccl":  # a real SGLang on GPUs; the embedded sampler is CPU-only and takes gloo
        # torch's stub lists only the (store, rank, size, options) overload; pybind also has (..., timeout=default)
        return dist.ProcessGroupNCCL(prefixed, rank, world_size)  # type: ignore[call-arg]
    raise ValueError(f"backend must be 'gloo' (CPU) or 'nccl' (GPU), got {backend!r}")


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
    """``/pause_generation`` on every sampler (or ``urls``). ``retract`` (ours) keeps running requests alive
    and recomputes them with the new weights at continue; ``in_place`` freezes them with their KV (new weights
    over old KV after an update); ``abort`` (SGLang's default) aborts them."""
    await _every(client, "/pause_generation", {"mode": mode}, urls)


async def continue_generation(client: Any, urls: Sequence[str] | None = None) -> None:
    await _every(client, "/continue_generation", {}, urls)


async def reachable(client: Any, urls: Sequence[str], timeout_s: float = 5.0) -> list[str]:
    """Those of ``urls`` whose ``/health`` answers 200 now (in the given order)."""
    ok: set[str] = set()

    async def one(u: str) -> None:
        try:
            if (await client.get_once(u, "/health", timeout_s=timeout_s)).status_code == 200:
                ok.add(u)
        except httpx.HTTPError:
            pass

    async with anyio.create_task_group() as tg:
        for u in urls:
            tg.start_soon(one, u)
    return [u for u in urls if u in ok]
