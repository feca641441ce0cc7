"""The cluster CLI: help and errors, `up`/`status`/`down` on a real nats-server, `tail` on live records."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import anyio
import pytest

from t1async.cluster import cli
from t1async.cluster.state import ClusterState
from t1async.procs import pid_alive
from t1async.testing.harness import end, start, turn
from t1async.transport import NatsTransport, traj_subject
from tests.cluster_watch import read_until
from tests.clusterargs import stop_cluster, up_argv


@pytest.mark.parametrize(
    ("argv", "expect"),
    [
        ([], "up|down|status|tail"),
        (["up"], "--duration"),
        (["down"], "SIGTERM"),
        (["status"], "Exit status 0"),
        (["tail"], "--episode"),
    ],
)
def test_every_subcommand_explains_itself(argv, expect, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main([*argv, "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert expect in out and "--run-dir" in (out if argv else "--run-dir")


def test_wrong_flags_and_values_give_clear_errors(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["up", "--bogus"])
    assert info.value.code == 2 and "--bogus" in capsys.readouterr().err
    assert cli.main(["up", "--duration", "-1", "--run-dir", str(tmp_path)]) == 2
    assert "--duration must be > 0" in capsys.readouterr().err
    assert cli.main(["tail", "--run-dir", str(tmp_path / "none")]) == 2
    assert "no --nats given" in capsys.readouterr().err
    assert cli.main(["status", "--run-dir", str(tmp_path / "none")]) == 2
    assert "cluster up --run-dir" in capsys.readouterr().err


def test_the_module_runs_as_a_program(repo_env):
    res = subprocess.run(
        [sys.executable, "-m", "t1async.cluster", "--help"], capture_output=True, text=True, env=repo_env, timeout=60
    )
    assert res.returncode == 0 and "up|down|status|tail" in res.stdout


def _wait_running(run_dir, proc, timeout: float = 180.0) -> ClusterState:
    """Until the run's state file says running; ``timeout`` only bounds a hang (a loaded CI box took > 20 s)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        try:
            state = ClusterState.load(run_dir)
            if state.status == "running":
                return state
        except Exception:  # the file does not exist yet
            pass
        time.sleep(0.1)
    raise AssertionError(f"cluster in {run_dir} did not come up")


def _stop(proc, run_dir) -> None:
    stop_cluster(proc, run_dir, 10)


def test_up_status_down(tmp_path, repo_env, capsys):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [
            *up_argv(run_dir),
            "--duration",
            "600",  # only if `down` fails: the test stops it
        ],
        env=repo_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        state = _wait_running(run_dir, proc)
        nats_pid = state.components["nats"].pid
        assert cli.main(["status", "--run-dir", str(run_dir), "--json"]) == 0
        st = json.loads(capsys.readouterr().out)
        assert st["running"] and st["healthz"] == "ok" and st["nats_url"].startswith("nats://127.0.0.1:")
        assert st["processes"]["nats"]["alive"] and st["processes"]["supervisor"]["pid"] == proc.pid
        assert cli.main(["down", "--run-dir", str(run_dir)]) == 0
        assert "supervisor: stopped" in capsys.readouterr().out
        assert proc.wait(15) == 0
        assert not pid_alive(nats_pid)
        assert cli.main(["status", "--run-dir", str(run_dir)]) == cli.EXIT_NOT_RUNNING
        assert (run_dir / "logs" / "nats-server.log").exists() and (run_dir / "logs" / "supervisor.jsonl").exists()
    finally:
        _stop(proc, run_dir)


def test_up_stops_by_itself_after_duration(tmp_path, repo_env):
    run_dir = tmp_path / "run"
    res = subprocess.run(
        [
            *up_argv(run_dir),
            "--duration",
            "1",
        ],
        env=repo_env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    assert "cluster up: nats nats://" in res.stdout and "cluster stopped" in res.stdout
    state = ClusterState.load(run_dir)
    assert state.status == "stopped" and not state.components


@pytest.mark.parametrize("as_json", [False, True])
async def test_tail_prints_decoded_records_and_one_line_per_malformed_message(
    nats_server, nats_raw_publish, repo_env, as_json
):
    argv = [sys.executable, "-m", "t1async.cluster", "tail", "--nats", nats_server.url, "--no-text"] + (
        ["--json"] if as_json else []
    )
    async with await anyio.open_process(argv, env=repo_env) as proc:
        try:
            out, err = bytearray(), bytearray()
            await read_until(proc.stderr, err, b"# tailing t1.traj.>")
            async with NatsTransport(nats_server.url) as t:
                await t.publish(traj_subject("ep-t"), start("ep-t"))
                await t.publish(traj_subject("ep-t"), turn("ep-t", 0))
                await nats_raw_publish(nats_server.url, "t1.traj.ep-t", b"\xc1junk")
                await t.publish(traj_subject("ep-t"), turn("ep-t", 1))
                await t.publish(traj_subject("ep-t"), end("ep-t", 2))
            await read_until(proc.stdout, out, b"solved")
            proc.send_signal(signal.SIGINT)
            with anyio.fail_after(10):
                rc = await proc.wait()
        finally:
            if proc.returncode is None:
                proc.kill()
    assert rc in (0, 130)
    lines = out.decode().splitlines()
    if as_json:
        objs = [json.loads(x) for x in lines]
        assert [o.get("kind", "error") for o in objs] == ["start", "turn", "error", "turn", "end"]
        assert objs[1]["output_ids"] == [100, 101, 102] and objs[1]["routing"] == {
            "start": 0,
            "dtype": "u1",
            "shape": [6, 2, 2],
        }
        assert objs[2]["reason"] == "msgpack" and objs[2]["subject"] == "t1.traj.ep-t"
        return
    heads = [x.split()[0] for x in lines if not x.startswith(" ")]
    assert heads == ["start", "turn", "!", "turn", "end"], lines
    t0, t1 = [x for x in lines if x.startswith("turn")]
    assert "ep=ep-t t=0 v=1 in=4 keep=0 delta=4 out=3" in t0 and "routing start=0 rows=6" in t0
    assert "prev=7" in t1 and "DRIFT keep-prev=+3" not in t1 and "GAP keep-prev=+3" in t1  # keep 10 vs 7 seen
    assert any(x.strip() == "action: ls" for x in lines)
    bad = next(x for x in lines if x.startswith("!"))
    assert "t1.traj.ep-t" in bad and "[msgpack]" in bad and "(5 bytes)" in bad


def _small_cluster(run_dir, env, *extra: str) -> subprocess.Popen:
    """``cluster up`` with one actor on 5 small tasks for at most 120 s, its output piped."""
    argv = [
        *up_argv(run_dir),
        "--duration",
        "120",
    ]
    argv += ["--synth-tasks", "5", "--max-turns", "4", "--actors", "1", "--concurrency", "1", *extra]
    return subprocess.Popen(
        argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )


@pytest.mark.slow
def test_a_dying_component_is_restarted_and_a_crash_loop_ends_the_run_with_one_line(tmp_path, repo_env):
    """A SIGKILLed learner is restarted (a new PID in cluster.json); past --max-restarts the next death ends
    the run, and the terminal shows that in words; the supervisor's log lines stay in its file."""
    run_dir = tmp_path / "run"
    proc = _small_cluster(run_dir, repo_env, "--max-restarts", "1")
    try:
        state = _wait_running(run_dir, proc)
        first = state.components["learner"].pid
        os.kill(first, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while (learner := ClusterState.load(run_dir).components["learner"].pid) == first:
            assert proc.poll() is None, "one death within the budget must not stop the run"
            assert time.monotonic() < deadline, "the learner was not restarted"
            time.sleep(0.2)
        os.kill(learner, signal.SIGKILL)
        out, err = proc.communicate(timeout=60)
    finally:
        _stop(proc, run_dir)
    assert proc.returncode == 1
    assert out.splitlines()[-1].startswith(
        f"cluster stopped: learner (pid {learner}) exited with code -9 (restarted 1 times in 600 s already); see "
    ), out
    raw = [x for x in (out + err).splitlines() if x.startswith("{") or "[error" in x or "component_exited" in x]
    assert not raw, raw
    assert "cluster.component_exited" in (run_dir / "logs" / "supervisor.jsonl").read_text()


@pytest.mark.slow
def test_a_hang_up_stops_the_cluster_instead_of_orphaning_it(tmp_path, repo_env):
    """Closing the terminal (SIGHUP) stops every component, as Ctrl-C does; the components run in their own
    sessions, so a supervisor killed by the hang-up used to leave them all running."""
    run_dir = tmp_path / "run"
    proc = _small_cluster(run_dir, repo_env)
    started = []
    try:
        state = _wait_running(run_dir, proc)
        started = list(state.components.values())
        proc.send_signal(signal.SIGHUP)
        out, _ = proc.communicate(timeout=90)
    finally:
        _stop(proc, run_dir)
        for info in started:  # never leave them behind, whatever happened
            if pid_alive(info.pid):
                os.kill(info.pid, signal.SIGKILL)
    assert proc.returncode == 0 and out.splitlines()[-1] == "cluster stopped", out
    assert {i.name for i in started} >= {"nats", "sampler", "learner", "actor-0"}
    deadline = time.monotonic() + 10
    while any(pid_alive(i.pid) for i in started) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [i.name for i in started if pid_alive(i.pid)]


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGTERM], ids=["SIGHUP", "SIGTERM"])
async def test_a_stop_signal_sent_as_soon_as_the_run_dir_says_running_is_heard(tmp_path, monkeypatch, sig):
    """A hang-up or `down` that reads "running" and signals at once stops the cluster. The supervisor used to
    write "running" before it listened, with SIGHUP still ignored from the start-up: a hang-up in that window
    was lost and the cluster ran to its --duration (CI, test_a_hang_up_stops_the_cluster...)."""
    from t1async.cluster.supervisor import ClusterConfig, Supervisor

    save = ClusterState.save

    def save_then_signal(self):
        save(self)
        if self.status == "running":
            os.kill(os.getpid(), sig)

    monkeypatch.setattr(ClusterState, "save", save_then_signal)
    sup = Supervisor(ClusterConfig(run_dir=tmp_path / "run", nats_url="nats://127.0.0.1:1", duration_s=60))
    with anyio.fail_after(20):  # the old supervisor ignored the signal and ran its 60 s
        assert await sup.run() == 0
    assert ClusterState.load(tmp_path / "run").status == "stopped"
