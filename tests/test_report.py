"""`cluster report`: a one-page picture of a run from a real metrics.jsonl (tests/data/metrics_run.jsonl is
a thinned copy of one written by `cluster up` with the default settings: 6 minutes, 15 learner steps)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from t1async.cluster import cli
from t1async.cluster.observe.report import load, report
from t1async.protocol.errors import ConfigError

DATA = Path(__file__).parent / "data" / "metrics_run.jsonl"


def ink(png: Path) -> float:
    """Share of pixels that are not background white."""
    import matplotlib.image

    img = matplotlib.image.imread(str(png))[..., :3]
    return float((img.min(axis=-1) < 0.95).mean())


def test_report_draws_every_panel_from_a_real_run(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(DATA, run / "metrics.jsonl")
    assert cli.main(["report", "--run-dir", str(run)]) == 0
    out = capsys.readouterr().out
    assert f"wrote {run / 'report.png'} and {run / 'report.html'}" in out and "steps 15" in out
    assert "reward_mean" not in out, "no episode ended in this run: no reward figure"
    import matplotlib.image

    img = matplotlib.image.imread(str(run / "report.png"))
    assert img.shape[:2] == (900, 1600)
    full = ink(run / "report.png")
    # the same run cut to its first learner record has (nearly) nothing to draw: far less ink
    first = [x for x in DATA.read_text().splitlines() if json.loads(x)["component"] == "learner"][:1]
    (run / "metrics.jsonl").write_text("\n".join(first) + "\n")
    report(run, tmp_path / "early.png")
    assert full > 0.05 and full > 1.5 * ink(tmp_path / "early.png"), (full, ink(tmp_path / "early.png"))
    page = (run / "report.html").read_text()
    assert "data:image/png;base64," in page and "<th>turns_trained</th><td>240</td>" in page


def test_the_series_hold_what_the_run_recorded():
    rs = load(DATA)
    assert [s["step"] for s in rs.steps] == list(range(1, 16))
    assert all({"t_forward_s", "t_backward_s", "t_checkpoint_s", "t_push_s"} <= s.keys() for s in rs.steps)
    assert len(rs.actors) == 2 and rs.actor_turns[-1][1] > 0
    assert all("entropy" not in r for r in rs.learner), "a figure not computed is not written"


def test_bad_metrics_files_give_one_line_errors(tmp_path):
    with pytest.raises(ConfigError, match="no such file; `cluster up` writes it"):
        load(tmp_path / "none.jsonl")
    lines = DATA.read_text().splitlines()
    torn = tmp_path / "torn.jsonl"
    torn.write_text("\n".join(lines[:5]) + "\n" + lines[5][:40])  # a crash mid-write
    assert len(load(torn).learner) + sum(1 for _ in load(torn).actor_turns) == 5
    bad = tmp_path / "bad.jsonl"
    bad.write_text(lines[0] + "\nnot json\n" + lines[1] + "\n")
    with pytest.raises(ConfigError, match=r"bad.jsonl:2: not a JSON line"):
        load(bad)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ConfigError, match="holds no records yet"):
        load(empty)
