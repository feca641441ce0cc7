"""The container backend with real podman (runc) and the base image built from Debian packages: the
persistent shell, containment, the CLI and actors, and no container, image or runtime process left behind
(a hung start's included). The published-layout TB tasks themselves: test_container_tb.py.

Needs podman, runc and mmdebstrap (``.ci/run`` installs them); the base image is built once and cached.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import anyio
import pytest

from sandbox_agent.agent.runner import prepared_workdir
from sandbox_agent.images import build as images
from sandbox_agent.sandbox import SandboxConfig
from sandbox_agent.sandbox.backend import AutoBackend, ContainerBackend, pick_backend
from sandbox_agent.sandbox.lifecycle import OWNER_LABEL, reap_orphans
from sandbox_agent.tasks.task import load_task
from t1async.procs import pid_alive
from tests.containers import FAST, FIXTURES, TB, ours


async def test_container_shell_keeps_state_and_survives_a_timeout(base_image: str) -> None:
    task = load_task(TB / "tb2/csv-stats")
    backend = ContainerBackend(config=FAST)
    async with prepared_workdir(task, backend) as wd, backend.open(task, wd) as sb:
        r = await sb.exec("pwd; export X=kept; cd /tmp; f() { echo fn; }; sleep 300 &")
        assert r.exit_code == 0 and r.output.strip() == "/app", r
        r = await sb.exec('echo "$X $PWD $(f)"; test -n "$CURRENCY" && echo "$CURRENCY"; python --version')
        assert r.output.split()[:4] == ["kept", "/tmp", "fn", "EUR"] and "Python 3" in r.output, r
        r = await sb.exec("sleep 100; echo never", timeout=1.0)
        assert r.timed_out and "never" not in r.output, r
        r = await sb.exec('echo "$X $PWD"; exit 3')
        assert r.output.startswith("kept /tmp") and r.exit_code == 3, r
        r = await sb.exec("echo $PWD; cat /app/sales.csv | head -1")
        assert r.output.split()[:2] == ["/tmp", "region,amount"] and "restarted" in r.output, r
        await sb.write_file("notes/a.txt", b"hi")
        assert await sb.read_file("/app/notes/a.txt") == b"hi"


async def test_abuse_is_contained_in_the_container(
    base_image: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)  # conmon wrote an `oom` file into the cwd of whoever ran podman (seen in CI clones)
    marker = tmp_path / "host-secret"
    marker.write_text("host")
    task = load_task(TB / "tb2/csv-stats")
    backend = ContainerBackend(config=SandboxConfig(command_timeout_s=20.0, kill_grace_s=0.5, output_limit_bytes=4096))
    async with prepared_workdir(task, backend) as wd:
        async with backend.open(task, wd) as sb:
            r = await sb.exec(
                "timeout 5 bash -c 'echo > /dev/tcp/1.1.1.1/80' && echo EGRESS; "
                "getent hosts deb.debian.org || echo nodns"
            )
            assert "EGRESS" not in r.output and "nodns" in r.output, r
            r = await sb.exec(f"cat {marker} || echo hidden")
            assert "hidden" in r.output, r
            r = await sb.exec("python -c 'x = bytearray(8 << 30)'; echo rc=$?")
            assert "rc=0" not in r.output, r  # the memory limit (2 GiB) stops it
            r = await sb.exec("head -c 400000000 /dev/zero > /tmp/big; echo rc=$?; stat -c %s /tmp/big; rm /tmp/big")
            assert "rc=0" not in r.output and str(256 << 20) in r.output, r  # RLIMIT_FSIZE: a file stops at 256 MiB
            r = await sb.exec("yes flood | head -c 50000000")
            assert r.truncated and len(r.output) < 10_000, len(r.output)
            await sb.exec("export KEEP=kept")
            r = await sb.exec("bomb() { bomb | bomb & }; bomb; sleep 100", timeout=5.0)
            assert r.timed_out, r
            r = await sb.exec("echo $KEEP; ls / | wc -l")  # the shell kept its state, and forks again
            # stderr may interleave: the killed bomb's late lines, or bash's own "fork: retry" while the kernel
            # still counts the bomb's processes against the pid limit (seen in a fresh-clone CI run)
            lines = r.output.splitlines()
            assert r.exit_code == 0 and "kept" in lines and int(lines[-1]) > 5, r
            r = await sb.exec("(trap '' TERM; sleep 1000) & nohup sleep 1000 >/dev/null 2>&1 & echo started")
            assert "started" in r.output
        name = backend._episodes[str(wd)][0]
        assert name in ours()
    assert name not in ours()  # sleepers, TERM-ignorers and bombs went with the container
    assert list(cwd.iterdir()) == []  # nothing of the container's lands where the user ran us


@pytest.mark.slow
async def test_no_container_or_image_leaks_across_50_episodes(base_image: str) -> None:
    task = load_task(TB / "tb2/csv-stats")
    backend = ContainerBackend(config=FAST)
    before_images = images.run_podman("images", "-q").stdout.split()
    before = ours()

    async def one(i: int) -> None:
        async with prepared_workdir(task, backend) as wd, backend.open(task, wd) as sb:
            r = await sb.exec(f"echo {i} > /app/i.txt; (sleep 1000 &); cat /app/i.txt")
            assert r.output.strip() == str(i)

    limit = anyio.CapacityLimiter(4)

    async def limited(i: int) -> None:
        async with limit:
            await one(i)

    async with anyio.create_task_group() as tg:
        for i in range(50):
            tg.start_soon(limited, i)
    assert ours() == before
    assert images.run_podman("images", "-q").stdout.split() == before_images


_OWNER = r"""
import anyio, sys
from sandbox_agent.sandbox.backend import ContainerBackend
from sandbox_agent.agent.runner import prepared_workdir
from pathlib import Path
from sandbox_agent.tasks.task import load_task

async def main():
    task = load_task(sys.argv[1])
    b = ContainerBackend()
    # SIGKILLed, it removes no work dir: the test's tmp dir holds it, not the system temp dir
    async with prepared_workdir(task, b, work_root=Path(sys.argv[2])) as wd, b.open(task, wd) as sb:
        await sb.exec("sleep 1000 &")
        print("NAME", b._episodes[str(wd)][0], flush=True)
        await anyio.sleep(600)

anyio.run(main)
"""


async def test_a_sigkilled_owner_s_container_is_removed_by_its_guard(base_image: str, tmp_path: Path) -> None:
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    p = subprocess.Popen(
        [sys.executable, "-c", _OWNER, str(TB / "tb2/csv-stats"), str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert p.stdout is not None
        line = "-"
        while line and not line.startswith("NAME "):
            line = await anyio.to_thread.run_sync(p.stdout.readline)
        name = line.split()[1]
        assert name in ours(None)
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
        with anyio.fail_after(60):  # its guard removes it (podman rm takes a moment on a loaded machine)
            while name in ours(None):
                await anyio.sleep(0.2)
        assert await reap_orphans(images.podman(), images.podman_env()) == []  # nothing left for the next start
    finally:
        if p.poll() is None:
            p.kill()
        p.wait()


def test_auto_picks_bwrap_for_tasks_without_an_image_and_containers_for_published_ones(base_image: str) -> None:
    own = [load_task(FIXTURES / "tb1/hello-world"), load_task(FIXTURES / "tb1/fibonacci-legacy")]
    assert pick_backend("auto", own).name == "bwrap"
    # log-summary's Dockerfile is only FROM/WORKDIR/COPY/ENV, which bwrap could stage: it still gets its image
    assert pick_backend("auto", [*own, load_task(TB / "tb1/log-summary")]).name == "container"
    assert pick_backend("auto", [*own, load_task(TB / "tb1/jq-query")]).name == "container"
    assert AutoBackend().kind(load_task(TB / "tb2/csv-stats")) == "container"
    assert AutoBackend().kind(own[0]) == "bwrap"


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sandbox_agent", *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=Path(__file__).resolve().parents[1],
    )


def test_cli_runs_a_task_on_the_chosen_backend_and_lists_backend_and_image_status(base_image: str) -> None:
    import json

    r = _cli("run-task", str(TB / "tb1/log-summary"), "--oracle", "--backend", "container", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert (out["backend"], out["resolved"], out["verifier_path"]) == ("container", True, "script")
    r = _cli("run-task", str(TB / "tb1/jq-query"), "--oracle", "--backend", "bwrap")
    assert r.returncode == 1 and "Dockerfile:3: RUN apt-get update" in r.stderr and "--backend container" in r.stderr
    r = _cli("list", str(TB), "--json")
    rows = {t["id"]: t for t in json.loads(r.stdout.strip().splitlines()[-1])}
    assert rows["log-summary"]["backend"] == "container" and rows["jq-query"]["backend"] == "container"
    assert rows["jq-query"]["image_status"] in ("built", "not built")
    r = _cli("list", str(FIXTURES), "--json")
    rows = {t["id"]: t for t in json.loads(r.stdout.strip().splitlines()[-1])}
    assert rows["needs-image"]["image_status"].startswith("refused: base image 'rust:1.80-slim'")
    r = _cli("images", "build-base")
    assert r.returncode == 0 and "ready" in r.stdout, r.stderr


def test_bench_sandbox_container_runs_and_prints_json_last(base_image: str) -> None:
    import json

    r = subprocess.run(
        [sys.executable, "-m", "bench.sandbox", "--backend", "container", "--execs", "20", "--starts", "1"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert r.returncode == 0, r.stderr[-2000:]
    data = json.loads(r.stdout.strip().splitlines()[-1])
    assert 0 < data["container_exec_p50_ms"] <= data["container_exec_p99_ms"]
    assert (
        data["container_start_cold_ms"] > 0 and data["container_warm_start_ms"] > 0 and data["container_verify_ms"] > 0
    )


async def test_actors_run_published_tasks_in_containers_and_the_learner_trains_their_turns(
    base_image: str, tmp_path: Path, tiny_model: Path
) -> None:
    """The real actor loop and learner over the published tasks: the RUN-step ones go to containers (auto)."""
    import shutil

    from t1async.model.config import MoEConfig
    from t1async.model.tokenizer import ChatTokenizer
    from t1async.protocol import wire
    from t1async.transport import MemoryBroker
    from tests.loops import VersionedMemorySampler, run_loop

    tasks = tmp_path / "tasks"
    for d in ("tb1/jq-query", "tb2/gen-data"):  # container-only tasks: every episode runs in one
        shutil.copytree(TB / d, tasks / d)
    cfg = MoEConfig.load(tiny_model / "config.json")
    sampler = VersionedMemorySampler(
        vocab_size=cfg.vocab_size,
        num_layers=cfg.n_layers,
        topk=cfg.top_k,
        num_experts=cfg.n_experts,
        eos_token_id=ChatTokenizer.load().end_of_turn_id,
        seed=1,
    )
    seen: list = []
    before = ours()
    # ends=1: the learner's 2 steps can finish on turns before any episode's verified end is published
    learner = await run_loop(
        tmp_path, tiny_model, eta=1, steps=2, broker=MemoryBroker(), sampler=sampler, seen=seen, ends=1
    )
    assert learner.policy_version == 2
    starts = {r.episode: r.task for r in seen if isinstance(r, wire.StartRecord)}
    ends = [r for r in seen if isinstance(r, wire.EndRecord)]
    assert ends and {starts[e.episode] for e in ends} <= {"jq-query", "gen-data"}, ends
    assert all(e.tests_total > 0 for e in ends), ends  # the verifier ran each one in its container
    assert ours() == before  # every episode's container is gone


async def test_a_container_shell_holds_its_state_for_320_turns(base_image: str) -> None:
    task = load_task(TB / "tb2/gen-data")
    backend = ContainerBackend(config=FAST)
    async with prepared_workdir(task, backend) as wd, backend.open(task, wd) as sb:
        await sb.exec("export FIRST=turn1; cd /data; n=0")
        for i in range(2, 321):
            r = await sb.exec("n=$((n+1)); true")
            assert r.exit_code == 0, (i, r)
        r = await sb.exec('echo "$FIRST $PWD $n"')
        assert r.output.split() == ["turn1", "/data", "319"], r


async def test_reap_orphans_removes_containers_whose_owner_is_gone(base_image: str) -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()  # its pid names no live process now
    name = f"t1-orphan-{os.getpid()}"
    images.run_podman(
        "run",
        "-d",
        "--init",
        "--name",
        name,
        "--network=none",
        "--label",
        f"{OWNER_LABEL}={dead.pid}",
        base_image,
        "sleep",
        "infinity",
    )
    try:
        assert name in ours(dead.pid)
        removed = await reap_orphans(images.podman(), images.podman_env())
        assert removed and name not in ours(None)
    finally:
        images.run_podman("rm", "-f", "-t", "0", name, check=False)


def _fake_conmon(name: str) -> subprocess.Popen[bytes]:
    """A stand-in for a hung start's leftovers (a real `runc init` hang cannot be made on demand): a process
    whose argv reads as conmon's for container ``name`` (``conmon ... -n NAME``), with a child under it, as
    conmon has its ``runc init``. Its own session, like the daemonized conmon."""
    return subprocess.Popen(
        ["conmon", "-c", "sleep 600 & wait", "conmon", "-n", name], executable="/bin/bash", start_new_session=True
    )


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


async def test_a_hung_start_s_runtime_processes_are_killed_though_podman_does_not_list_them(base_image: str) -> None:
    from sandbox_agent.sandbox import hostpids

    stray = _fake_conmon(f"t1-stray{os.getpid()}")
    young = _fake_conmon(f"t1-young{os.getpid()}")
    try:
        for _ in range(100):  # until each has started its "runc init"
            if _children(stray.pid) and _children(young.pid):
                break
            await anyio.sleep(0.05)
        child = _children(stray.pid)
        assert child and stray.pid in hostpids.conmons(0.0)
        removed = await reap_orphans(images.podman(), images.podman_env(), min_age_s=0.0)
        assert f"t1-stray{os.getpid()}" in removed
        assert stray.wait(timeout=10) == -signal.SIGKILL
        for _ in range(100):
            if not pid_alive(child[0]):
                break
            await anyio.sleep(0.05)
        else:
            pytest.fail(f"the stray's child {child[0]} is still running")
        assert young.wait(timeout=10) == -signal.SIGKILL  # min_age_s=0: it went too; now the age rule
        fresh = _fake_conmon(f"t1-fresh{os.getpid()}")
        try:
            await reap_orphans(images.podman(), images.podman_env())  # default: only a minute old or more
            assert fresh.poll() is None
        finally:
            fresh.kill()
            fresh.wait()
    finally:
        for p in (stray, young):
            if p.poll() is None:
                p.kill()
            p.wait()
