#!/usr/bin/env bash
# The GPU check, prepared for the day a GPU is lent (issue: "a learner that holds a real checkpoint", item 8).
# UNTESTED: no GPU has run it yet. Runs in under 8 minutes on one H100/H200, from the repo root, with the
# device image's python3 (torch, transformers, safetensors, tokenizers, httpx are there). What t1async imports
# beyond those (structlog, msgpack) travels as wheels: make them here once with
#   pip download --no-deps -d .gpu-wheels structlog msgpack
# and carry .gpu-wheels. Each figure is one JSON line on stdout.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ -d .gpu-wheels ]; then
    $PY -m pip install -q --no-index --no-deps --target /tmp/t1-gpu-site .gpu-wheels/*.whl || true
    export PYTHONPATH="$PWD:/tmp/t1-gpu-site${PYTHONPATH:+:$PYTHONPATH}"
else
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null \
    | sed 's/^/{"check": "nvidia-smi", "gpu": "/; s/$/"}/'
# 1. a CUDA learner step in bf16 on the ~1.7 B Qwen3-MoE, and the SDPA kernel that ran
timeout 420 $PY -m bench.gpu_step --layers 16 --tokens 4096 || echo '{"check": "learner_step", "ok": false}'
# 2. a push into a GPU vLLM, if one is installed there (none is in the image; nothing can be fetched)
if $PY -c "import vllm" 2>/dev/null; then
    timeout 300 $PY -m bench.mismatch --quick --engine vllm --json | tail -1 \
        | $PY -c 'import json,sys; d=json.loads(sys.stdin.read()); print(json.dumps({"check": "vllm_push", "ok": True, "modes": {k: v["mean_abs_dlogp"] for k, v in d["modes"].items()}}))'
else
    echo '{"check": "vllm_push", "ok": false, "why": "vllm is not installed on this machine"}'
fi
