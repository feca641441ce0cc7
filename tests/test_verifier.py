"""The verifier: parsing (junit, -rA summary, exit-code cross-check) and real runs in bubblewrap."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from sandbox_agent.agent.runner import prepared_workdir
from sandbox_agent.sandbox.backend import BwrapBackend
from sandbox_agent.tasks.task import load_task
from sandbox_agent.tasks.verifier import (
    VerifierConfig,
    VerifyResult,
    interpret,
    parse_junit,
    parse_pytest_summary,
    split_output,
    verify,
)

FIXTURES = Path(__file__).resolve().parents[1] / "sandbox_agent" / "fixtures"

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" errors="1" failures="1"
 skipped="1" tests="5"><testcase classname="test_outputs" name="test_a" file="test_outputs.py" line="3"/>
<testcase classname="test_outputs" name="test_b" file="test_outputs.py" line="7"><failure message="boom">x</failure></testcase>
<testcase classname="test_outputs.TestK" name="test_c[1-2]" file="test_outputs.py" line="9"/>
<testcase classname="test_outputs" name="test_d" file="test_outputs.py" line="11"><skipped message="s"/></testcase>
<testcase classname="test_outputs" name="test_a" file="test_outputs.py" line="3"><error message="teardown"/></testcase>
</testsuite></testsuites>"""  # noqa: E501 (a JUnit report as pytest writes it)

SUMMARY = """\
test_outputs.py .F                                                     [100%]
=================================== PASSES ===================================
PASSED test_outputs.py::test_fake - printed by a test, above the summary
=========================== short test summary info ============================
PASSED ../tests/test_outputs.py::test_a
FAILED ../tests/test_outputs.py::test_b - assert 1 == 2
ERROR ../tests/test_outputs.py::test_c - RuntimeError
XFAIL ../tests/test_outputs.py::test_d - flaky
========================= 2 passed, 1 failed, 1 error in 0.1s =================
"""


def test_parse_junit_outcomes_and_names():
    tests = parse_junit(JUNIT)
    assert tests == {
        "test_outputs.py::test_a": False,  # passed its call, errored in teardown: not a pass
        "test_outputs.py::test_b": False,
        "test_outputs.py::TestK::test_c[1-2]": True,
        "test_outputs.py::test_d": False,  # skipped is never counted as passed
    }


@pytest.mark.parametrize("bad", ["", "<html>not junit</html>", "<testsuites><testcase", "garbage \x00 bytes"])
def test_parse_junit_rejects_garbage(bad):
    with pytest.raises(ValueError):
        parse_junit(bad)


def test_parse_summary_uses_only_the_summary_section():
    tests = parse_pytest_summary(SUMMARY)
    assert tests == {
        "test_outputs.py::test_a": True,
        "test_outputs.py::test_b": False,
        "test_outputs.py::test_c": False,
        "test_outputs.py::test_d": True,
    }
    assert "test_outputs.py::test_fake" not in tests
    with pytest.raises(ValueError):
        parse_pytest_summary("PASSED test_x.py::test_y\n1 passed")


def test_interpret_statuses():
    ok_xml = '<testsuites><testsuite><testcase classname="m" name="t1" file="m.py"/></testsuite></testsuites>'
    assert interpret(0, ok_xml, "") == ({"m.py::t1": True}, "ok", "")
    tests, status, detail = interpret(1, ok_xml, "")  # exit code says failure, results say pass: distrust
    assert tests is None and status == "parse_error" and "disagrees" in detail
    assert interpret(0, None, "total garbage output")[1] == "parse_error"
    assert interpret(None, "<broken", "no summary either")[1] == "parse_error"
    assert interpret(4, None, "ERROR: usage")[1] == "error"
    assert interpret(5, None, "no tests ran")[1] == "error"
    tests, status, _ = interpret(1, None, SUMMARY)  # junit missing: the summary is the fallback
    assert status == "ok" and sum(tests.values()) == 2


def test_split_output_and_result_records():
    nonce = "abc123"
    text = f"junk\n{nonce} RC 1\n<testsuites/>\n\n{nonce} OUT\npytest said things\n"
    assert split_output(text, nonce) == (1, "<testsuites/>", "pytest said things\n")
    assert split_output("no marker at all", nonce) == (None, None, "no marker at all")
    r = VerifyResult.from_tests({"a": True, "b": True})
    assert (r.passed, r.total, r.resolved, r.status) == (2, 2, True, "ok")
    assert not VerifyResult.from_tests({}).resolved  # zero tests never resolve
    f = VerifyResult.failed("timeout", "slow")
    assert (f.passed, f.resolved, f.status) == (0, False, "timeout")


# ------------------------------------------------------------------------------------------ real runs


def _copy_task(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


async def test_real_pass_and_fail_counts(tmp_path):
    task = load_task(FIXTURES / "tb2" / "word-count")
    backend = BwrapBackend()
    async with prepared_workdir(task, backend) as wd:
        empty = await verify(task, wd, backend)
        assert (empty.status, empty.passed, empty.total, empty.resolved) == ("ok", 1, 4, False)
        (wd / "lines.txt").write_text("3\n")
        (wd / "words.txt").write_text("18\n")
        two = await verify(task, wd, backend)
        assert two.passed == 3 and two.tests["test_outputs.py::test_words"] and not two.resolved


async def test_agent_cannot_tamper_with_tests_or_pytest(tmp_path):
    """Planted conftest.py / pytest.py / fake tests in the work dir change nothing."""
    task = load_task(FIXTURES / "tb1" / "hello-world")
    backend = BwrapBackend()
    async with prepared_workdir(task, backend) as wd:
        (wd / "conftest.py").write_text(
            "import pytest\n@pytest.hookimpl(tryfirst=True)\ndef pytest_runtest_call(item):\n    pass\n"
        )
        (wd / "pytest.py").write_text("raise SystemExit(0)\n")
        (wd / "tests").mkdir()
        (wd / "tests" / "test_outputs.py").write_text("def test_hello_file_exists():\n    pass\n")
        (wd / "pytest.ini").write_text("[pytest]\naddopts = -p no:junitxml\n")
        r = await verify(task, wd, backend)
        assert r.status == "ok" and r.passed == 0 and r.total == 3
    assert (task.tests_dir / "test_outputs.py").read_text().count("def test_") == 3


async def test_tests_are_read_only_inside(tmp_path):
    src = _copy_task(FIXTURES / "tb1" / "hello-world", tmp_path / "t")
    (src / "tests" / "test_outputs.py").write_text(
        "import os, pathlib\n\n"
        "def test_write_own_file():\n"
        "    pathlib.Path(__file__).write_text('x')\n\n"
        "def test_x():\n    assert True\n\n"
        "def test_y():\n    assert True\n"
    )
    task = load_task(src)
    backend = BwrapBackend()
    async with prepared_workdir(task, backend) as wd:
        r = await verify(task, wd, backend)
    assert r.tests == {
        "test_outputs.py::test_write_own_file": False,
        "test_outputs.py::test_x": True,
        "test_outputs.py::test_y": True,
    }


async def test_timeout_is_reported_not_passed(tmp_path):
    src = _copy_task(FIXTURES / "tb1" / "hello-world", tmp_path / "t")
    (src / "tests" / "test_outputs.py").write_text("import time\n\ndef test_slow():\n    time.sleep(30)\n")
    task = load_task(src)
    backend = BwrapBackend()
    async with prepared_workdir(task, backend) as wd:
        r = await verify(task, wd, backend, VerifierConfig(timeout_s=1.5))
    assert (r.status, r.passed, r.resolved) == ("timeout", 0, False)


async def test_collection_error_and_garbage_exit(tmp_path):
    src = _copy_task(FIXTURES / "tb1" / "hello-world", tmp_path / "t")
    (src / "tests" / "test_outputs.py").write_text("import os\nos._exit(0)\n")  # pytest dies "successfully"
    task = load_task(src)
    backend = BwrapBackend()
    async with prepared_workdir(task, backend) as wd:
        r = await verify(task, wd, backend)
    assert r.status in ("parse_error", "error") and r.passed == 0 and not r.resolved


async def test_tb2_test_sh_only_task():
    task = load_task(FIXTURES / "tb2" / "exit-status-only")
    backend = BwrapBackend()
    async with prepared_workdir(task, backend) as wd:
        r0 = await verify(task, wd, backend)
        (wd / "logs").mkdir()
        (wd / "logs" / "app.log").write_text("")
        (wd / "logs").chmod(0o755)
        r1 = await verify(task, wd, backend)
    assert (r0.passed, r0.total, r0.resolved) == (0, 1, False)
    assert (r1.passed, r1.total, r1.resolved) == (1, 1, True)
