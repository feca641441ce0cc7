"""`cluster report`'s HTML page in a real headless browser: Debian's chromium renders it to a screenshot, and the
screenshot has the window's size and shows the report (the page with its chart draws far more than the same
page with the chart taken out). chromium comes from `apt-get install chromium` (.ci/run installs it)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from t1async.cluster import cli

DATA = Path(__file__).parent / "data" / "metrics_run.jsonl"
WIDTH, HEIGHT = 1280, 1100


def ink(png: Path) -> float:
    """Share of pixels that are not background white."""
    import matplotlib.image

    img = matplotlib.image.imread(str(png))[..., :3]
    return float((img.min(axis=-1) < 0.95).mean())


def screenshot(page: Path, out: Path, profile: Path, timeout_s: float = 180.0) -> Path:
    """Render ``page`` with headless chromium into ``out`` (PNG). No network: the page is a local file whose
    only image is inline, and every host name resolves to nothing. A fresh profile dir; on a timeout the
    browser we started (its own session: the process it forks) is killed."""
    exe = shutil.which("chromium")
    assert exe is not None, "chromium is not installed: apt-get install chromium (Debian's package; .ci/run does it)"
    argv = [
        exe,
        "--headless",
        "--no-sandbox",  # root in CI; the page is our own file, with no script
        "--disable-gpu",
        "--no-first-run",
        "--no-default-browser-check",
        "--disable-extensions",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--host-resolver-rules=MAP * ~NOTFOUND",
        "--proxy-server=127.0.0.1:9",
        "--hide-scrollbars",
        f"--user-data-dir={profile}",
        f"--window-size={WIDTH},{HEIGHT}",
        f"--screenshot={out}",
        page.resolve().as_uri(),
    ]
    log = out.with_suffix(".log")
    with open(log, "wb") as err:
        proc = subprocess.Popen(argv, stdout=err, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the session we started: the browser and its helpers
            proc.wait()
            pytest.fail(f"chromium did not finish the screenshot in {timeout_s:.0f} s; its output: {log}")
    tail = log.read_text(errors="replace")[-2000:]
    assert rc == 0 and out.is_file(), f"chromium exited {rc} without a screenshot:\n{tail}"
    return out


def test_report_renders_in_headless_chromium(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(DATA, run / "metrics.jsonl")
    assert cli.main(["report", "--run-dir", str(run)]) == 0
    page = run / "report.html"
    shot = screenshot(page, tmp_path / "report.png", tmp_path / "profile")

    import matplotlib.image

    img = matplotlib.image.imread(str(shot))
    assert img.shape[:2] == (HEIGHT, WIDTH), img.shape
    full = ink(shot)
    # the same page without its chart (the table and title only): the chart is what fills the screenshot
    bare = tmp_path / "bare.html"
    bare.write_text(re.sub(r"<img [^>]*>", "", page.read_text()), encoding="utf-8")
    assert "<table>" in bare.read_text() and "<img" not in bare.read_text()
    bare_ink = ink(screenshot(bare, tmp_path / "bare.png", tmp_path / "profile-bare"))
    assert full > 0.05 and full > 3 * bare_ink > 0, (full, bare_ink)
