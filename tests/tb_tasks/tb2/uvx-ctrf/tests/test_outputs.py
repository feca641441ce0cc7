import os
import subprocess


def test_greet_is_executable():
    assert os.access("/app/greet.sh", os.X_OK)


def test_greet_greets():
    out = subprocess.run(["/app/greet.sh", "ada"], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "hello, ada"


def test_freeze_lists_packages():
    lines = open("/app/freeze.txt").read().splitlines()
    assert lines and all("==" in ln or " @ " in ln for ln in lines)
