"""bench.sandbox: what a sandbox costs an episode, per backend.

    python -m bench.sandbox [--execs N] [--starts K] [--backend bwrap|container|all] [--json]

For each backend: episode start (open + first command; for containers cold = image build included, warm
= image cached), the exec round trip of ``true`` (p50/p99 over N, after a warm-up), and the verifier
time of a small pytest task. Targets: exec p50 <= 10 ms on both backends, a warm container
episode start <= 1 s. The last line is JSON.

``exec_roundtrip(sb, n)`` is the helper other benches (bench.longhorizon) call on any open sandbox.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import numpy as np

from bench._common import emit_json, print_grid
from sandbox_agent.sandbox import BwrapSandbox, Sandbox, SandboxConfig


async def exec_roundtrip(sb: Sandbox, n: int = 200, command: str = "true", warmup: int = 5) -> dict[str, float]:
    """Round trip of ``command`` in an open sandbox: {'p50_ms', 'p99_ms', 'mean_ms', 'n'}."""
    for _ in range(warmup):
        await sb.exec(command)
    took = []
    for _ in range(n):
        t0 = time.perf_counter()
        r = await sb.exec(command)
        took.append(time.perf_counter() - t0)
        if r.exit_code != 0:
            raise RuntimeError(f"{command!r} failed in the sandbox: exit {r.exit_code}: {r.output[:200]}")
    a = np.asarray(took) * 1000.0
    return {
        "p50_ms": float(np.median(a)),
        "p99_ms": float(np.percentile(a, 99)),
        "mean_ms": float(a.mean()),
        "n": float(n),
    }


async def bwrap_bench(execs: int, starts: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-sandbox-") as tmp:
        root = Path(tmp)
        start_s = []
        for i in range(starts):
            d = root / f"start{i}"
            d.mkdir()
            t0 = time.perf_counter()
            async with BwrapSandbox.open(d, SandboxConfig()) as sb:
                await sb.exec("true")
                start_s.append(time.perf_counter() - t0)
        d = root / "rt"
        d.mkdir()
        async with BwrapSandbox.open(d, SandboxConfig()) as sb:
            rt = await exec_roundtrip(sb, execs)
            (d / "test_ok.py").write_text("def test_a():\n    assert 1\n\ndef test_b():\n    assert 2\n")
            t0 = time.perf_counter()
            r = await sb.exec("python3 -m pytest -q -p no:cacheprovider test_ok.py", timeout=120)
            verify_s = time.perf_counter() - t0
            if r.exit_code != 0:
                raise RuntimeError(f"pytest failed in the sandbox: {r.output[-500:]}")
    return {
        "start_ms": float(np.median(start_s)) * 1000.0,
        "exec_p50_ms": rt["p50_ms"],
        "exec_p99_ms": rt["p99_ms"],
        "verify_ms": verify_s * 1000.0,
    }


def _bench_task(root: Path, salt: str) -> Path:
    """A TB2 task whose image needs a build (a RUN step), unique per ``salt`` so the first start is cold."""
    t = root / f"bench-{salt}"
    (t / "environment").mkdir(parents=True)
    (t / "tests").mkdir()
    (t / "instruction.md").write_text("Nothing to do.\n")
    (t / "task.toml").write_text('version = "1.0"\n[verifier]\ntimeout_sec = 120.0\n')
    (t / "environment" / "Dockerfile").write_text(
        f"FROM python:3.11-slim\nWORKDIR /app\nRUN echo {salt} > /app/salt.txt\n"
    )
    (t / "tests" / "test_outputs.py").write_text(
        "from pathlib import Path\n\ndef test_a():\n    assert Path('/app/salt.txt').exists()\n\n"
        "def test_b():\n    assert 1\n"
    )
    return t


async def container_bench(execs: int, starts: int) -> dict[str, Any]:
    import secrets

    from sandbox_agent.agent.runner import prepared_workdir
    from sandbox_agent.images import build as images
    from sandbox_agent.sandbox.backend import ContainerBackend
    from sandbox_agent.tasks.task import load_task
    from sandbox_agent.tasks.verifier import verify

    images.build_base()
    backend = ContainerBackend()
    with tempfile.TemporaryDirectory(prefix="bench-sandbox-") as tmp:
        task = load_task(_bench_task(Path(tmp), secrets.token_hex(4)))
        tag = images.task_image_tag(task)
        try:
            t0 = time.perf_counter()
            async with prepared_workdir(task, backend) as wd, backend.open(task, wd) as sb:
                await sb.exec("true")
                cold_s = time.perf_counter() - t0
            warm = []
            for _ in range(starts):
                t0 = time.perf_counter()
                async with prepared_workdir(task, backend) as wd, backend.open(task, wd) as sb:
                    await sb.exec("true")
                    warm.append(time.perf_counter() - t0)
            async with prepared_workdir(task, backend) as wd:
                async with backend.open(task, wd) as sb:
                    rt = await exec_roundtrip(sb, execs)
                t0 = time.perf_counter()
                v = await verify(task, wd, backend)
                verify_s = time.perf_counter() - t0
                if not v.resolved:
                    raise RuntimeError(f"the bench task's verifier failed: {v}")
        finally:
            images.run_podman("rmi", "-f", tag, check=False)
    return {
        "start_cold_ms": cold_s * 1000.0,
        "start_ms": float(np.median(warm)) * 1000.0,
        "exec_p50_ms": rt["p50_ms"],
        "exec_p99_ms": rt["p99_ms"],
        "verify_ms": verify_s * 1000.0,
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if args.backend in ("bwrap", "all"):
        out["bwrap"] = await bwrap_bench(args.execs, args.starts)
    if args.backend in ("container", "all"):
        out["container"] = await container_bench(args.execs, args.starts)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.sandbox", description=__doc__.split("\n\n")[0])
    ap.add_argument("--execs", type=int, default=300, help="exec round trips to time (default 300)")
    ap.add_argument("--starts", type=int, default=5, help="episode starts to time (default 5)")
    ap.add_argument("--backend", choices=("bwrap", "container", "all"), default="bwrap")
    ap.add_argument("--json", action="store_true", help="(the JSON line is always printed last)")
    args = ap.parse_args(argv)
    res = anyio.run(run, args)
    keys = ["start_cold_ms", "start_ms", "exec_p50_ms", "exec_p99_ms", "verify_ms"]
    rows = [(b, *(round(r[k], 2) if k in r else "-" for k in keys)) for b, r in res.items()]
    print_grid(("backend", *keys), rows, title="sandbox costs (ms; start = open + first `true`, warm image)")
    flat = {f"{b}_{k}": v for b, r in res.items() for k, v in r.items()}
    flat["exec_p50_ms"] = max(r["exec_p50_ms"] for r in res.values())  # the worse backend's
    if "container" in res:
        flat["container_warm_start_ms"] = res["container"]["start_ms"]
    emit_json(flat)


if __name__ == "__main__":
    main()
