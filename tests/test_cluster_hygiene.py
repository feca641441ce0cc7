"""A killed ``cluster up`` leaves nothing behind (design §9): its components carry a parent-death signal, and
the next ``up`` or ``down`` on the run dir stops, by PID, whatever an earlier dead supervisor recorded."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import anyio
import pytest

from t1async.cluster import cli
from t1async.cluster.state import ClusterState, ProcInfo, RunStatus, is_ours, proc_info
from t1async.procs import open_process, pid_alive, popen
from tests.clusterargs import cluster_up


def live_pids_mentioning(text: str) -> list[tuple[int, str]]:
    """Every live (not zombie) process whose cmdline mentions ``text``, but this test process."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if text in cmd and state != "Z":
            out.append((int(d.name), cmd[:200]))
    return out


def wait_until(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(0.1)


def wait_running(run_dir: Path, proc: subprocess.Popen, timeout: float) -> ClusterState:
    state: list[ClusterState] = []

    def running() -> bool:
        assert proc.poll() is None, f"cluster up exited with {proc.returncode}"
        try:
            st = ClusterState.load(run_dir)
        except Exception:  # not written yet
            return False
        state[:] = [st]
        return st.status == RunStatus.RUNNING

    wait_until(running, timeout, f"the cluster in {run_dir} running")
    return state[0]


@pytest.mark.slow
def test_a_sigkilled_cluster_up_takes_every_process_of_its_run_with_it(tmp_path, repo_env):
    """Seen failing on the old code: nats-server, the sampler, the learner and the actor all outlived it."""
    run_dir = tmp_path / "run"
    args = ["--duration", "300", "--synth-tasks", "5", "--max-turns", "4", "--actors", "1", "--concurrency", "1"]
    with cluster_up(run_dir, args, env=repo_env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) as proc:
        st = wait_running(run_dir, proc, timeout=240)
        started = list(st.components.values())
        assert {p.name for p in started} >= {"nats", "sampler", "learner", "actor-0"}
        assert all(is_ours(p) for p in started)
        assert live_pids_mentioning(str(run_dir))
        proc.send_signal(signal.SIGKILL)  # the supervisor only: its components are in sessions of their own
        proc.wait()
        deadline = 10.0
        wait_until(
            lambda: not [p for p in started if is_ours(p)] and not live_pids_mentioning(str(run_dir)),
            deadline,
            f"every process of the run gone: {[p.name for p in started if is_ours(p)]}, "
            f"{live_pids_mentioning(str(run_dir))}",
        )


def sleeper(run_dir: Path) -> subprocess.Popen:
    """A process whose cmdline names the run dir, as a component's does (it is not told to die with us)."""
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)", str(run_dir)])


def stale_state(run_dir: Path, components: dict[str, ProcInfo]) -> None:
    """cluster.json as a SIGKILLed supervisor leaves it: "running", its own PID gone, components recorded."""
    gone = subprocess.Popen(["sleep", "30"])
    sup = proc_info("supervisor", gone.pid)
    gone.kill()
    gone.wait()
    ClusterState(str(run_dir), status=RunStatus.RUNNING, supervisor=sup, components=components).save()


@pytest.mark.parametrize("command", ["down", "up"])
async def test_the_next_up_or_down_reaps_what_a_dead_supervisor_left(tmp_path, command, capsys):
    run_dir = tmp_path / "run"
    left, other = sleeper(run_dir), sleeper(run_dir)
    try:
        mine = proc_info("sampler", left.pid)
        real = proc_info("learner", other.pid)
        recycled = ProcInfo("learner", real.pid, real.cmdline, real.start_ticks + 1)  # same PID, another process
        stale_state(run_dir, {"sampler": mine, "learner": recycled})
        if command == "down":
            assert cli.main(["down", "--run-dir", str(run_dir), "--timeout", "10"]) == 0
        else:
            from t1async.cluster.supervisor import ClusterConfig, Supervisor

            sup = Supervisor(ClusterConfig(run_dir=run_dir, nats_url="nats://127.0.0.1:1", duration_s=0.1))
            with anyio.fail_after(60):
                assert await sup.run() == 0
        out = capsys.readouterr().out
        assert left.wait(10) == -signal.SIGTERM, "the recorded, still-live component was stopped by PID"
        assert f"sampler: stopped (pid {left.pid})" in out and "reaped" in out, out
        assert other.poll() is None, "a PID whose start time differs from the record is never signalled"
        assert ClusterState.load(run_dir).status == RunStatus.STOPPED
    finally:
        for p in (left, other):
            if p.poll() is None:
                p.kill()
                p.wait()


async def test_a_guarded_child_dies_with_its_parent_even_after_an_idle_spawner(tmp_path):
    """PR_SET_PDEATHSIG fires when the forking *thread* exits: a child started from trio (whose worker
    threads exit after 10 s idle) must outlive that thread and die only with the process. Here the parent is
    a trio program that starts a binary (``open_process``) and a Python child (``popen``), says how many trio
    worker threads it has, says "idle" once they are all gone, and is then SIGKILLed."""
    script = tmp_path / "parent.py"
    script.write_text(
        "import sys, threading, trio\n"
        "from t1async.procs import open_process, popen\n"
        "def workers():\n"
        "    return [t for t in threading.enumerate() if t.name.startswith('Trio thread')]\n"
        "async def main():\n"
        "    a = await open_process(['sleep', '300'])\n"
        "    b = popen([sys.executable, '-c', 'import time; time.sleep(300)'])\n"
        "    print(a.pid, b.pid, len(workers()), flush=True)\n"
        "    while workers():\n"
        "        await trio.sleep(0.1)\n"
        "    print('idle', flush=True)\n"
        "    await trio.sleep(300)\n"
        "trio.run(main)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    with open(tmp_path / "pids", "wb") as out:
        parent = await open_process([sys.executable, str(script)], stdout=out, env=env)
    try:
        with anyio.fail_after(60):
            while not (tmp_path / "pids").read_text().endswith("\n"):
                await anyio.sleep(0.05)
        *pids, workers = [int(x) for x in (tmp_path / "pids").read_text().split()]
        assert workers >= 1, "open_process waited on the spawner in a trio worker thread"
        infos = [proc_info(str(p), p) for p in pids]
        with anyio.fail_after(60):  # trio's idle workers exit after 10 s
            while "idle" not in (tmp_path / "pids").read_text():
                await anyio.sleep(0.05)
        assert all(is_ours(i) for i in infos), "a child died with an idle thread, not with its process"
        parent.kill()
        await parent.wait()
        with anyio.fail_after(10):
            while any(is_ours(i) for i in infos):
                await anyio.sleep(0.05)
    finally:
        parent.kill()
        await parent.aclose()


def test_a_missing_program_fails_in_the_parent_as_popen_would():
    with pytest.raises(FileNotFoundError):
        popen(["/nonexistent/nats-server"])


def test_pid_alive_counts_a_running_process_and_not_a_zombie_or_a_gone_one():
    """A stale run's owner that exited but was not reaped yet is gone: reaping its leftovers must not wait on it.
    (A plain ``kill(pid, 0)`` answers yes for a zombie.)"""
    import time

    sleeper = popen(["sleep", "30"])
    try:
        assert pid_alive(sleeper.pid) and pid_alive(os.getpid())
        sleeper.kill()
        deadline = time.monotonic() + 30
        while pid_alive(sleeper.pid):  # a zombie until wait() below: the kill is seen once its state is Z
            assert time.monotonic() < deadline, "a killed child still reads as alive"
            time.sleep(0.01)
        assert os.waitpid(sleeper.pid, os.WNOHANG)[0] == sleeper.pid  # it was a zombie, reaped only now
        sleeper.returncode = -9
    finally:
        if sleeper.returncode is None:
            sleeper.kill()
            sleeper.wait()
    assert not pid_alive(sleeper.pid)
