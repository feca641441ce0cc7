"""Task loading: Terminal-Bench 1 (task.yaml) and 2 (task.toml) directories, errors, split, work dir setup."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from sandbox_agent.agent.runner import NullAgent, OracleAgent, run_policy
from sandbox_agent.sandbox.backend import BwrapBackend, require_backend
from sandbox_agent.tasks.task import (
    TaskFormatError,
    TaskNeedsImageError,
    iter_task_dirs,
    load_task,
    load_tasks,
    populate_workdir,
    split_for,
)

FIXTURES = Path(__file__).resolve().parents[1] / "sandbox_agent" / "fixtures"


def test_tb1_task_yaml():
    t = load_task(FIXTURES / "tb1" / "hello-world")
    assert (t.id, t.format, t.family, t.parser, t.difficulty) == (
        "hello-world",
        "tb1",
        "file-operations",
        "pytest",
        "easy",
    )
    assert t.instruction.startswith("Create a file called hello.txt") and t.instruction.endswith("newline.\n")
    assert (t.agent_timeout_s, t.test_timeout_s) == (360.0, 60.0)
    assert t.test_files == ("test_outputs.py",) and t.tests_dir == t.path / "tests"
    assert t.solution == t.path / "solution.sh" and t.test_script == t.path / "run-tests.sh"
    assert t.docker_image is None and t.environment_dir is None and t.setup_script is None
    assert t.tags == ("file-operations",) and t.extra["run_tests_in_same_shell"] is False


def test_tb1_legacy_descriptions_and_folded_scalar():
    t = load_task(FIXTURES / "tb1" / "fibonacci-legacy")
    assert t.instruction.startswith("Write a Python program fib.py") and "\n" not in t.instruction
    assert t.parser == "pytest" and t.tags == ("python", "coding") and t.agent_timeout_s == 600.0


def test_tb2_task_toml():
    t = load_task(FIXTURES / "tb2" / "word-count")
    assert (t.format, t.family, t.difficulty) == ("tb2", "text-processing", "easy")
    assert t.instruction.startswith("The file `poem.txt`")
    assert (t.agent_timeout_s, t.test_timeout_s) == (300.0, 60.0)
    assert t.solution == t.path / "solution" / "solve.sh" and t.test_script == t.path / "tests" / "test.sh"
    assert t.environment_dir == t.path / "environment" and t.docker_image is None
    assert t.extra == {"version": "1.0", "resources": {"cpus": 1.0, "memory_bytes": 1024 << 20}}  # [environment]


def test_images_are_detected():
    t = load_task(FIXTURES / "tb2" / "custom-image")  # names a prebuilt image and ships its Dockerfile: built
    assert t.docker_image == f"dockerfile:{t.path / 'environment' / 'Dockerfile'}"
    assert t.extra["prebuilt_image"] == "ghcr.io/example/cuda-train:12.4"
    assert load_task(FIXTURES / "tb1" / "needs-image").docker_image.startswith("dockerfile:")


def test_task_needing_an_image_is_refused_clearly():
    t = load_task(FIXTURES / "tb2" / "custom-image")
    with pytest.raises(
        TaskNeedsImageError,
        match=r"task 'custom-image' needs image 'dockerfile:.*'; no container backend.*"
        r"FROM ghcr.io/example/cuda-train:12.4",
    ):
        require_backend(t, BwrapBackend())


async def test_run_policy_refuses_image_task_before_touching_anything():
    with pytest.raises(TaskNeedsImageError):
        await run_policy(load_task(FIXTURES / "tb1" / "needs-image"), OracleAgent())


def test_load_tasks_finds_every_fixture():
    tasks = load_tasks(FIXTURES)
    assert sorted(t.id for t in tasks) == sorted(
        ["hello-world", "fibonacci-legacy", "needs-image", "word-count", "exit-status-only", "custom-image"]
    )
    assert list(iter_task_dirs(FIXTURES / "tb1" / "hello-world")) == [FIXTURES / "tb1" / "hello-world"]


def test_split_is_deterministic_and_roughly_ten_percent_eval_and_test():
    keys = [f"task-{i}" for i in range(2000)]
    splits = [split_for(i) for i in keys]
    assert splits == [split_for(i) for i in keys]
    assert 120 < splits.count("eval") < 280 and 120 < splits.count("test") < 280


def test_populate_workdir_copies_environment_files(tmp_path):
    src = tmp_path / "task"
    shutil.copytree(FIXTURES / "tb2" / "word-count", src)
    (src / "environment" / "sub").mkdir()
    (src / "environment" / "sub" / "run.sh").write_text("echo hi\n")
    (src / "environment" / "sub" / "run.sh").chmod(0o750)
    wd = tmp_path / "wd"
    wd.mkdir()
    t = load_task(src)
    populate_workdir(t, wd)
    assert sorted(p.name for p in wd.iterdir()) == ["poem.txt", "sub"]
    assert (wd / "sub" / "run.sh").stat().st_mode & 0o777 == 0o750


def test_with_a_dockerfile_environment_is_the_build_context_and_nothing_is_copied(tmp_path):
    src = tmp_path / "task"
    shutil.copytree(FIXTURES / "tb2" / "word-count", src)
    (src / "environment" / "Dockerfile").write_text("FROM ubuntu:24.04\nWORKDIR /app\n")
    wd = tmp_path / "wd"
    wd.mkdir()
    t = load_task(src)
    assert t.docker_image is not None  # an environment/Dockerfile means its own image
    populate_workdir(t, wd)
    assert list(wd.iterdir()) == []  # only what the Dockerfile COPYs (none here) reaches the work dir


@pytest.mark.parametrize(
    "files, match",
    [
        ({}, "expected task.yaml"),
        ({"task.yaml": "instruction: [unclosed\n"}, "invalid YAML"),
        ({"task.yaml": "- a list\n"}, "mapping at top level"),
        ({"task.yaml": "difficulty: easy\n"}, "'instruction' must be a non-empty string"),
        ({"task.yaml": "instruction: hi\nmax_agent_timeout_sec: soon\n"}, "max_agent_timeout_sec.*positive number"),
        ({"task.yaml": "instruction: hi\nmax_test_timeout_sec: -5\n"}, "max_test_timeout_sec"),
        ({"task.yaml": "instruction: hi\ntags: web\n"}, "'tags' must be a list of strings"),
        ({"task.yaml": "instruction: hi\nsplit: holdout\n"}, "'split' must be 'train', 'eval' or 'test'"),
        ({"task.toml": "[agent\ntimeout_sec = 1\n", "instruction.md": "x"}, "invalid TOML"),
        ({"task.toml": "[agent]\ntimeout_sec = 1\n"}, "no instruction.md"),
        ({"task.toml": "[agent]\ntimeout_sec = 'long'\n", "instruction.md": "x"}, "agent.timeout_sec"),
        ({"task.toml": "verifier = 3\n", "instruction.md": "x"}, r"\[verifier\] must be a table"),
        ({"task.toml": "", "instruction.md": "  \n"}, "is empty"),
    ],
)
def test_malformed_tasks_name_the_problem(tmp_path, files, match):
    for name, body in files.items():
        (tmp_path / name).write_text(body)
    with pytest.raises(TaskFormatError, match=match):
        load_task(tmp_path)


def test_missing_dir_is_a_clear_error(tmp_path):
    with pytest.raises(TaskFormatError, match="does not exist"):
        load_task(tmp_path / "nope")
    with pytest.raises(TaskFormatError, match="does not exist"):
        load_tasks(tmp_path / "nope")


@pytest.mark.parametrize("rel", ["tb1/hello-world", "tb1/fibonacci-legacy", "tb2/word-count", "tb2/exit-status-only"])
async def test_fixture_oracle_resolves_and_null_does_not(rel):
    t = load_task(FIXTURES / rel)
    oracle = await run_policy(t, OracleAgent())
    null = await run_policy(t, NullAgent())
    assert oracle.verify.status == "ok" and oracle.verify.resolved and oracle.verify.passed == oracle.verify.total
    assert null.verify.status == "ok" and not null.verify.resolved and null.verify.passed < null.verify.total
