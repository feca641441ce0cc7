"""``python -m bench.sampler ... --json`` run from the repo for tests (``bench``): its JSON last line and its
whole output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def bench(*args: str, timeout: float = 120) -> tuple[dict, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    p = subprocess.run(
        [sys.executable, "-m", "bench.sampler", *args, "--json"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    lines = p.stdout.strip().splitlines()
    return json.loads(lines[-1]), p.stdout
