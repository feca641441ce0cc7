"""bench.gpu_step, the GPU check's learner step, as far as this CPU-only box can check it: the SDPA kernel is
read from real kernel names, and without CUDA it says so in its JSON line and fails (bench/gpu_check.sh)."""

from __future__ import annotations

import json

from bench.gpu_step import main, sdpa_kernel


def test_the_sdpa_kernel_is_named_from_the_kernels_that_ran():
    assert sdpa_kernel(["void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits>", "ampere_bf16_gemm"]) == "flash"
    assert sdpa_kernel(["fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel)"]) == (
        "mem_efficient"
    )
    assert sdpa_kernel(["cudnn_generated_fort_native_sdpa_sm90_flash_fprop"]) == "cudnn"
    assert sdpa_kernel(["sm90_xmma_gemm_bf16bf16_bf16f32", "softmax_warp_forward"]) == "math"


def test_without_cuda_it_says_so_and_fails(capsys):
    assert main(["--layers", "1"]) == 1
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line == {"check": "cuda", "ok": False, "why": "torch sees no CUDA device"}
