"""A task whose image does not build is a result, not a crash (design §12): ``run-task --json`` prints its JSON
line (status ``image_build_failed``, the failing step, the unreachable host when that is the cause) and exits
3; ``check`` and ``t1async.eval`` count it apart from the policy's failures. Real podman; never a pull."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from sandbox_agent.images import build as images
from sandbox_agent.images.buildfail import IMAGE_BUILD_FAILED, parse_build_failure, unreachable_host
from sandbox_agent.sandbox.backend import ContainerBackend
from sandbox_agent.tasks.task import load_task
from t1async.eval.run import EvalConfig, run_eval
from t1async.eval.stats import scored, summarise, task_scores

ROOT = Path(__file__).resolve().parents[1]

# ------------------------------------------------------------------ podman's output, as captured


PPA_STDOUT = """STEP 1/5: FROM ubuntu:22.04
STEP 2/5: RUN apt-get update && apt-get install -y software-properties-common
--> Using cache 4b1c0e9d2a7f
--> 4b1c0e9d2a7f
STEP 3/5: RUN add-apt-repository -y ppa:deadsnakes/ppa && apt-get update
Repository: 'deb https://ppa.launchpadcontent.net/deadsnakes/ppa/ubuntu/ jammy main'
Hit:1 http://archive.ubuntu.com/ubuntu jammy InRelease
Ign:2 https://ppa.launchpadcontent.net/deadsnakes/ppa/ubuntu jammy InRelease
Reading package lists...
"""
PPA_STDERR = """W: Failed to fetch https://ppa.launchpadcontent.net/deadsnakes/ppa/ubuntu/dists/jammy/InRelease  \
Temporary failure resolving 'ppa.launchpadcontent.net'
W: Some index files failed to download. They have been ignored, or old ones used instead.
E: Unable to locate package python3.11
Error: building at STEP "RUN add-apt-repository -y ppa:deadsnakes/ppa && apt-get update": while running runtime: \
exit status 100
"""
LAUNCHPAD_STDERR = """Traceback (most recent call last):
  File "/usr/bin/add-apt-repository", line 364, in <module>
httplib2.error.ServerNotFoundError: Unable to find the server at api.launchpad.net
Error: building at STEP "RUN add-apt-repository ppa:deadsnakes/ppa": while running runtime: exit status 1
"""
CURL_STDERR = """curl: (6) Could not resolve host: sh.rustup.rs
Error: building at STEP "RUN curl -sSf https://sh.rustup.rs | sh -s -- -y": while running runtime: \
exit status 6
"""
PIP_STDERR = """WARNING: Retrying (Retry(total=0, connect=None, read=None, redirect=None, status=None)) after \
connection \
broken by 'NewConnectionError('<pip._vendor.urllib3.connection.HTTPSConnection object at 0x7f2c>: Failed to \
establish a new connection: [Errno -3] Temporary failure in name resolution')': /simple/numpy/
ERROR: Could not find a version that satisfies the requirement numpy (from versions: none)
ERROR: No matching distribution found for numpy
Error: building at STEP "RUN pip install numpy": while running runtime: exit status 1
"""
PULL_STDOUT = "STEP 1/3: FROM docker.io/library/ubuntu:22.04\n"
PULL_STDERR = """Resolving "ubuntu" using unqualified-search registries (/etc/containers/registries.conf)
Trying to pull docker.io/library/ubuntu:22.04...
Error: creating build container: initializing source docker://ubuntu:22.04: pinging container registry \
registry-1.docker.io: Get "https://registry-1.docker.io/v2/": dial tcp: lookup registry-1.docker.io on \
10.0.2.3:53: no such host
"""
NOT_KNOWN_STDERR = "Error: creating build container: docker.io/library/nonexistent:1: image not known\n"
EXIT3_STDOUT = "STEP 1/2: FROM localhost/t1async/base:bookworm-6\nSTEP 2/2: RUN exit 3\n"
EXIT3_STDERR = 'Error: building at STEP "RUN exit 3": while running runtime: exit status 3\n'


@pytest.mark.parametrize(
    ("stdout", "stderr", "step", "host"),
    [
        (
            PPA_STDOUT,
            PPA_STDERR,
            "RUN add-apt-repository -y ppa:deadsnakes/ppa && apt-get update",
            "ppa.launchpadcontent.net",
        ),
        ("", LAUNCHPAD_STDERR, "RUN add-apt-repository ppa:deadsnakes/ppa", "api.launchpad.net"),
        ("", CURL_STDERR, "RUN curl -sSf https://sh.rustup.rs | sh -s -- -y", "sh.rustup.rs"),
        (PULL_STDOUT, PULL_STDERR, "FROM docker.io/library/ubuntu:22.04", "registry-1.docker.io"),
        (EXIT3_STDOUT, EXIT3_STDERR, "RUN exit 3", None),
        (
            "STEP 1/2: FROM docker.io/library/nonexistent:1\n",
            NOT_KNOWN_STDERR,
            "FROM docker.io/library/nonexistent:1",
            None,
        ),
    ],
    ids=["apt-ppa", "add-apt-repository", "curl", "pull", "exit-3", "not-local"],
)
def test_the_failing_step_and_the_unreachable_host_are_read_from_podman(stdout, stderr, step, host):
    f = parse_build_failure(stdout, stderr)
    assert (f.step, f.host) == (step, host)
    assert "\n" not in f.cause and f.cause
    if host is not None:
        assert f.cause.startswith(f"could not reach {host}")
    if stderr is NOT_KNOWN_STDERR:
        assert "not available locally" in f.cause
    if stderr is EXIT3_STDERR:
        assert f.cause == "while running runtime: exit status 3"


def test_a_name_resolution_failure_without_a_host_name_is_not_guessed():
    assert unreachable_host(PIP_STDERR) is None  # pip's retry line names no host: none is made up
    assert unreachable_host("HTTPSConnectionPool(host='pypi.org', port=443): Max retries exceeded") == "pypi.org"
    assert unreachable_host("E: Failed to fetch http://deb.debian.org/debian/dists/bookworm/InRelease 404") == (
        "deb.debian.org"
    )


# ------------------------------------------------------------------ real podman builds (the base image, no pulls)


@pytest.fixture(scope="module")
def base_image() -> str:
    if not images.podman_available():
        pytest.fail(f"podman is missing: {images.INSTALL_HINT} (then `python -m sandbox_agent images build-base`)")
    return images.build_base()  # cached: returns at once when it exists


def write_task(root: Path, name: str, run: str) -> Path:
    """A Terminal-Bench 2 task whose Dockerfile maps to the base image (no pull) and fails at ``RUN run``."""
    d = root / name
    (d / "environment").mkdir(parents=True)
    (d / "environment" / "Dockerfile").write_text(f"FROM python:3.11-slim\nWORKDIR /app\nRUN {run}\n")
    (d / "solution").mkdir()
    (d / "solution" / "solve.sh").write_text("#!/bin/bash\necho done > /app/out.txt\n")
    (d / "tests").mkdir()
    (d / "tests" / "test_outputs.py").write_text("def test_out():\n    assert open('/app/out.txt').read()\n")
    (d / "tests" / "test.sh").write_text("#!/bin/bash\npytest /tests/test_outputs.py\n")
    (d / "instruction.md").write_text("Write /app/out.txt.\n")
    (d / "task.toml").write_text('version = "1.0"\n\n[verifier]\ntimeout_sec = 60.0\n\n[agent]\ntimeout_sec = 60.0\n')
    return d


EXIT3 = "echo building; exit 3"
# what apt prints when the PPA's host does not resolve, without needing a network to fail
UNRESOLVED = (
    'echo "W: Failed to fetch http://ppa.launchpadcontent.net/x  Temporary failure resolving '
    "'ppa.launchpadcontent.net'\" >&2; exit 100"
)


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "sandbox_agent", *args], cwd=ROOT, capture_output=True, text=True, timeout=300
    )


def test_run_task_reports_a_failed_build_as_its_json_line(base_image, tmp_path):
    task = write_task(tmp_path, "fails-to-build", EXIT3)
    r = cli("run-task", str(task), "--oracle", "--json")
    assert r.returncode == 3, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["status"] == IMAGE_BUILD_FAILED and out["step"] == f"RUN {EXIT3}" and out["host"] is None
    assert out["resolved"] is False and out["task"] == "fails-to-build" and "exit status 3" in out["detail"]
    r = cli("run-task", str(task), "--oracle")
    assert r.returncode == 3
    err = r.stderr.strip().splitlines()
    assert err[-1].startswith("error: task 'fails-to-build': image build failed at step `RUN echo building; exit 3`")


def test_run_task_names_the_host_it_could_not_reach(base_image, tmp_path):
    task = write_task(tmp_path, "needs-a-ppa", UNRESOLVED)
    r = cli("run-task", str(task), "--oracle", "--json")
    assert r.returncode == 3, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["status"] == IMAGE_BUILD_FAILED and out["host"] == "ppa.launchpadcontent.net"
    assert out["detail"].startswith("could not reach ppa.launchpadcontent.net")
    assert "could not reach ppa.launchpadcontent.net" in r.stderr.strip().splitlines()[-1]


def test_check_counts_an_unbuilt_task_apart_from_bad_ones(base_image, tmp_path):
    write_task(tmp_path, "fails-to-build", EXIT3)
    r = cli("check", str(tmp_path), "--json")
    assert r.returncode == 3, r.stdout + r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out[IMAGE_BUILD_FAILED] == 1 and out["bad"] == [] and out["ok"] == 0
    assert out["unbuilt"] == [
        {
            "task": "fails-to-build",
            "step": f"RUN {EXIT3}",
            "host": None,
            "detail": "while running runtime: exit status 3",
        }
    ]
    assert "IMG fails-to-build" in r.stdout and "0 of 0 tasks ok; 1 more could not build their image" in r.stdout


async def test_eval_counts_an_unbuilt_task_apart_from_the_policy(base_image, tmp_path):
    task = load_task(write_task(tmp_path, "fails-to-build", EXIT3))

    class NoSampler:  # the build fails before the agent's first turn: never asked
        async def generate(self, *a, **k):
            raise AssertionError("the policy was asked for a task that has no image")

    rows = await run_eval([task], NoSampler(), None, EvalConfig(samples=2, concurrency=1), backend=ContainerBackend())
    assert [r["reason"] for r in rows] == [IMAGE_BUILD_FAILED] * 2
    assert "image build failed at step `RUN echo building; exit 3`" in rows[0]["detail"]
    failed = {**rows[0], "task": "other", "reason": "max_turns", "resolved": False, "tests_passed": 0, "tests_total": 1}
    counted, unbuilt = scored(rows + [failed])
    assert unbuilt == ["fails-to-build"] and counted == [failed]
    assert summarise(task_scores(counted))["tasks"] == 1  # the policy's one failure, not three
