"""t1async's vLLM worker extension: ``--worker-extension-cls t1async_vllm.T1WorkerExtension``, with this
directory on the vLLM server's ``PYTHONPATH`` (t1async.sampler.vllm_launch sets both). It runs inside vLLM's
own environment, so it imports only vLLM and torch, never t1async.

``t1_reload_weights(weights_path)`` is vLLM's ``reload_weights`` plus the step vLLM 0.32 skips on a reload:
on the CPU, ``UnquantizedFusedMoEMethod._setup_kernel`` runs the experts' ``process_weights_after_loading``
(``CPUUnquantizedExperts``: prepack w13/w2 into the grouped-GEMM layout) only on the first load, so after a
reload every MoE layer's experts sit in checkpoint layout while the kernel reads them as prepacked: the served
policy changes silently (docs/vllm-cpu-moe-reload.md). Called through ``POST /collective_rpc`` {"method":
"t1_reload_weights", "kwargs": {"weights_path": DIR}}; returns how many MoE layers it repacked.
"""

from __future__ import annotations

import os
from typing import Any

ROOTS_ENV = "T1_ALLOWED_WEIGHT_ROOTS"  # os.pathsep-separated; set by t1async.sampler.vllm_launch


def check_root(path: str) -> str:
    """``path`` resolved, if it lies under one of ``$T1_ALLOWED_WEIGHT_ROOTS`` (symlinks and ``..`` resolved);
    else ValueError naming the roots. Unset: any path (a server t1async did not start)."""
    roots = [r for r in os.environ.get(ROOTS_ENV, "").split(os.pathsep) if r]
    real = os.path.realpath(path)
    if roots and not any(os.path.commonpath([real, os.path.realpath(r)]) == os.path.realpath(r) for r in roots):
        raise ValueError(f"weights {path} are outside the allowed weight roots {roots} ({ROOTS_ENV})")
    return real


class T1WorkerExtension:
    """Mixed into vLLM's worker class by ``--worker-extension-cls``: ``self`` is the worker."""

    def t1_reload_weights(self, weights_path: str) -> dict[str, Any]:
        from vllm.platforms import current_platform

        runner: Any = self.model_runner  # type: ignore[attr-defined]
        runner.reload_weights(weights_path=check_root(weights_path))
        repacked = 0
        if current_platform.is_cpu():  # on GPUs the experts' process_weights_after_loading is a no-op
            for module in runner.get_model().modules():
                kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
                if kernel is None or not hasattr(module, "w13_weight"):
                    continue
                kernel.fused_experts.process_weights_after_loading(module)
                repacked += 1
        return {"repacked_moe_layers": repacked}
