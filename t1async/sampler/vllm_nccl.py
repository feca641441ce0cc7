"""The NCCL weight push into vLLM, by vLLM's own trainer side (``--engine vllm --weight-sync distributed``).

**Untested: no GPU has run this code.** It needs CUDA, and vLLM importable in the learner's own environment (its
``NCCLTrainerWeightTransferEngine`` opens rank 0 with vLLM's ``StatelessProcessGroup``/``PyNcclCommunicator``, the
rendezvous vLLM's workers expect: ``vllm/distributed/weight_transfer/nccl_engine.py``). The round, as that engine
drives it over vLLM's RL endpoints: ``/init_weight_transfer_engine`` once (the workers join at rank offset 1),
then per push ``/pause?mode=M``, ``/start_weight_update``, ``/update_weights`` {names, dtype_names, shapes} while
rank 0 broadcasts, ``/finish_weight_update`` with the version, ``/resume``. On CPU (vLLM-CPU, and this project's
CI) the disk push (``VLLMClient.update_weights_from_disk``) is the one that runs.

The names sent are the served model's (``learner.weightpush.push_tensors``: the hub names of a Hugging Face
architecture), in bf16 when the learner trains in bf16.
"""

from __future__ import annotations

from typing import Any

import anyio
import torch

from t1async.log import get_logger
from t1async.protocol.errors import ConfigError
from t1async.sampler.vllm_client import PAUSE_MODES

log = get_logger("sampler.vllm_nccl")


class _NamedSource:
    """vLLM's ``WeightSource`` over a fixed list of (name, tensor): re-iterable, metadata without transfer."""

    def __init__(self, named: list[tuple[str, torch.Tensor]]) -> None:
        self.named = named

    def __iter__(self) -> Any:
        return ((n, t.contiguous()) for n, t in self.named)

    def metadata(self) -> list[Any]:
        from vllm.distributed.weight_transfer.base import ParamMeta

        return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in self.named]


class VLLMNcclPusher:
    """One vLLM server's NCCL weight push (UNTESTED: see the module's docstring)."""

    def __init__(self, url: str, *, host: str, port: int, world_size: int = 2, pause_mode: str = "retract") -> None:
        if not torch.cuda.is_available():
            raise ConfigError("the NCCL push into vLLM needs CUDA: on CPU use --weight-sync disk")
        try:
            import vllm.distributed.weight_transfer.nccl_engine  # noqa: F401
        except ImportError as exc:
            raise ConfigError(
                f"the NCCL push into vLLM needs vLLM importable in the learner's environment: {exc}"
            ) from exc
        self.url, self.host, self.port, self.world_size = url.rstrip("/"), host, port, world_size
        self.pause, self.recompute = PAUSE_MODES[pause_mode]
        self.engine: Any = None

    def _round(self, named: list[tuple[str, torch.Tensor]], version: int) -> None:
        import httpx
        from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo, NCCLTrainerWeightTransferEngine

        client = HTTPVLLMWeightSyncClient(self.url)
        if self.engine is None:
            info = NCCLTrainerInitInfo(self.host, self.port, self.world_size, rank=0)
            self.engine = NCCLTrainerWeightTransferEngine.trainer_init(info, client=client, source=_NamedSource(named))
        else:
            self.engine.source = _NamedSource(named)
        with httpx.Client(timeout=300) as http:
            http.post(f"{self.url}/pause", params=self.pause).raise_for_status()
            try:
                self.engine.send_weights()  # start_weight_update, update_weights || broadcast, finish_weight_update
                if self.recompute:
                    http.post(f"{self.url}/reset_prefix_cache", params={"reset_running_requests": "true"})
                http.post(f"{self.url}/update_weight_version", json={"new_version": str(version)}).raise_for_status()
            finally:
                http.post(f"{self.url}/resume")

    async def push(self, model: torch.nn.Module, policy_version: int, dtype: torch.dtype | None = None) -> dict:
        from t1async.learner.weightpush import push_tensors

        named = [(n, t.to(dtype) if dtype is not None else t) for n, t in push_tensors(model)]
        await anyio.to_thread.run_sync(self._round, named, policy_version)
        log.info("learner.weights_pushed", path="vllm-nccl", policy_version=policy_version, tensors=len(named))
        return {"policy_version": policy_version, "tensors": len(named)}

    async def aclose(self) -> None:
        if self.engine is not None:
            await anyio.to_thread.run_sync(self.engine.shutdown)
            self.engine = None
