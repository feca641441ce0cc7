import shutil
from pathlib import Path


def test_jq_is_installed():
    assert shutil.which("jq")


def test_adults():
    assert Path("/app/adults.txt").read_text().split() == ["ada", "cy"]
