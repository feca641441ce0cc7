"""``python -m sandbox_agent``: run as a real subprocess."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "sandbox_agent" / "fixtures"


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "sandbox_agent", *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize("sub", [[], ["synth"], ["decontam"], ["run-task"], ["check"], ["list"]])
def test_help_everywhere(sub):
    r = cli(*sub, "--help")
    assert r.returncode == 0 and "usage: python -m sandbox_agent" in r.stdout


def test_run_task_oracle_and_null_json():
    r = cli("run-task", str(FIXTURES / "tb2" / "word-count"), "--oracle", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert (out["agent"], out["status"], out["reward"], out["total"], out["resolved"]) == ("oracle", "ok", 4, 4, True)
    assert "PASS  test_outputs.py::test_freq" in r.stdout and "resolved=True" in r.stdout
    r = cli("run-task", str(FIXTURES / "tb2" / "word-count"), "--agent", "null", "--json")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert (out["agent"], out["reward"], out["resolved"]) == ("null", 1, False)
    assert "FAIL  test_outputs.py::test_lines" in r.stdout


def test_run_task_errors_are_clear(tmp_path):
    r = cli("run-task", str(tmp_path / "missing"))
    assert r.returncode == 1 and "does not exist" in r.stderr and "Traceback" not in r.stderr
    r = cli("run-task", str(FIXTURES / "tb1" / "needs-image"), "--oracle")
    assert r.returncode == 1 and "needs image" in r.stderr and "no container backend" in r.stderr
    r = cli("run-task", str(FIXTURES / "tb1" / "hello-world"), "--oracle", "--agent", "null")
    assert r.returncode == 2 and "not allowed with" in r.stderr
    r = cli("run-task", str(FIXTURES / "tb1" / "hello-world"), "--agent", "gpt")
    assert r.returncode == 2 and "invalid choice" in r.stderr
    r = cli("synth", "--out", str(tmp_path / "x"), "--n", "2", "--families", "files,bogus")
    assert r.returncode == 1 and "unknown task family 'bogus'" in r.stderr
    r = cli("decontam", "--corpus", str(tmp_path / "none"), "--against", str(FIXTURES))
    assert r.returncode == 1 and "does not exist" in r.stderr


def test_synth_list_and_decontam(tmp_path):
    out = tmp_path / "corpus"
    r = cli("synth", "--out", str(out), "--n", "12", "--seed", "4", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1])["tasks"] == 12 and len(list(out.glob("*/task.yaml"))) == 12
    r = cli("list", str(out), "--json")
    listed = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(listed) == 12 and {t["format"] for t in listed} == {"tb1"}
    r = cli("decontam", "--corpus", str(out), "--against", str(FIXTURES), "--json")
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout.strip().splitlines()[-1])
    assert rep["corpus_tasks"] == 12 and rep["against_tasks"] == 6 and rep["flagged"] == []
    assert "corpus task" in r.stdout and "flagged 0 of 12" in r.stdout
    r = cli("decontam", "--corpus", str(FIXTURES), "--against", str(FIXTURES), "--json")
    rep = json.loads(r.stdout.strip().splitlines()[-1])
    assert rep["flagged_count"] == 6  # a benchmark against itself: everything overlaps


def test_check_passes_good_tasks_and_fails_a_broken_oracle(tmp_path):
    r = cli("check", str(FIXTURES / "tb2"), "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert (out["tasks"], out["ok"], out["skipped"]) == (2, 2, ["custom-image"])
    shutil.copytree(FIXTURES / "tb1" / "hello-world", tmp_path / "broken")
    (tmp_path / "broken" / "solution.sh").write_text("echo 'Hello, wrld!' > hello.txt\n")
    r = cli("check", str(tmp_path), "--json")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert r.returncode == 1 and out["bad"] == ["broken"] and "BAD broken" in r.stdout
