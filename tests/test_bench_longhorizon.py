"""bench.longhorizon end to end, shortened: real bubblewrap, real nats-server, the training child process."""

from __future__ import annotations

import json

import pytest

from bench import longhorizon


def test_short_run_reports_every_turn_and_the_json_keys(capsys):
    rc = longhorizon.main(
        ["--turns", "60", "--json", "--replays", "1", "--exec-n", "20", "--train-tokens", "1024", "--every", "30"]
    )
    assert rc == 0
    out = capsys.readouterr().out.strip().splitlines()
    res = json.loads(out[-1])
    assert {"ingest_ratio_late_early", "exec_p50_ms", "max_turn", "train_peak_rss_gb_32k"} <= res.keys()
    assert res["max_turn"] == 60
    # every boundary of a token-in episode is clean, and nothing re-sent: the late turns' records are no larger
    assert res["drift"]["clean"] == 59 and res["drift"].get("fork", 0) == 0
    assert res["wire_bytes_late"] < 2 * res["wire_bytes_early"]
    assert res["exec_p50_ms"] > 0 and res["ingest_ratio_late_early"] > 0
    assert 0.1 < res["train_peak_rss_gb_32k"] < 4 and res["train_tokens"] == 1024
    assert any(line.startswith("turn") for line in out)  # the human table


def test_too_few_turns_is_a_clear_error(capsys):
    with pytest.raises(SystemExit) as exc:
        longhorizon.main(["--turns", "20"])
    assert exc.value.code == 2
    assert "--turns must be >= 60" in capsys.readouterr().err


def test_a_model_nobody_here_wrote_runs_through_the_bench(tmp_path, capsys):
    """``--model DIR``: a transformers-written Qwen3-MoE of another shape (3 layers, one dense, 4 experts): the
    episode's routing rows, the 32k child and live training all take its shape."""
    pytest.importorskip("transformers")
    from t1async.testing.models import transformers_qwen3_dir

    d = transformers_qwen3_dir(tmp_path / "qwen3")
    argv = ["--turns", "60", "--json", "--replays", "1", "--exec-n", "5", "--train-tokens", "512"]
    rc = longhorizon.main([*argv, "--every", "30", "--exact-turns", "0", "--model", str(d)])
    assert rc == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["max_turn"] == 60 and res["drift"]["clean"] == 59 and res["train_tokens"] == 512
    assert res["live_turns"] == 60 and res["forwarded_per_trained_token"] <= 3
    with pytest.raises(SystemExit) as exc:
        longhorizon.main(["--model", str(tmp_path / "nope")])
    assert exc.value.code == 2 and "no such directory" in capsys.readouterr().err
