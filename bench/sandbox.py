"""bench.sandbox: what a sandbox costs an episode, per backend.

    python -m bench.sandbox [--execs N] [--starts K] [--backend bwrap|container|all] [--json]

For each backend: episode start (open + first command; for containers cold = image build included, warm
= image cached), the exec round trip of ``true`` (p50/p99 over N, after a warm-up), and the verifier
time of a small pytest task. Targets (issue 9/11): exec p50 <= 10 ms on both backends, a warm container
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
    return {"p50_ms": float(np.median(a)), "p99_ms": float(np.percentile(a, 99)), "mean_ms": float(a.mean()),
            "n": float(n)}


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
    return {"start_ms": float(np.median(start_s)) * 1000.0, "exec_p50_ms": rt["p50_ms"],
            "exec_p99_ms": rt["p99_ms"], "verify_ms": verify_s * 1000.0}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if args.backend in ("bwrap", "all"):
        out["bwrap"] = await bwrap_bench(args.execs, args.starts)
    if args.backend in ("container", "all"):
        from bench.sandbox_container import container_bench

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
    rows = [(b, *(round(v, 2) for v in r.values())) for b, r in res.items()]
    header = ("backend", *next(iter(res.values())).keys()) if res else ("backend",)
    print_grid(header, rows, title="sandbox costs (ms)")
    flat = {f"{b}_{k}": v for b, r in res.items() for k, v in r.items()}
    if "bwrap" in res:
        flat["exec_p50_ms"] = res["bwrap"]["exec_p50_ms"]
    emit_json(flat)


if __name__ == "__main__":
    main()
