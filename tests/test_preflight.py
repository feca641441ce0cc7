"""`cluster up` checks every outside dependency before it starts anything: each failure is one line on
stderr that names the flag and says what to do, and nothing was started or synthesized."""

from __future__ import annotations

import http.server
import subprocess
import threading
import time
from pathlib import Path

import pytest

from t1async.cluster import cli, preflight
from t1async.protocol.errors import ConfigError
from t1async.transport.natsd import find_binary, free_port
from tests.clusterargs import up_argv


def up(tmp_path: Path, repo_env: dict, *flags: str) -> subprocess.CompletedProcess:
    argv = [
        *up_argv(tmp_path / "run"),
        "--duration",
        "30",
        "--preset",
        "none",
        *flags,
    ]
    return subprocess.run(argv, capture_output=True, text=True, env=repo_env, timeout=120)


def assert_one_line_and_nothing_started(res: subprocess.CompletedProcess, tmp_path: Path, *needles: str) -> None:
    assert res.returncode == 2, (res.stdout, res.stderr)
    err = res.stderr.splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), res.stderr
    assert "{" not in err[0], "no raw log line"
    for n in needles:
        assert n in err[0], err[0]
    run = tmp_path / "run"
    assert not (run / "tasks").exists() and not (run / "cluster.json").exists(), "nothing was synthesized or started"
    assert "cluster up:" not in res.stdout


def test_up_with_nothing_listening_at_nats_fails_first(tmp_path, repo_env):
    port = free_port()
    res = up(tmp_path, repo_env, "--nats", f"nats://127.0.0.1:{port}")
    assert_one_line_and_nothing_started(
        res, tmp_path, f"--nats nats://127.0.0.1:{port}: no NATS server answers", "leave out --nats"
    )


@pytest.fixture
def nats_without_jetstream(tmp_path):
    port = free_port()
    proc = subprocess.Popen(
        [str(find_binary()), "-a", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                preflight._nats_info("127.0.0.1", port, 1.0)
                break
            except OSError:
                assert time.monotonic() < deadline and proc.poll() is None, "nats-server did not start"
                time.sleep(0.1)
        yield f"nats://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)


def test_nats_without_jetstream_is_named(nats_without_jetstream):
    with pytest.raises(ConfigError, match="runs without JetStream: restart it with `nats-server -js`"):
        preflight.check_nats(nats_without_jetstream)


def test_nats_checks_pass_on_a_real_server_and_reject_bad_urls(nats_server_sync):
    preflight.check_nats(nats_server_sync)
    preflight.check_nats(f"nats://127.0.0.1:{free_port()},{nats_server_sync}")  # one of the cluster answers
    with pytest.raises(ConfigError, match="is not a NATS URL"):
        preflight.check_nats("http://127.0.0.1:4222")


@pytest.fixture
def nats_server_sync(tmp_path):
    """A real nats-server with JetStream, for the synchronous checks."""
    port = free_port()
    proc = subprocess.Popen(
        [str(find_binary()), "-a", "127.0.0.1", "-p", str(port), "-js", "-sd", str(tmp_path / "js")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                preflight._nats_info("127.0.0.1", port, 1.0)
                break
            except OSError:
                assert time.monotonic() < deadline and proc.poll() is None, "nats-server did not start"
                time.sleep(0.1)
        yield f"nats://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture
def http_503():
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            self.send_response(503)
            self.end_headers()

        def log_message(self, *args):  # quiet
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()


def test_up_with_a_dead_sampler_url_fails_first(tmp_path, repo_env):
    url = f"http://127.0.0.1:{free_port()}"
    res = up(tmp_path, repo_env, "--sampler-url", url)
    assert_one_line_and_nothing_started(
        res, tmp_path, f"--sampler-url {url}: no answer from {url}/health", "leave out --sampler-url"
    )


def test_a_sampler_that_is_not_ready_is_named(http_503):
    with pytest.raises(ConfigError, match=r"/health answered HTTP 503: wait until the server has loaded its model"):
        preflight.check_samplers([http_503])
    with pytest.raises(ConfigError, match="not an http"):
        preflight.check_samplers(["127.0.0.1:30000"])


def test_up_with_an_empty_task_dir_fails_first(tmp_path, repo_env):
    empty = tmp_path / "empty"
    empty.mkdir()
    res = up(tmp_path, repo_env, "--tasks", str(empty))
    assert_one_line_and_nothing_started(res, tmp_path, f"--tasks {empty}: no runnable 'train' tasks")


def test_up_with_a_broken_task_fails_first(tmp_path, repo_env):
    bad = tmp_path / "tasks" / "t1"
    bad.mkdir(parents=True)
    (bad / "task.yaml").write_text("instruction: [unclosed\n")
    res = up(tmp_path, repo_env, "--tasks", str(bad.parent))
    assert_one_line_and_nothing_started(res, tmp_path, f"--tasks {bad.parent}:", "task.yaml")


def test_up_without_bubblewrap_fails_first(tmp_path, monkeypatch, capsys):
    """PATH without bwrap: the actors could not run a single episode, so `up` says so before anything."""
    monkeypatch.setenv("PATH", str(tmp_path / "nothing-here"))
    assert cli.main(["up", "--run-dir", str(tmp_path / "run"), "--duration", "5"]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith("error: the actors cannot run their sandbox here: bubblewrap not found") and err.count("\n") == 1
    )
    assert "apt-get install bubblewrap" in err
    assert not (tmp_path / "run" / "tasks").exists() and not (tmp_path / "run" / "cluster.json").exists()


def test_an_interrupted_synthesis_leaves_no_partial_corpus(tmp_path, monkeypatch):
    """Ctrl-C while the corpus is written: the next `up` must not take a partial corpus as done."""
    import sandbox_agent.synth as synth
    from t1async.cluster.components import ensure_tasks
    from t1async.cluster.config import UpConfig

    cfg = UpConfig(run_dir=tmp_path / "run", synth_tasks=6)
    real, calls = synth.write_task, []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(synth, "write_task", interrupted)
    with pytest.raises(KeyboardInterrupt):
        ensure_tasks(cfg)
    assert not (tmp_path / "run" / "tasks").exists()
    monkeypatch.setattr(synth, "write_task", real)
    d = ensure_tasks(cfg)
    assert len(list(d.glob("*/task.yaml"))) == 6 and not (tmp_path / "run" / "tasks.partial").exists()
    assert ensure_tasks(cfg) == d  # whole: not written again
    junk = tmp_path / "other"
    (junk / "tasks").mkdir(parents=True)
    (junk / "tasks" / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="holds files but no task: move them away, or pass --tasks DIR"):
        ensure_tasks(UpConfig(run_dir=junk, synth_tasks=2))
