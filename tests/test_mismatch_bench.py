"""bench.mismatch: the text-level view counts drift where retokenization changes tokens, and a tiny run of
the whole bench (real embedded sampler in bf16) produces the JSON contract of design §11."""

from __future__ import annotations

import json

import numpy as np
import pytest

from bench._mismatch_data import SampledEpisode, SampledTurn, assemble, make_scripts, retokenize
from sandbox_agent.agent.actions import SYSTEM_PROMPT
from t1async.model.tokenizer import ChatTokenizer

L, K = 4, 2


def episode(
    tok: ChatTokenizer, outputs: list[list[int]], observation: str = "[exit code: 0]\n  a.txt\tb.txt"
) -> SampledEpisode:
    """An episode assembled token-in from given sampled outputs (what the driver does with a sampler)."""
    msgs = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "List the files."}]
    ids = list(tok.render(msgs))
    spans = []
    for k, out in enumerate(outputs):
        spans.append((len(ids), len(ids) + len(out)))
        ids += out
        msgs.append({"role": "assistant", "content": tok.decode(out, skip_special_tokens=True)})
        if k < len(outputs) - 1:
            msgs.append({"role": "user", "content": observation})
            ids += tok.bridge_ids(out) + tok.message_ids("user", observation) + tok.generation_prompt_ids()
    s = len(ids)
    loss = np.zeros(s, bool)
    for a, b in spans:
        loss[a:b] = True
    rng = np.random.default_rng(0)
    routing = np.stack([rng.permutation(8)[:K] for _ in range(s * L)]).reshape(s, L, K).astype(np.int16)
    routing[-1] = -1
    lps = np.where(loss, -0.5, 0.0).astype(np.float32)
    seq = np.asarray(ids, np.int32)
    turns, start = [], 0
    for a, b in spans:  # each turn's input is everything before its output; routing rows not sent before
        turns.append(SampledTurn(seq[:a], seq[a:b], lps[a:b], "stop", routing[start : b - 1], start))
        start = b - 1
    return SampledEpisode(seq, loss, lps, routing, tuple(spans), tuple(msgs), tuple(turns))


def test_canonical_outputs_retokenize_without_drift():
    tok = ChatTokenizer.load()
    outs = [tok.encode("```bash\nls -la\n```") + [tok.end_of_turn_id], tok.encode("DONE") + [tok.end_of_turn_id]]
    ep = episode(tok, outs)
    r = retokenize(ep, tok)
    n = len(ep.tokens)
    assert r.tokens[:n].tolist() == ep.tokens.tolist()
    assert r.loss_mask[:n].tolist() == ep.loss_mask.tolist() and not r.loss_mask[n:].any()
    assert r.drift.sum() == 0 and r.dropped == 0 and r.id_match[r.loss_mask].all()
    np.testing.assert_array_equal(r.routing[: n - 1], ep.routing[: n - 1])


def test_noncanonical_output_drifts_and_shifts_later_context():
    tok = ChatTokenizer.load()
    canon = tok.encode("cat notes.txt")
    split = tok.encode("c") + tok.encode("at") + tok.encode(" no") + tok.encode("tes.txt")  # same text, other IDs
    assert tok.decode(split) == "cat notes.txt" and split != canon
    ep = episode(tok, [split + [tok.end_of_turn_id], tok.encode("DONE") + [tok.end_of_turn_id]])
    r = retokenize(ep, tok)
    first_turn = r.loss_mask & (np.arange(len(r.tokens)) < ep.turn_spans[1][0] - 5)
    assert r.drift[first_turn].any()  # the first turn's IDs changed
    assert r.dropped == len(split) - len(canon)  # the re-encoded turn is shorter: sampled tokens lost
    assert r.drift[r.loss_mask].all()  # the second turn matches in ID but not in context
    assert not r.id_match[first_turn].all()
    # routing is still replayed where a token diff aligns the sequences (the shared prompt, for one)
    assert (r.routing[:10] == ep.routing[:10]).all()


def test_exact_ids_through_the_learners_tito_assembly_keep_every_sampled_token():
    tok = ChatTokenizer.load()
    split = tok.encode("c") + tok.encode("at") + tok.encode(" no") + tok.encode("tes.txt")  # non-canonical
    ep = episode(
        tok,
        [
            split + [tok.end_of_turn_id],
            tok.encode("ls") + [tok.end_of_turn_id],
            tok.encode("DONE") + [tok.end_of_turn_id],
        ],
    )
    segs, stats = assemble(ep, "e")
    assert len(segs) == 1 and stats.clean == stats.boundaries == 2 and stats.fork == stats.realign == 0
    seg = segs[0]
    assert seg.tokens.tolist() == ep.tokens.tolist() and seg.loss_mask.tolist() == ep.loss_mask.tolist()
    np.testing.assert_array_equal(seg.logprobs, ep.logprobs)
    np.testing.assert_array_equal(seg.routing[:-1], ep.routing[:-1])


def test_scripts_hold_real_shell_output():
    scripts = make_scripts(3, 3, seed=1)
    assert len(scripts) == 3 and all(len(s.observations) == 2 for s in scripts)
    assert all(o.startswith("[exit code:") for s in scripts for o in s.observations)


@pytest.mark.slow
def test_tiny_bench_run_writes_the_json_contract(tmp_path, capsys):
    from bench.mismatch import CONFIGS, main

    rc = main(
        [
            "--episodes",
            "2",
            "--turns",
            "2",
            "--max-new-tokens",
            "12",
            "--sft-steps",
            "0",
            "--json",
            "--max-batch",
            "4",
            "--out",
            str(tmp_path),
        ]
    )
    assert rc == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    res = json.loads(last)
    assert set(res["configs"]) == set(CONFIGS)
    for c in CONFIGS:
        assert set(res["configs"][c]) >= {"mean_abs_dlogp", "loss_drift_tokens", "routing_drift"}
    assert res["configs"]["tito"]["loss_drift_tokens"] == 0 and res["configs"]["tito_r3"]["loss_drift_tokens"] == 0
    # bf16 serving vs the fp32 learner: a real, non-zero mismatch on exact IDs
    assert res["configs"]["tito"]["mean_abs_dlogp"] > 0
    assert res["sampler_dtype"] == "bfloat16" and res["sampled_tokens"] > 0
    tb = res["tito_boundaries"]
    assert tb["boundaries"] == 2 and tb["clean"] == 2 and tb["fork"] == 0  # token-in episodes: clean boundaries
    assert (tmp_path / "mismatch.png").stat().st_size > 1000
    cfg = res["configs"]
    assert res["ratio"] == pytest.approx(
        cfg["tito_r3"]["mean_abs_dlogp"] / cfg["baseline"]["mean_abs_dlogp_id_matched"]
    )
    assert cfg["tito"]["mean_abs_dlogp_id_matched"] == cfg["tito"]["mean_abs_dlogp"]  # exact IDs: all matched
    assert cfg["tito"]["loss_id_mismatch_tokens"] == 0
    assert json.loads((tmp_path / "mismatch.json").read_text())["configs"] == res["configs"]


def test_ratio_divides_by_the_id_matched_baseline_not_the_raw_one():
    from bench.mismatch import ratios

    cfg = {
        "baseline": {"mean_abs_dlogp": 1.31, "mean_abs_dlogp_id_matched": 0.0156},
        "tito": {"mean_abs_dlogp": 0.0036},
        "tito_r3": {"mean_abs_dlogp": 0.0033},
    }
    r = ratios(cfg)
    assert r["ratio"] == pytest.approx(0.0033 / 0.0156) and r["ratio_tito"] == pytest.approx(0.0036 / 0.0156)
    assert r["ratio_raw"] == pytest.approx(0.0033 / 1.31)


@pytest.mark.parametrize("quick", [False, True])
def test_help_states_the_sizes_the_code_runs(quick, monkeypatch, capsys):
    import re

    import bench.mismatch as bm

    with pytest.raises(SystemExit):
        bm.main(["--help"])
    helptext = " ".join(capsys.readouterr().out.split("options:")[-1].split())  # the flags' help, not the usage
    seen = {}

    def fake_run(args):
        seen.update(vars(args))
        raise SystemExit(7)

    monkeypatch.setattr(bm, "run", fake_run)
    with pytest.raises(SystemExit):
        bm.main(["--quick"] if quick else [])
    for flag in ("episodes", "turns", "max-new-tokens", "sft-steps", "sft-tasks", "sft-batch-tokens"):
        m = re.search(rf"--{flag} \S+ (?:(?!--).)*?\(default (\d+); quick (\d+)[;)]", helptext)
        assert m, flag
        assert seen[flag.replace("-", "_")] == int(m.group(2) if quick else m.group(1)), flag


def test_tiny_qwen3_moe_is_built_seeded_in_the_hf_layout(tmp_path):
    from bench._mismatch_model import tiny_model_dir
    from t1async.model.config import QWEN3_MOE, MoEConfig
    from t1async.model.weights import load_pretrained

    d = tiny_model_dir("qwen3-moe-tiny", tmp_path)
    hf = json.loads((d / "config.json").read_text())
    assert hf["architectures"] == [QWEN3_MOE] and hf["mlp_only_layers"] == [0]
    assert hf["num_key_value_heads"] < hf["num_attention_heads"] and hf["vocab_size"] == ChatTokenizer.load().vocab_size
    cfg = MoEConfig.load(d)
    assert cfg.qk_norm and cfg.dense_layers == (0,) and cfg.moe_layers == (1, 2, 3)
    assert tiny_model_dir("qwen3-moe-tiny", tmp_path) == d  # cached: built once
    a = load_pretrained(d).state_dict()
    other = tiny_model_dir("qwen3-moe-tiny", tmp_path / "again")  # a fresh build: the same seeded weights
    b = load_pretrained(other).state_dict()
    assert all(bool((a[k] == b[k]).all()) for k in a)
    with pytest.raises(ValueError, match="qwen3-moe-tiny"):
        tiny_model_dir("llama-tiny", tmp_path)


def test_routing_drift_leaves_dense_layers_out():
    from bench.mismatch import _routing_drift

    rec = np.array([[[0, 0], [1, 2], [3, 4]], [[0, 0], [1, 2], [3, 4]]])  # layer 0 dense: zero rows
    free = rec.copy()
    free[0, 1] = [1, 5]  # one of the 4 (token, MoE layer) choices differs
    assert _routing_drift(free, rec, [1, 2]) == (1, 4)
    assert _routing_drift(free, rec, [0, 1, 2]) == (1, 6)  # counting the dense layer would dilute it


def test_a_model_that_is_not_a_model_dir_is_a_usage_error(tmp_path, capsys):
    from bench.mismatch import main

    with pytest.raises(SystemExit) as info:
        main(["--model", str(tmp_path), "--out", str(tmp_path / "out")])
    assert info.value.code == 2 and "lacks config.json" in capsys.readouterr().err


@pytest.mark.slow
def test_quick_run_on_a_tiny_qwen3_moe_writes_the_json_contract(tmp_path, capsys):
    from bench.mismatch import CONFIG_KEYS, CONFIGS, main

    argv = ["--model", "qwen3-moe-tiny", "--quick", "--episodes", "2", "--turns", "2", "--max-new-tokens", "12"]
    argv += ["--sft-steps", "0", "--max-batch", "4", "--json", "--warm-cache", str(tmp_path), "--out", str(tmp_path)]
    assert main(argv) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert "qwen3-moe-tiny" in res["model"] and res["sampler_dtype"] == "bfloat16" and res["learner_dtype"] == "float32"
    assert set(res["configs"]) == set(CONFIGS) and all(set(res["configs"][c]) == set(CONFIG_KEYS) for c in CONFIGS)
    assert {"ratio", "ratio_tito", "ratio_raw", "paper", "tito_boundaries"} <= set(res)
    assert res["paper"] == {"baseline": 0.021, "tito_r3": 0.013, "ratio": 0.62}
    cfg = res["configs"]
    assert cfg["tito"]["mean_abs_dlogp"] > 0 and cfg["tito_r3"]["loss_drift_tokens"] == 0  # bf16 vs fp32: real
    assert 0 <= cfg["tito"]["routing_drift"] <= 1 and res["sampled_tokens"] > 0
