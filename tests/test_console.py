"""``t1async COMMAND``: the console script runs each module exactly as ``python -m`` does."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from t1async.__main__ import bench_names, resolve

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = Path(sys.executable).parent / "t1async"  # [project.scripts], installed by pip install -e .


def run(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=180)


def test_commands_map_to_the_modules_python_m_runs():
    assert resolve(["up", "--steps", "3"]) == ("t1async.cluster", ["up", "--steps", "3"])
    assert resolve(["tail", "--json"]) == ("t1async.cluster", ["tail", "--json"])
    assert resolve(["eval", "--tasks", "T"]) == ("t1async.eval", ["--tasks", "T"])
    assert resolve(["sandbox", "check", "D"]) == ("sandbox_agent", ["check", "D"])
    assert resolve(["bench", "mismatch", "--quick"]) == ("bench.mismatch", ["--quick"])
    assert {"mismatch", "sampler", "chaos"} <= set(bench_names()) and "_common" not in bench_names()
    for bad, says in ((["frob"], "unknown command 'frob'"), (["bench"], "none given"), (["bench", "x"], "'x'")):
        with pytest.raises(ValueError, match=says):
            resolve(bad)


@pytest.mark.parametrize(
    ("console", "module"),
    [
        (["up", "--help"], ["t1async.cluster", "up", "--help"]),
        (["bench", "journal", "--help"], ["bench.journal", "--help"]),
    ],
)
def test_the_script_prints_what_python_m_prints(console, module):
    assert SCRIPT.exists(), f"{SCRIPT} is missing: pip install -e . installs it ([project.scripts])"
    mine, theirs = run([str(SCRIPT), *console]), run([sys.executable, "-m", *module])
    assert mine.returncode == theirs.returncode == 0, mine.stderr[-500:]
    body = lambda out: out[out.index("\n") :]  # noqa: E731 - the usage line names the program, the rest is the same
    assert body(mine.stdout) == body(theirs.stdout) and "--help" in mine.stdout


def test_exit_status_and_errors_are_the_modules_own(tmp_path):
    missing = ["status", "--run-dir", str(tmp_path / "none")]
    mine, theirs = run([str(SCRIPT), *missing]), run([sys.executable, "-m", "t1async.cluster", *missing])
    assert mine.returncode == theirs.returncode != 0 and mine.stderr == theirs.stderr, (mine, theirs)
    bad = run([sys.executable, "-m", "t1async", "frob"])
    assert bad.returncode == 2 and "unknown command 'frob'" in bad.stderr and "bench NAME" in bad.stderr


def test_the_benches_are_not_installed_and_say_where_they_run(tmp_path):
    """bench/ stays out of the wheel (no top-level ``bench`` to clash with another package's): outside a
    checkout ``t1async bench`` says where the benches run."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run(
        [sys.executable, "-m", "t1async", "bench", "sampler"], capture_output=True, text=True, cwd=tmp_path, env=env
    )
    assert out.returncode == 2 and "source checkout" in out.stderr, (out.stdout, out.stderr)
    ok = subprocess.run([sys.executable, "-c", "import actors, sandbox_agent"], cwd=tmp_path, env=env)
    assert ok.returncode == 0, "actors and sandbox_agent are installed (cluster up runs them)"
