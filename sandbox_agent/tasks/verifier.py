"""The verifier: run a task's tests over the agent's work dir and count the passes (design §8).

Each verification opens a *fresh* sandbox session over the work dir, with a fresh copy of the task's
``tests/`` bound read-only at ``/tests`` (the agent cannot edit or pre-plant them).

In a container (the task's own image) the task's own entry point runs as Terminal-Bench runs it: TB1
``run-tests.sh``, TB2 ``tests/test.sh`` + ``/logs/verifier/reward.*`` (``path="script"``). It runs offline
unless the user gave the verifier the network: the pins the script installs are fetched on the host into a
wheelhouse mounted over the image's (``sandbox_agent.images.wheels``), and uv's installer is answered from the image
(``sandbox_agent.tasks.tbscript``), so the usual uv/pytest preamble works as written. Where the
script yields no results offline (a dependency the wheelhouse lacks, ``uvx -p 3.13``), with
``VerifierConfig(run_script=False)``, and always under bwrap, the test files (``test_*.py`` and
``*_test.py``) run directly (``path="pytest"``) with the sandbox's ``python3 -I -B`` (isolated: no user
site / PYTHON* variables; the work dir is appended to sys.path, after the standard library and pytest, so
tests import the agent's module but the agent cannot shadow pytest or plant a conftest), in a clean
environment (``env -i``), cwd = the work dir, ``TEST_DIR=/tests``. A TB2 task with only ``tests/test.sh``
(no pytest files) is run as ``bash /tests/test.sh`` and counts as one test; Harbor's rewards.json (named
rewards) counts one test per name.

Results come from pytest's junit XML (printed after a random marker) and, failing that, from the ``-rA``
short summary. A timeout is ``status="timeout"``, unreadable output ``"parse_error"``, a sandbox failure
or a pytest internal/usage error ``"error"``: all with zero passes, never counted as passes.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

import anyio

from sandbox_agent.images.wheelhouse import WHEELHOUSE
from sandbox_agent.images.wheels import verifier_wheels
from sandbox_agent.sandbox import SandboxConfig
from sandbox_agent.sandbox.backend import BackendName, SandboxBackend
from sandbox_agent.tasks.task import Task
from sandbox_agent.tasks.tbscript import (
    SHIM_DIR,
    TESTS_MOUNT,
    harbor_reward,
    harbor_rewards,
    needs_network,
    script_command,
    write_shims,
)
from t1async.log import get_logger
from t1async.protocol.errors import SandboxError

log = get_logger("sandbox_agent.tasks.verifier")

VerifyStatus = Literal["ok", "timeout", "parse_error", "error"]


@dataclass(frozen=True)
class VerifyResult:
    tests: dict[str, bool]
    passed: int
    total: int
    resolved: bool
    status: VerifyStatus
    detail: str = ""
    duration_s: float = 0.0
    path: str = "pytest"  # how it ran: "pytest" (the test files, directly) or "script" (the task's own)

    @classmethod
    def failed(cls, status: VerifyStatus, detail: str, duration_s: float = 0.0, path: str = "pytest") -> VerifyResult:
        return cls({}, 0, 0, False, status, detail, duration_s, path)

    @classmethod
    def from_tests(
        cls, tests: dict[str, bool], detail: str = "", duration_s: float = 0.0, path: str = "pytest"
    ) -> VerifyResult:
        passed = sum(tests.values())
        total = len(tests)
        return cls(dict(tests), passed, total, total > 0 and passed == total, "ok", detail, duration_s, path)


@dataclass(frozen=True)
class VerifierConfig:
    python: str = "/usr/bin/python3"
    output_limit_bytes: int = 4 << 20  # the verifier's session reads the junit XML through exec output
    timeout_s: float | None = None  # None: the task's test_timeout_s
    # Containers only: the verifier gets the network (a copy of the episode's container on podman's
    # bridge), so a task's script that fetches uv/pytest runs as written. Off unless the user asks.
    allow_network: bool = False
    # Containers: run the task's own script (as Terminal-Bench does; its uv venv + install costs seconds per
    # episode), or False: straight to its test files under pytest -rA, as under bwrap.
    run_script: bool = True
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)


# ------------------------------------------------------------------------------------------ parsing

_SUMMARY_HDR = re.compile(r"^=+ short test summary info =+$", re.MULTILINE)
_SUMMARY_LINE = re.compile(r"^(PASSED|FAILED|ERROR|XFAIL|XPASS|SKIPPED)\s+(\S+?)(?:\s+-\s.*)?$")
_OUTCOME_OK = {"PASSED": True, "XFAIL": True, "XPASS": True, "FAILED": False, "ERROR": False, "SKIPPED": False}


def _merge(tests: dict[str, bool], name: str, ok: bool) -> None:
    # a test that passed its call but errored in teardown appears twice: it passes only if every part did
    tests[name] = tests.get(name, True) and ok


def parse_junit(xml_text: str) -> dict[str, bool]:
    """Per-test outcome from pytest junit XML (xunit1 or xunit2). Raises ValueError if unreadable."""
    try:
        root = ET.fromstring(xml_text)
    except ET.ParseError as exc:
        raise ValueError(f"junit XML does not parse: {exc}") from exc
    if root.tag not in ("testsuites", "testsuite"):
        raise ValueError(f"junit XML root is <{root.tag}>, expected <testsuites> or <testsuite>")
    tests: dict[str, bool] = {}
    for case in root.iter("testcase"):
        name = case.get("name")
        if not name:
            raise ValueError("junit <testcase> without a name")
        file = case.get("file") or ""
        cls = case.get("classname") or ""
        mod = file[:-3].replace("/", ".") if file.endswith(".py") else ""
        if file and cls.startswith(mod):
            rest = cls[len(mod) :].lstrip(".")
            key = "::".join(p for p in (file, rest.replace(".", "::"), name) if p)
        else:
            key = f"{cls}::{name}" if cls else name
        bad = any(case.find(t) is not None for t in ("failure", "error", "skipped"))
        _merge(tests, key, not bad)
    return tests


def parse_pytest_summary(output: str) -> dict[str, bool]:
    """Per-test outcome from the ``-rA`` short test summary. Raises ValueError if there is none.

    Only lines after the last "short test summary info" header count, so a test's own printed output
    (shown earlier, in the PASSES/FAILURES sections) cannot fake a result.
    """
    headers = list(_SUMMARY_HDR.finditer(output))
    if not headers:
        raise ValueError("no 'short test summary info' section in pytest output")
    tests: dict[str, bool] = {}
    for line in output[headers[-1].end() :].splitlines():
        m = _SUMMARY_LINE.match(line.strip())
        if m:
            name = m.group(2)
            name = name.rsplit("/", 1)[-1] if "::" in name else name
            _merge(tests, name, _OUTCOME_OK[m.group(1)])
    return tests


def interpret(
    exit_code: int | None, junit: str | None, output: str
) -> tuple[dict[str, bool] | None, VerifyStatus, str]:
    """Combine pytest's exit code, junit XML and summary into (tests, status, detail). Pure."""
    tests: dict[str, bool] | None = None
    why = []
    if junit:
        try:
            tests = parse_junit(junit)
        except ValueError as exc:
            why.append(str(exc))
    if tests is None:
        try:
            tests = parse_pytest_summary(output)
        except ValueError as exc:
            why.append(str(exc))
    if exit_code in (2, 3, 4) and not tests:
        return None, "error", f"pytest exit code {exit_code} (interrupted/internal/usage error); " + "; ".join(why)
    if exit_code == 5:
        return None, "error", "pytest collected no tests (exit code 5)"
    if tests is None:
        return None, "parse_error", "; ".join(why) or "no test results"
    if not tests:
        return None, "parse_error", f"pytest reported no test results (exit code {exit_code})"
    all_ok = all(tests.values())
    if (exit_code == 0) != all_ok:
        return (
            None,
            "parse_error",
            (
                f"pytest exit code {exit_code} disagrees with parsed results "
                f"({sum(tests.values())}/{len(tests)} passed); not trusting them"
            ),
        )
    return tests, "ok", ""


# ------------------------------------------------------------------------------------------ running


def share_read_only(root: Path) -> None:
    """Make a host dir we bind read-only into a sandbox readable by the sandbox's unprivileged uid."""
    for dirpath, _dirnames, filenames in os.walk(root):
        os.chmod(dirpath, 0o755)
        for name in filenames:
            p = os.path.join(dirpath, name)
            os.chmod(p, os.stat(p).st_mode & 0o777 | 0o444)


def build_command(task: Task, nonce: str, python: str, deps: tuple[str, ...] = ()) -> str:
    """The shell command run inside the verifier's sandbox (cwd = the work dir).

    The work dir is *appended* to sys.path (``-I`` leaves it out): tests that import the agent's module
    (Aider polyglot's ``from bob import response``, EvoEval's) find it, while the standard library and
    pytest cannot be shadowed by a file the agent planted, and its conftest.py is never collected.
    ``deps`` (what the task's script would install; in the mounted wheelhouse) go into a dir appended first."""
    env = f'env -i PATH=/usr/local/bin:/usr/bin:/bin HOME=/tmp LANG=C.UTF-8 T1_WORKDIR="$PWD" TEST_DIR={TESTS_MOUNT}'
    out, junit = f"/tmp/t1v-{nonce}.out", f"/tmp/t1v-{nonce}.xml"
    if task.test_files:
        files = " ".join(f"{TESTS_MOUNT}/{f}" for f in task.test_files)
        target = f"/tmp/t1v-deps-{nonce}"
        own = [d for d in deps if not re.match(r"pytest([<>=!~\[]|$)", d, re.IGNORECASE)]
        pre = (
            f"{env} {python} -m pip install -q --no-index --find-links {WHEELHOUSE} --target {target} "
            + " ".join(f"'{d}'" for d in own)
            + f" >{out}.pip 2>&1; "
            if own
            else ""
        )
        path = f"sys.path.append({target!r}); " if own else ""
        main = f"import os, sys; {path}sys.path.append(os.getcwd()); import pytest; sys.exit(pytest.main(sys.argv[1:]))"
        run = (
            f'{pre}{env} {python} -I -B -c "{main}" -p no:cacheprovider -rA --tb=short --rootdir={TESTS_MOUNT} '
            f"-o junit_family=xunit1 --junitxml={junit} {files} >{out} 2>&1"
        )
    else:
        run = f"{env} bash {TESTS_MOUNT}/test.sh >{out} 2>&1"
    return (
        f"{run}; t1rc=$?; echo; echo '{nonce} RC' $t1rc; "
        f"if [ -f {junit} ]; then cat {junit}; fi; echo; echo '{nonce} OUT'; tail -c 65536 {out}; "
        f"rm -rf {junit} {out} {out}.pip /tmp/t1v-deps-{nonce}"
    )


def split_output(text: str, nonce: str) -> tuple[int | None, str | None, str]:
    """(pytest exit code, junit XML or None, pytest output) from the verifier command's output."""
    m = re.search(rf"^{nonce} RC (\d+)$", text, re.MULTILINE)
    if not m:
        return None, None, text
    rest = text[m.end() :]
    junit, _, out = rest.partition(f"\n{nonce} OUT\n")
    return int(m.group(1)), (junit.strip() or None), out


async def verify(
    task: Task, workdir: Path, backend: SandboxBackend, config: VerifierConfig = VerifierConfig()
) -> VerifyResult:
    """Run the task's tests over ``workdir`` in a fresh sandbox session. Never raises for test outcomes."""
    t0 = time.monotonic()
    if not task.test_files and task.test_script is None:
        return VerifyResult.failed("error", f"task {task.id} has no tests/test_*.py and no test script")
    timeout = config.timeout_s or task.test_timeout_s
    nonce = secrets.token_hex(8)
    # Containers run the task's own script, offline (the base image's wheelhouse stands in for the
    # network the usual uv/pytest preamble wants) unless the user gave the verifier the network. Where that
    # yields no results (a dependency not in the wheelhouse, `uvx -p 3.13`), and under bwrap (whose host env
    # is not the task's image), it runs what the script means: the test files with pytest -rA, TEST_DIR=/tests.
    in_container = backend.kind(task) == BackendName.CONTAINER
    networked = in_container and config.allow_network
    use_script = in_container and task.test_script is not None and (config.run_script or networked)
    if not use_script and not task.test_files and task.format == "tb1":
        return VerifyResult.failed(
            "error",
            f"task {task.id} has no tests/test_*.py (run-tests.sh runs only in a container: --backend container)",
        )
    # the packages the script installs, fetched on the host into a wheelhouse mounted over the image's
    house: Path | None = None
    deps: tuple[str, ...] = ()
    no_house = ""
    if in_container and task.test_script is not None and not networked:
        house, deps, no_house = await anyio.to_thread.run_sync(verifier_wheels, task.test_script)
    tmp = Path(tempfile.mkdtemp(prefix="t1v-"))
    fallback: str | None = None
    try:
        tests_copy = tmp / "tests"
        if task.tests_dir.is_dir():
            shutil.copytree(task.tests_dir, tests_copy, symlinks=False)
        else:
            tests_copy.mkdir()
        if use_script and task.format == "tb1":
            assert task.test_script is not None
            shutil.copy2(task.test_script, tests_copy / "run-tests.sh")
        share_read_only(tmp)
        cfg = replace(config.sandbox, output_limit_bytes=config.output_limit_bytes, command_timeout_s=timeout)
        try:
            opener = backend.open_networked if networked else backend.open
            binds = ((str(tests_copy), TESTS_MOUNT),) + (((str(house), WHEELHOUSE),) if house else ())
            if use_script and not networked:
                write_shims(tmp / "bin")
                binds += ((str(tmp / "bin"), SHIM_DIR),)
            async with opener(task, workdir, config=cfg, ro_binds=binds) as sb:
                if use_script:
                    res = await sb.exec(script_command(task, nonce, offline=not networked), timeout=timeout)
                    if res.timed_out:
                        return VerifyResult.failed(
                            "timeout", f"tests ran past {timeout:g}s", time.monotonic() - t0, path="script"
                        )
                    code, _, out = split_output(res.output, nonce)
                    if code is None:
                        return VerifyResult.failed(
                            "error",
                            f"verifier command did not finish (exit {res.exit_code}): {res.output[-500:]}",
                            time.monotonic() - t0,
                            "script",
                        )
                    result, conclusive = _script_result(task, code, out, nonce, time.monotonic() - t0)
                    if conclusive or not task.test_files:
                        return replace(result, detail=f"{no_house}. {result.detail}") if no_house else result
                    script = task.test_script.name if task.test_script else "the script"
                    fallback = (
                        f"ran tests/ with pytest -rA: {script} needs the network and gave no per-test "
                        f"results offline (exit {code}): "
                        f"{_last_lines(out.rpartition(f'{chr(10)}{nonce} REWARD')[0] or out)}"
                    )
                    log.info("verify.script_fallback", task=task.id, why=fallback[:300])
                res = await sb.exec(build_command(task, nonce, config.python, deps), timeout=timeout)
        except SandboxError as exc:
            return VerifyResult.failed("error", f"sandbox failed: {exc}", time.monotonic() - t0)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    dt = time.monotonic() - t0
    if res.timed_out:
        return VerifyResult.failed("timeout", f"tests ran past {timeout:g}s", dt)
    code, junit, out = split_output(res.output, nonce)
    if code is None:
        why = f"verifier command did not finish (exit {res.exit_code}): {res.output[-500:]}"
        return VerifyResult.failed("error", why, dt)
    if not task.test_files:  # tb2 test.sh only: one test, its exit status
        return VerifyResult.from_tests({"test.sh": code == 0}, out[-2000:], dt)
    tests, status, detail = interpret(code, junit, out)
    if no_house:
        detail = no_house + ". " + detail
    if fallback is not None:
        detail = fallback + ". " + detail
    elif task.test_script is not None and needs_network(task.test_script):
        detail = f"ran tests/ with pytest -rA: {task.test_script.name} needs the network. " + detail
    if tests is None:
        log.info("verify.failed", task=task.id, status=status, detail=detail[:200])
        return VerifyResult.failed(status, detail + "\n" + out[-2000:], dt)
    return VerifyResult.from_tests(tests, detail, dt)


def _last_lines(text: str, n: int = 3) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return " | ".join(lines[-n:])[-400:]


def _script_result(task: Task, code: int, out: str, nonce: str, dt: float) -> tuple[VerifyResult, bool]:
    """Per-test results from the script's pytest -rA summary where it printed one; else Harbor's reward
    (TB2) or the script's exit status (TB1) as one test. The flag says whether that is conclusive: a failing
    script that fetches things and printed no test summary (so no test ran) is not."""
    text, _, reward_text = out.rpartition(f"\n{nonce} REWARD")
    reward = harbor_reward(reward_text)
    tests, status, detail = interpret(code if reward is None else (0 if reward >= 1 else 1), None, text)
    if tests is not None:
        return VerifyResult.from_tests(tests, detail, dt, path="script"), True
    ran_nothing = task.test_script is not None and needs_network(task.test_script) and not _SUMMARY_HDR.search(text)
    if task.format == "tb2" and reward is not None:
        named = harbor_rewards(reward_text) or {}
        parts = {k: v >= 1 for k, v in named.items()} if "reward" not in named else {"reward": reward >= 1}
        res = VerifyResult.from_tests(parts, f"reward {reward:g}\n" + text[-2000:], dt, path="script")
        return res, reward >= 1 or not ran_nothing
    name = "run-tests.sh" if task.format == "tb1" else "test.sh"  # no per-test results: its exit status
    res = VerifyResult.from_tests({name: code == 0}, (detail + "\n" + text[-2000:]).strip(), dt, path="script")
    return res, code == 0 or not ran_nothing
