"""Terminal-Bench tasks in published layouts on the container backend: each resolves with its oracle and
fails with nothing, the verifier path each takes (the task's own script offline, or its test files), the
verifier's network only when asked, Harbor's named rewards, a task's declared resources, the disk cap.

Shares conftest's base image fixture with test_container.py (built once, cached).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from sandbox_agent.agent.runner import NullAgent, OracleAgent, prepared_workdir, run_policy
from sandbox_agent.images import build as images
from sandbox_agent.sandbox.backend import ContainerBackend
from sandbox_agent.tasks.task import load_task
from tests.containers import FAST, FIXTURES, TB, ours

# (task, verifier path, tests): "script" where the task's own run-tests.sh/test.sh runs as written, offline,
# on the base image's wheelhouse; "pytest" where it cannot (csv-stats and gen-data pin `uvx -p 3.13`)
PUBLISHED = [
    (TB / "tb1/log-summary", "script", 3),  # uv venv; uv pip install pytest==8.4.1; uv run pytest
    (TB / "tb1/jq-query", "script", 2),  # the same, in an image with RUN apt-get install jq
    (TB / "tb1/inbox-words", "script", 2),  # uv init; uv add pytest==8.4.1 (a universal lock, offline)
    (TB / "tb1/polyglot-anagram", "script", 4),  # copies *_test.py into /app and runs them there (Aider)
    (TB / "tb2/uvx-ctrf", "script", 3),  # uvx --with pytest==8.4.1 --with pytest-json-ctrf pytest --ctrf
    # FROM t-bench's image (its WORKDIR /app), RUN pip install from PyPI, a `set -euo pipefail` script that
    # curls uv's installer and pins a package the image lacks (six): resolved by its own script, offline
    (TB / "tb1/tbench-base", "script", 3),
    (TB / "tb2/csv-stats", "pytest", 3),
    (TB / "tb2/gen-data", "pytest", 2),
    (FIXTURES / "tb1/hello-world", "script", 3),
    (FIXTURES / "tb2/exit-status-only", "script", 1),
]


@pytest.mark.parametrize("task_dir, path, tests", PUBLISHED, ids=[f"{p.parent.name}/{p.name}" for p, _, _ in PUBLISHED])
async def test_published_task_resolves_with_its_oracle_and_fails_with_nothing(
    base_image: str, task_dir: Path, path: str, tests: int
) -> None:
    task = load_task(task_dir)
    backend = ContainerBackend(config=FAST)
    oracle = await run_policy(task, OracleAgent(), backend=backend)
    assert oracle.verify.status == "ok" and oracle.verify.resolved, oracle.verify
    assert (oracle.verify.path, oracle.verify.passed, oracle.verify.total) == (path, tests, tests), oracle.verify
    null = await run_policy(task, NullAgent(), backend=backend)
    assert null.verify.status == "ok" and not null.verify.resolved, null.verify


async def test_verifier_runs_the_task_script_offline_and_falls_back_to_pytest_when_it_needs_the_network(
    base_image: str,
) -> None:
    backend = ContainerBackend(config=FAST)
    offline = await run_policy(load_task(FIXTURES / "tb2/exit-status-only"), OracleAgent(), backend=backend)
    assert offline.verify.path == "script" and offline.verify.tests == {"test.sh": True}
    online = await run_policy(load_task(TB / "tb2/csv-stats"), OracleAgent(), backend=backend)
    assert online.verify.path == "pytest" and "test.sh needs the network" in online.verify.detail
    assert online.verify.passed == 3  # the dense reward: every test counted, not Harbor's 0/1
    assert "No interpreter found for Python 3.13" in online.verify.detail  # its `uvx -p 3.13`, said why


async def test_the_verifier_gets_the_network_only_when_asked(base_image: str, tmp_path: Path) -> None:
    import shutil

    from sandbox_agent.tasks.verifier import VerifierConfig

    t = tmp_path / "net-task"
    shutil.copytree(TB / "tb2/csv-stats", t)
    (t / "tests" / "test.sh").write_text(  # fetches from Debian's registry (reachable here) as scripts fetch uv
        "#!/bin/bash\nif ! apt-get update 2>&1 | grep -q '^Get:'; then echo 0 > /logs/verifier/reward.txt; exit 0; fi\n"
        "python3 -m pytest /tests/test_outputs.py -rA\n"
        "if [ $? -eq 0 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi\n"
    )
    task = load_task(t)
    backend = ContainerBackend(config=FAST)
    before = ours()
    on = await run_policy(task, OracleAgent(), backend=backend, verifier=VerifierConfig(allow_network=True))
    assert (on.verify.path, on.verify.resolved, on.verify.passed) == ("script", True, 3), on.verify
    off = await run_policy(task, OracleAgent(), backend=backend)
    # offline it writes reward 0 and runs no test: not taken as the answer; its test files are run instead
    assert (off.verify.path, off.verify.passed) == ("pytest", 3) and "needs the network" in off.verify.detail, (
        off.verify
    )
    assert ours() == before and not any(b"verify-" in ln for ln in images.run_podman("images").stdout.splitlines())


async def test_a_disk_cap_bounds_what_an_episode_writes_in_its_work_dir_and_tmp(
    base_image: str, tmp_path: Path
) -> None:
    import shutil

    from sandbox_agent.sandbox.lifecycle import ContainerLimits
    from sandbox_agent.tasks.verifier import VerifierConfig

    backend = ContainerBackend(config=FAST, limits=ContainerLimits(disk_bytes=16 << 20))
    task = load_task(TB / "tb1/polyglot-anagram")
    async with prepared_workdir(task, backend) as wd, backend.episode(task, wd), backend.open(task, wd) as sb:
        r = await sb.exec(
            "ls /app; for d in /app /tmp; do dd if=/dev/zero of=$d/fill bs=1M count=40 2>&1 | tail -1; "
            "du -sm $d/fill | cut -f1; done"
        )
        lines = r.output.splitlines()
        assert lines[0] == "anagram.py", r  # the image's files are there (tmpcopyup)
        assert [int(x) for x in lines[2::2]] == [16, 16], r  # 40 MiB asked for, each cut at its 16 MiB cap
    # the networked verifier's copy of the container gets the work dir's contents carried over
    t = tmp_path / "net-task"
    shutil.copytree(TB / "tb2/csv-stats", t)
    (t / "tests" / "test.sh").write_text(
        "#!/bin/bash\npython3 -m pytest /tests/test_outputs.py -rA\n"
        "if [ $? -eq 0 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi\n"
    )
    on = await run_policy(load_task(t), OracleAgent(), backend=backend, verifier=VerifierConfig(allow_network=True))
    assert (on.verify.path, on.verify.resolved, on.verify.passed) == ("script", True, 3), on.verify


async def test_a_task_s_declared_memory_and_cpus_limit_its_container(base_image: str, tmp_path: Path) -> None:
    import shutil

    t = tmp_path / "small"
    shutil.copytree(TB / "tb2/gen-data", t)
    (t / "task.toml").write_text(
        (t / "task.toml").read_text().split("[environment]")[0] + '[environment]\ncpus = 64\nmemory = "300M"\n'
    )  # more CPUs than here: capped
    task = load_task(t)
    backend = ContainerBackend(config=FAST)
    async with prepared_workdir(task, backend) as wd, backend.episode(task, wd), backend.open(task, wd) as sb:
        r = await sb.exec(
            "cat /sys/fs/cgroup/memory.max 2>/dev/null || cat /sys/fs/cgroup/memory/memory.limit_in_bytes"
        )
        assert r.output.strip() == str(300 << 20), r


async def test_harbor_named_rewards_count_as_tests(base_image: str, tmp_path: Path) -> None:
    import shutil

    t = tmp_path / "named"
    shutil.copytree(FIXTURES / "tb2/exit-status-only", t)
    (t / "tests" / "test.sh").write_text(  # Harbor's rewards.json: one reward per named criterion
        '#!/bin/bash\ncd "$T1_WORKDIR"\nd=0; [ -d logs ] && d=1\nf=0; [ -f logs/app.log ] && f=1\n'
        'echo "{\\"dir\\": $d, \\"file\\": $f, \\"never\\": 0}" > /logs/verifier/rewards.json\n'
    )
    r = await run_policy(load_task(t), OracleAgent(), backend=ContainerBackend(config=FAST))
    assert (r.verify.path, r.verify.tests) == ("script", {"dir": True, "file": True, "never": False}), r.verify
    assert (r.verify.passed, r.verify.resolved) == (2, False)


async def test_the_agent_gets_the_network_only_when_asked_and_what_it_left_running_is_tested(
    base_image: str,
) -> None:
    # serve-after's solution pip-installs a package and leaves an HTTP server running; its tests use both
    task = load_task(TB / "tb2/serve-after")
    backend = ContainerBackend(config=FAST)
    offline = await run_policy(task, OracleAgent(), backend=backend)
    assert offline.verify.status == "ok" and offline.verify.passed == 0, offline.verify  # pip had no network
    networked = ContainerBackend(config=FAST, agent_network=True)
    oracle = await run_policy(task, OracleAgent(), backend=networked)
    assert (oracle.verify.path, oracle.verify.passed, oracle.verify.total) == ("script", 2, 2), oracle.verify
    null = await run_policy(task, NullAgent(), backend=networked)
    assert null.verify.status == "ok" and null.verify.passed == 0, null.verify
    from sandbox_agent.tasks.verifier import VerifierConfig

    # the verifier's network too: it tests the agent's container in place (a committed copy has no server)
    both = await run_policy(task, OracleAgent(), backend=networked, verifier=VerifierConfig(allow_network=True))
    assert (both.verify.path, both.verify.passed, both.verify.total) == ("script", 2, 2), both.verify


async def test_a_wheelhouse_that_could_not_be_fetched_is_said_on_the_script_path_too(
    base_image: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sandbox_agent.tasks import verifier

    why = "could not fetch six==1.16.0 from PyPI: no network"
    monkeypatch.setattr(verifier, "verifier_wheels", lambda script: (None, (), why))
    run = await run_policy(
        load_task(TB / "tb2/serve-after"), OracleAgent(), backend=ContainerBackend(config=FAST, agent_network=True)
    )
    assert (run.verify.path, run.verify.passed) == ("script", 2), run.verify  # the script's own results
    assert why in run.verify.detail, run.verify  # and the user is told what was missing
