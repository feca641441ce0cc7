"""A real architecture through the whole loop: transformers builds a tiny Qwen3-MoE (random weights, no
download), ``cluster up --model DIR`` serves and trains it with TITO and R3 for two steps, and the checkpoint
the learner writes is one transformers loads, with our logits."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from t1async.credits.settle import read_step_log
from t1async.learner.checkpoint import latest_checkpoint
from t1async.model.tokenizer import ChatTokenizer
from t1async.model.weights import default_model_dir, load_pretrained
from tests.clusterargs import cluster_up

pytestmark = pytest.mark.slow
transformers = pytest.importorskip("transformers")  # a dev dependency: the reference implementation


def tiny_qwen3(d: Path) -> Path:
    """A Qwen3MoeForCausalLM dir as transformers writes it, with the shipped tokenizer beside it."""
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=ChatTokenizer.load().vocab_size,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        mlp_only_layers=[1],  # one dense layer: its routing rows are zeros on both sides
        max_position_embeddings=8192,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(d)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir() / f, d / f)
    return d


def test_cluster_up_trains_a_transformers_qwen3_moe_and_writes_a_checkpoint_transformers_loads(tmp_path, repo_env):
    model = tiny_qwen3(tmp_path / "qwen3")
    run = tmp_path / "run"
    args = ["--model", str(model), "--steps", "2", "--batch-turns", "4", "--synth-tasks", "6", "--max-turns", "3"]
    args += ["--actors", "1", "--concurrency", "2", "--max-new-tokens", "16", "--plain"]
    with cluster_up(run, args, env=repo_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-3000:]
    assert "learner finished" in out.splitlines()[-1], out[-2000:]
    ckpt = latest_checkpoint(run / "checkpoints")
    assert ckpt is not None and ckpt.policy_version == 2
    config = json.loads((ckpt.path / "config.json").read_text())
    assert config["architectures"] == ["Qwen3MoeForCausalLM"]
    # the steps trained sampled tokens with no loss-region drift (TITO) and the recorded routes (R3)
    steps = read_step_log(run / "learner" / "steps.jsonl")
    assert sorted(steps) == [0, 1] and all(s["turns"] for s in steps.values())
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    drift = [m["drift"] for m in metrics if m.get("component") == "learner" and "drift" in m][-1]
    assert drift["clean"] > 0 and drift["realign"] == 0, drift  # every turn boundary exact: nothing re-tokenized
    # transformers loads what the learner wrote, and computes our logits
    ref = transformers.AutoModelForCausalLM.from_pretrained(ckpt.path, dtype=torch.float32).eval()
    ours = load_pretrained(ckpt.path)
    ids = torch.tensor([[5, 17, 300, 9, 44, 1000, 2, 3]])
    with torch.no_grad():
        want = ref(input_ids=ids).logits
        got = ours(ids).logits
    assert torch.max(torch.abs(want - got)) <= 1e-4
    trained = load_pretrained(model)
    with torch.no_grad():
        before = trained(ids).logits
    assert torch.max(torch.abs(before - got)) > 1e-6  # the two steps changed the weights
