"""Smoke runs of ``python -m bench.sampler`` (tiny sizes): the table, the --json last line with
bench_serving's field names, --output-file, --multi-turn and --compare-concurrency (embedded server)."""

from __future__ import annotations

import json

from tests.benchcli import bench

KEYS = {
    "completed",
    "request_throughput",
    "input_throughput",
    "output_throughput",
    "mean_ttft_ms",
    "median_ttft_ms",
    "p99_ttft_ms",
    "mean_itl_ms",
    "median_itl_ms",
    "p99_itl_ms",
    "mean_e2e_latency_ms",
    "median_e2e_latency_ms",
    "p99_e2e_latency_ms",
    "concurrency",
}


def test_load_run_reports_bench_serving_fields(sampler_url, tmp_path):
    out = tmp_path / "results.jsonl"
    r, stdout = bench(
        "--url",
        sampler_url,
        "--num-prompts",
        "6",
        "--concurrency",
        "3",
        "--input-len",
        "16",
        "--output-len",
        "5",
        "--output-file",
        str(out),
    )
    assert KEYS <= set(r)
    assert r["completed"] == 6 and r["failed"] == 0 and r["max_concurrency"] == 3
    assert r["total_output_tokens"] == 6 * 5 and r["total_input_tokens"] == 6 * 16
    assert r["output_throughput"] > 0 and 0 < r["mean_ttft_ms"] <= r["mean_e2e_latency_ms"]
    assert 0 < r["concurrency"] <= 3.01
    assert "Output token throughput (tok/s)" in stdout
    saved = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(saved) == 1 and saved[0]["completed"] == 6


def test_multi_turn_reports_cached_ratio(sampler_url):
    r, stdout = bench(
        "--url",
        sampler_url,
        "--multi-turn",
        "3",
        "--num-prompts",
        "2",
        "--concurrency",
        "2",
        "--input-len",
        "12",
        "--output-len",
        "4",
    )
    assert r["completed"] == 6 and [t["turn"] for t in r["per_turn"]] == [1, 2, 3]
    ctx = [t["mean_context_len"] for t in r["per_turn"]]
    assert ctx == [12, 12 + 4 + 12, 12 + 2 * (4 + 12)], "each turn's input = previous input + output + new chunk"
    assert r["per_turn"][0]["cached_ratio"] == 0
    # turn k reuses all of turn k-1's sequence but its last sampled token (never fed): (ctx - 12 - 1) / ctx
    want = sum(c - 13 for c in ctx[1:]) / sum(ctx[1:])
    assert abs(r["cached_ratio"] - want) < 1e-9, (r["cached_ratio"], want)
    assert "cached_ratio" in stdout


def test_compare_concurrency_with_the_embedded_server():
    r, stdout = bench(
        "--compare-concurrency", "1,2", "--input-len", "8", "--output-len", "4", "--max-batch", "4", timeout=180
    )
    assert [x["max_concurrency"] for x in r["levels"]] == [1, 2]
    assert [x["completed"] for x in r["levels"]] == [8, 8]
    assert r["ratio"] == r["levels"][1]["output_throughput"] / r["levels"][0]["output_throughput"]
    assert r["url"] == "embedded" and "output throughput ratio" in stdout
