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
