"""Published-layout Terminal-Bench tasks (tests/tb_tasks) on the bwrap backend: the Dockerfile subset it
honours exactly (WORKDIR, COPY, ENV, python -> python3), and a clear refusal for anything else (RUN)."""

from __future__ import annotations

from pathlib import Path

import pytest

from sandbox_agent.agent.runner import NullAgent, OracleAgent, run_policy
from sandbox_agent.images.dockerfile import plan_text
from sandbox_agent.sandbox.backend import BwrapBackend
from sandbox_agent.tasks.task import TaskNeedsImageError, load_task

TB = Path(__file__).resolve().parent / "tb_tasks"


@pytest.mark.parametrize("task_dir", ["tb1/log-summary", "tb2/csv-stats", "tb1/polyglot-anagram"])
async def test_published_task_resolves_with_its_oracle_and_not_with_nothing_under_bwrap(task_dir: str) -> None:
    task = load_task(TB / task_dir)
    assert task.docker_image and task.docker_image.startswith("dockerfile:")
    assert BwrapBackend().supports(task)
    oracle = await run_policy(task, OracleAgent())
    assert oracle.act is not None and oracle.act.exit_code == 0, oracle.act
    assert oracle.verify.status == "ok" and oracle.verify.resolved, oracle.verify
    null = await run_policy(task, NullAgent())
    assert null.verify.status == "ok" and null.verify.passed == 0 and not null.verify.resolved, null.verify
    assert null.verify.total == oracle.verify.total > 0  # every test file collected, *_test.py too


@pytest.mark.parametrize(
    "task_dir, line",
    [("tb1/jq-query", "Dockerfile:3: RUN apt-get update"), ("tb2/gen-data", "Dockerfile:5: RUN mkdir -p /data")],
)
async def test_a_run_step_needs_a_container_and_bwrap_says_which_line(task_dir: str, line: str) -> None:
    task = load_task(TB / task_dir)
    assert not BwrapBackend().supports(task)
    with pytest.raises(TaskNeedsImageError, match=line) as info:
        await run_policy(task, OracleAgent())
    assert "--backend container" in str(info.value)


def test_plan_keeps_workdir_env_and_copies_and_expands_variables(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("x")
    (tmp_path / "d").mkdir()
    p = plan_text(
        "# comment\nFROM python:3.11-slim\nARG V=1\nWORKDIR /app\nENV A=b PATH=/opt/bin:$PATH\n"
        'ENV C "two words"\nCOPY a.txt ./\nCOPY d/ /data/\nCOPY --chown=1:1 a.txt /srv/x-${V}.txt\n'
        'CMD ["bash"]\n',
        tmp_path,
    )
    assert p.refusal is None and p.workdir == "/app" and p.base == "python:3.11-slim"
    env = dict(p.env)
    assert env["A"] == "b" and env["PATH"].startswith("/opt/bin:/usr/local/sbin") and env["C"] == "two words"
    assert [c.dest for c in p.copies] == ["/app/", "/data/", "/srv/x-1.txt"]


@pytest.mark.parametrize(
    "text, why",
    [
        ("FROM nvidia/cuda:12.4\n", "not one the host"),
        ("FROM ubuntu:24.04\nRUN true\n", "needs a container backend to run"),
        ("FROM ubuntu:24.04\nUSER agent\n", "another user"),
        ("FROM ubuntu:24.04 AS b\nFROM debian\n", "multi-stage"),
        ("FROM ubuntu:24.04\nCOPY missing.txt /app/\n", "does not exist"),
        ("FROM ubuntu:24.04\nCOPY a.txt /usr/local/bin/\n", "copying into /usr/local/bin"),
        ("FROM ubuntu:24.04\nADD https://example.com/x /app/\n", "only local files"),
    ],
)
def test_plan_refuses_what_bwrap_cannot_reproduce(tmp_path: Path, text: str, why: str) -> None:
    (tmp_path / "a.txt").write_text("x")
    p = plan_text(text, tmp_path)
    assert p.refusal is not None and why in p.refusal, p.refusal


async def test_bwrap_mounts_the_work_dir_at_the_dockerfile_workdir_and_the_file_api_follows(tmp_path: Path) -> None:
    from sandbox_agent.agent.runner import prepared_workdir

    task = load_task(TB / "tb1/log-summary")
    backend = BwrapBackend()
    async with prepared_workdir(task, backend) as wd, backend.open(task, wd) as sb:
        r = await sb.exec("pwd; ls; cat /tmp/warehouse/items.csv | wc -l; echo $REPORT_NAME; python -c 'print(7)'")
        assert r.output.split() == ["/app", "access_log", "4", "report.txt", "7"], r
        await sb.write_file("/app/notes.txt", b"n")
        assert (wd / "notes.txt").read_bytes() == b"n" and await sb.read_file("/app/access_log") == (
            wd / "access_log"
        ).read_bytes()
        r = await sb.exec("echo staged > /tmp/warehouse/out.txt")
    assert not wd.exists() and not Path(f"{wd}.mnt").exists()  # both removed with the episode


async def test_without_podman_a_run_step_task_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from sandbox_agent.sandbox import SandboxStartError
    from sandbox_agent.sandbox.backend import AutoBackend, pick_backend

    monkeypatch.setenv("T1_PODMAN", "podman-not-installed-here")
    task = load_task(TB / "tb1/jq-query")
    with pytest.raises(SandboxStartError, match=r"podman, which is not installed: install it with `apt-get install"):
        pick_backend("container")
    backend = pick_backend("auto", [task])
    assert backend.name == "bwrap"
    with pytest.raises(TaskNeedsImageError, match="apt-get install -y podman runc"):
        await run_policy(task, OracleAgent(), backend=backend)
    assert "podman is not installed" in (AutoBackend().refusal(task) or "")


def test_a_tb2_task_naming_a_prebuilt_image_and_shipping_its_dockerfile_builds_the_dockerfile(tmp_path: Path) -> None:
    import shutil

    t = tmp_path / "csv-stats"
    shutil.copytree(TB / "tb2/csv-stats", t)
    named = '[environment]\ndocker_image = "someone/csv-stats:20251031"\n'
    (t / "task.toml").write_text((t / "task.toml").read_text().replace("[environment]\n", named))
    task = load_task(t)
    assert task.docker_image == f"dockerfile:{t / 'environment' / 'Dockerfile'}"
    assert task.extra["prebuilt_image"] == "someone/csv-stats:20251031"
    assert BwrapBackend().supports(task)  # FROM/WORKDIR/COPY/ENV only: bwrap reproduces it


@pytest.mark.parametrize(
    "table, want",
    [
        (
            'cpus = 2\nmemory = "2G"\nstorage = "10G"\n',
            {"cpus": 2.0, "memory_bytes": 2 << 30, "storage_bytes": 10 << 30},
        ),
        ("cpus = 1\nmemory_mb = 512\n", {"cpus": 1.0, "memory_bytes": 512 << 20}),
        ("build_timeout_sec = 600.0\n", None),
    ],
)
def test_a_tb2_task_s_declared_resources_are_read(tmp_path: Path, table: str, want: dict | None) -> None:
    import shutil

    t = tmp_path / "t"
    shutil.copytree(TB / "tb2/gen-data", t)
    (t / "task.toml").write_text('version = "1.0"\n[environment]\n' + table)
    assert load_task(t).extra.get("resources") == want


def test_a_bad_resource_size_says_which_field(tmp_path: Path) -> None:
    import shutil

    from sandbox_agent.tasks.task import TaskFormatError

    t = tmp_path / "t"
    shutil.copytree(TB / "tb2/gen-data", t)
    (t / "task.toml").write_text('[environment]\nmemory = "lots"\n')
    with pytest.raises(TaskFormatError, match=r"environment.memory' must be a size like"):
        load_task(t)


@pytest.mark.parametrize(
    "text, rewards, reward",
    [
        ("1\n", {"reward": 1.0}, 1.0),
        ('{"reward": 0.75}', {"reward": 0.75}, 0.75),
        ('{"build": 1, "tests": 0, "note": "x"}', {"build": 1.0, "tests": 0.0}, 0.0),  # rewards.json: all must be met
        ("", None, None),
        ("garbage", None, None),
    ],
)
def test_harbor_reward_files_are_read(text: str, rewards: dict | None, reward: float | None) -> None:
    from sandbox_agent.tasks.tbscript import harbor_reward, harbor_rewards

    assert harbor_rewards(text) == rewards and harbor_reward(text) == reward
