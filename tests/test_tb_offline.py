"""Running published Terminal-Bench scripts offline, without containers: which pins a test script installs
(fetched on the host ahead of the verifier), t-bench base images' WORKDIR, the uv-installer shims, and the
agent's network needing a container."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from sandbox_agent.images.dockerfile import plan_text
from sandbox_agent.images.wheels import script_packages
from sandbox_agent.sandbox.backend import pick_backend
from sandbox_agent.tasks.tbscript import write_shims

SCRIPT = """#!/bin/bash
set -euo pipefail
apt-get update && apt-get install -y curl  # not python
curl -LsSf https://astral.sh/uv/0.7.13/install.sh | sh
uv venv .tbench-testing
uv pip install --only-binary=:all: pytest==8.4.1 bcrypt==4.1.3 \\
    "httpx==0.27.0"
python3 -m pip install -q requests==2.32.3 -r extra.txt --index-url https://example.org/simple ./local
uvx -p 3.13 -w pytest==8.4.1 --with pyyaml==6.0.1 --with=numpy==2.2.1 pytest --ctrf x.json -rA
uv run --with scipy==1.15.1 pytest -q
uv add pytest==8.3.4
# pip install commented==1.0
"""


def test_script_packages_reads_every_pin_a_script_installs_and_nothing_else() -> None:
    assert script_packages(SCRIPT) == (
        "pytest==8.4.1",
        "bcrypt==4.1.3",
        "httpx==0.27.0",
        "requests==2.32.3",
        "pyyaml==6.0.1",
        "numpy==2.2.1",
        "scipy==1.15.1",
        "pytest==8.3.4",
    )


def test_a_t_bench_base_image_means_workdir_app_unless_the_dockerfile_says_otherwise() -> None:
    base = "FROM ghcr.io/laude-institute/t-bench/python-3-13:20250620\n"
    assert plan_text(base, Path(".")).workdir == "/app"
    assert plan_text(base + "WORKDIR /srv/work\n", Path(".")).workdir == "/srv/work"
    assert plan_text("FROM python:3.11-slim\n", Path(".")).workdir == "/"


def test_the_shims_answer_uv_s_installer_and_pass_everything_else_to_the_real_command(tmp_path: Path) -> None:
    if shutil.which("curl") is None:
        pytest.fail("curl is missing: apt-get install -y curl")
    write_shims(tmp_path)
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}"}
    installer = subprocess.run(
        ["curl", "-LsSf", "https://astral.sh/uv/0.7.13/install.sh"], env=env, capture_output=True, text=True
    )
    assert installer.returncode == 0 and "uv installed" in installer.stdout, installer
    home = tmp_path / "home"
    home.mkdir()
    ran = subprocess.run(["sh"], input=installer.stdout, env={**env, "HOME": str(home)}, capture_output=True, text=True)
    assert ran.returncode == 0 and (home / ".local" / "bin").is_dir(), ran
    real = subprocess.run(["curl", "--version"], env=env, capture_output=True, text=True)
    assert real.returncode == 0 and real.stdout.startswith("curl "), real  # the real curl, found past the shim
    other = subprocess.run(["curl", "-sS", "file:///nonexistent/t1"], env=env, capture_output=True, text=True)
    assert other.returncode != 0 and "uv installed" not in other.stdout  # other URLs are not answered


def test_the_agent_s_network_needs_a_container() -> None:
    with pytest.raises(ValueError, match="needs the container backend"):
        pick_backend("bwrap", agent_network=True)


def test_the_verifier_wheelhouse_is_fetched_once_per_set_of_pins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sandbox_agent.images import wheels

    calls: list[tuple[str, ...]] = []

    def fake_download(dest: Path, specs: tuple[str, ...]) -> subprocess.CompletedProcess[str]:
        calls.append(tuple(specs))
        for s in specs:
            (dest / f"{s.replace('==', '-')}.whl").write_text("")
        return subprocess.CompletedProcess([], 0, "", "")

    monkeypatch.setattr(wheels, "download", fake_download)
    first, why = wheels.task_wheelhouse(tmp_path, ("six==1.16.0",), ("pytest==8.4.1",))
    again, _ = wheels.task_wheelhouse(tmp_path, ("six==1.16.0",), ("pytest==8.4.1",))
    assert first == again and first is not None and why == ""
    assert calls == [("pytest==8.4.1",), ("six==1.16.0",)]  # two resolutions (a script may pin another pytest)
    assert sorted(p.name for p in first.iterdir()) == [".complete", "pytest-8.4.1.whl", "six-1.16.0.whl"]
    assert not list(tmp_path.rglob("*.part-*"))
    assert wheels.task_wheelhouse(tmp_path, (), ("pytest==8.4.1",)) == (None, "")  # nothing beyond the image's


def test_run_task_refuses_the_agent_s_network_on_bwrap_with_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    from sandbox_agent.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["run-task", "tests/tb_tasks/tb2/serve-after", "--oracle", "--backend", "bwrap", "--agent-network"])
    assert exc.value.code == 2
    assert "--agent-network needs a container (--backend container or auto)" in capsys.readouterr().err


def test_a_wheelhouse_another_process_finished_first_is_kept_not_replaced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sandbox_agent.images import wheels

    key_dir: list[Path] = []

    def racing_download(dest: Path, specs: tuple[str, ...]) -> subprocess.CompletedProcess[str]:
        (dest / "ours.whl").write_text("")
        if "six==1.16.0" in specs:  # meanwhile another actor process finishes the same set (and mounts it)
            done = dest.parent / dest.name.split(".part")[0]
            done.mkdir()
            (done / "theirs.whl").write_text("")
            (done / ".complete").write_text("six==1.16.0\n")
            key_dir.append(done)
        return subprocess.CompletedProcess([], 0, "", "")

    monkeypatch.setattr(wheels, "download", racing_download)
    house, why = wheels.task_wheelhouse(tmp_path, ("six==1.16.0",), ("pytest==8.4.1",))
    assert (house, why) == (key_dir[0], "")
    assert (house / "theirs.whl").exists() and not (house / "ours.whl").exists()  # theirs, untouched
    assert [p.name for p in house.parent.iterdir()] == [house.name]  # our part dir is gone
