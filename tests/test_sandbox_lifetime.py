"""A sandbox's shell lives exactly as long as its owner process, under trio and under asyncio.

Each case runs in its own Python process (the "actor"), started with one anyio backend, so the owner can
be SIGKILLed like a real actor and both backends run side by side. Before sandbox_agent/sandbox/spawn.py,
trio's idle worker thread (which had forked bwrap) exited after 10 s and bwrap's death signal killed the shell
with it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sandbox_agent.sandbox import uids

BACKENDS = ("trio", "asyncio")

_HOLD = r"""
import json, sys, time, anyio
from pathlib import Path
from sandbox_agent.sandbox import BwrapSandbox, SandboxConfig

async def gap(root, seconds, out):
    async with BwrapSandbox.open(root / f"gap{seconds}", SandboxConfig()) as sb:
        await sb.exec("export X=kept-$RANDOM; cd /tmp; sleep 1000 & echo $X > /tmp/x")
        await anyio.sleep(seconds)
        r = await sb.exec('echo "$X $PWD $(jobs -r | wc -l) $(cat /tmp/x)"')
        out[f"gap{seconds}"] = [r.output, r.exit_code]

async def long_command(root, out):
    async with BwrapSandbox.open(root / "long", SandboxConfig()) as sb:
        t0 = time.monotonic()
        r = await sb.exec("sleep 30; echo finished", timeout=120)
        out["long"] = [r.output, r.exit_code, r.timed_out, time.monotonic() - t0]

async def main():
    root = Path(sys.argv[2])
    for d in ("gap15", "gap60", "long"):
        (root / d).mkdir()
    out = {}
    async with anyio.create_task_group() as tg:
        tg.start_soon(gap, root, 15, out)
        tg.start_soon(gap, root, 60, out)
        tg.start_soon(long_command, root, out)
    print(json.dumps(out), flush=True)

anyio.run(main, backend=sys.argv[1])
"""

_OWNER = r"""
import sys, anyio
from pathlib import Path
from sandbox_agent.sandbox import BwrapSandbox, SandboxConfig

async def main():
    async with BwrapSandbox.open(Path(sys.argv[2]), SandboxConfig(command_timeout_s=600)) as sb:
        await sb.exec("sleep 1000 & setsid sleep 1000 & trap '' TERM; (trap '' TERM; sleep 1000) &")
        print(sb.uid, flush=True)
        await sb.exec("sleep 1000")  # killed mid-command

anyio.run(main, backend=sys.argv[1])
"""


def _env() -> dict[str, str]:
    root = str(Path(__file__).resolve().parent.parent)
    return {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _run_script(script: str, backend: str, arg: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", script, backend, str(arg)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
    )


def _stop(p: subprocess.Popen[str]) -> None:
    if p.poll() is None:
        p.kill()
    p.wait()


@pytest.mark.slow
def test_shell_state_survives_idle_gaps_and_a_long_command_under_both_backends(tmp_path: Path) -> None:
    runs = {}
    for backend in BACKENDS:
        (tmp_path / backend).mkdir()
        runs[backend] = _run_script(_HOLD, backend, tmp_path / backend)
    try:
        for backend, p in runs.items():
            out, err = p.communicate(timeout=240)
            assert p.returncode == 0, f"{backend}: exit {p.returncode}: {err[-2000:]}"
            res = json.loads(out.strip().splitlines()[-1])
            for g in ("gap15", "gap60"):
                text, rc = res[g]
                assert rc == 0 and len(text.split()) == 4, f"{backend} {g}: the shell lost its state: {text!r}"
                x, pwd, jobs, saved = text.split()
                assert x.startswith("kept-") and x == saved, (backend, g, text)
                assert pwd == "/tmp" and jobs == "1", (backend, g, text)  # cwd and the background job too
            text, rc, timed_out, took = res["long"]
            assert (text, rc, timed_out) == ("finished\n", 0, False), (backend, res["long"])
            assert took >= 30, (backend, took)
    finally:
        for p in runs.values():
            _stop(p)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sigkilled_owner_leaves_no_process_of_the_slot_uid(tmp_path: Path, backend: str) -> None:
    p = _run_script(_OWNER, backend, tmp_path)
    try:
        assert p.stdout is not None
        line = "-"
        while line and not line.strip().isdigit():  # log lines share stdout; the uid line ends them
            line = p.stdout.readline()
        assert line, f"the owner exited before its sandbox ran: {p.communicate()[1][-2000:]}"
        uid = int(line)
        deadline = time.monotonic() + 10.0  # the last command starts: its sleepers appear (an external process)
        while len(uids.uid_pids(uid)) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(uids.uid_pids(uid)) >= 4, "the sandbox should be running the shell and three sleepers"
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
        deadline = time.monotonic() + 5.0
        left = uids.uid_pids(uid, include_zombies=True)
        while left and time.monotonic() < deadline:
            time.sleep(0.05)
            left = uids.uid_pids(uid, include_zombies=True)
        assert not left, f"processes of uid {uid} survived their owner's SIGKILL: {sorted(left)}"
    finally:
        _stop(p)
