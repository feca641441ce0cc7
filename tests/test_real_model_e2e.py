"""A real architecture through the whole loop: transformers builds a tiny Qwen3-MoE (random weights, no
download), ``cluster up --model DIR`` serves and trains it with TITO and R3 for two steps, and the checkpoint
the learner writes is one transformers loads, with our logits."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from t1async.credits.settle import read_step_log
from t1async.learner.checkpoint import latest_checkpoint
from t1async.model.tokenizer import ChatTokenizer
from t1async.model.weights import load_pretrained
from t1async.testing.models import transformers_moe_dir, transformers_qwen3_dir
from tests.clusterargs import cluster_up

pytestmark = pytest.mark.slow
transformers = pytest.importorskip("transformers")  # a dev dependency: the reference implementation


@pytest.mark.parametrize(("family", "arch"), [("qwen3", "Qwen3MoeForCausalLM"), ("olmoe", "OlmoeForCausalLM")])
def test_cluster_up_trains_a_transformers_moe_and_writes_a_checkpoint_transformers_loads(
    tmp_path, repo_env, family, arch
):
    """Two families with different routers: Qwen3-MoE (renormalised top-k, a dense layer) and OLMoE (gates
    from the softmax over all experts, whole-projection q/k norms, clip_qkv)."""
    model = transformers_moe_dir(tmp_path / family, family)
    run = tmp_path / "run"
    args = ["--model", str(model), "--steps", "2", "--batch-turns", "4", "--synth-tasks", "6", "--max-turns", "3"]
    args += ["--actors", "1", "--concurrency", "2", "--max-new-tokens", "16", "--plain"]
    with cluster_up(run, args, env=repo_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-3000:]
    assert "learner finished" in out.splitlines()[-1], out[-2000:]
    ckpt = latest_checkpoint(run / "checkpoints")
    assert ckpt is not None and ckpt.policy_version == 2
    config = json.loads((ckpt.path / "config.json").read_text())
    assert config["architectures"] == [arch]
    # the steps trained sampled tokens with no loss-region drift (TITO) and the recorded routes (R3)
    steps = read_step_log(run / "learner" / "steps.jsonl")
    assert sorted(steps) == [0, 1] and all(s["turns"] for s in steps.values())
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    drift = [m["drift"] for m in metrics if m.get("component") == "learner" and "drift" in m][-1]
    assert drift["clean"] > 0 and drift["realign"] == 0, drift  # every turn boundary exact: nothing re-tokenized
    # transformers loads what the learner wrote, and computes our logits
    ref = transformers.AutoModelForCausalLM.from_pretrained(ckpt.path, dtype=torch.float32).eval()
    ours = load_pretrained(ckpt.path)
    ids = torch.tensor([[5, 17, 300, 9, 44, 1000, 2, 3]])
    with torch.no_grad():
        want = ref(input_ids=ids).logits
        got = ours(ids).logits
    assert torch.max(torch.abs(want - got)) <= 1e-4
    trained = load_pretrained(model)
    with torch.no_grad():
        before = trained(ids).logits
    assert torch.max(torch.abs(before - got)) > 1e-6  # the two steps changed the weights


# Phi-3's chat template: a role token per message, <|end|> closes every turn (eos is another token)
PHI3 = (
    "{% for message in messages %}{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
PHI3_SPECIAL = ["<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>", "<|end|>"]
CORPUS = [
    "ls -la /tmp && cat /tmp/data.csv | wc -l",
    "The file has 42 lines. Count the words with wc -w.",
    "```bash\ngrep -rn 'error' /var/log | head -n 20\n```",
    "def main():\n    print('hello, world')\n",
    "All tests passed. Done: the answer is in /tmp/out.txt",
]


def own_tokenizer(d: Path) -> Path:
    """A byte-level BPE trained here by the ``tokenizers`` library on a few lines (no hub, nothing shipped),
    with Phi-3's special tokens and chat template: a tokenizer unlike the shipped one in every id."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=700, special_tokens=PHI3_SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS * 20, trainer)
    d.mkdir(parents=True)
    tok.save(str(d / "tokenizer.json"))
    config = {
        "added_tokens_decoder": {
            str(tok.token_to_id(t)): {
                "content": t,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for t in PHI3_SPECIAL
        },
        "bos_token": None,
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "chat_template": PHI3,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 8192,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (d / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return d


@pytest.mark.parametrize("gen", [True, False])
def test_a_tokenizer_built_here_renders_and_encodes_as_transformers(tmp_path, gen):
    """Our template rendering and encoding of a model dir with a tokenizer of its own equal transformers'
    ``apply_chat_template`` on the same dir; its end of turn is the template's <|end|>, not the eos."""
    d = own_tokenizer(tmp_path / "tok")
    ours = ChatTokenizer.load(d)
    theirs = transformers.AutoTokenizer.from_pretrained(d)
    convo = [
        {"role": "system", "content": "You are a terminal agent."},
        {"role": "user", "content": "Count the lines in /tmp/data.csv"},
        {"role": "assistant", "content": "```bash\nwc -l /tmp/data.csv\n```"},
        {"role": "tool", "content": "42 /tmp/data.csv"},
    ]
    text = theirs.apply_chat_template(convo, tokenize=False, add_generation_prompt=gen)
    assert ours.render_text(convo, add_generation_prompt=gen) == text
    assert ours.render(convo, add_generation_prompt=gen) == theirs.encode(text, add_special_tokens=False)
    assert ours.vocab_size == len(theirs) and ours.vocab_size != ChatTokenizer.load().vocab_size
    assert ours.end_of_turn_id == theirs.convert_tokens_to_ids("<|end|>") != theirs.eos_token_id
    # the exact-ID pieces an actor appends decode to what the template writes
    ids = ours.message_ids("user", "hi") + ours.generation_prompt_ids()
    assert ours.decode(ids) == "<|user|>\nhi<|end|>\n<|assistant|>\n"


def test_cluster_up_trains_a_model_dir_whose_tokenizer_was_built_here(tmp_path, repo_env):
    """The whole loop on a transformers Qwen3-MoE whose tokenizer and template are not the shipped ones: the
    sampler, the actors (exact IDs from the dir's template) and the learner all read them from the dir; every
    turn boundary is exact, and the checkpoints carry the same tokenizer."""
    model = transformers_qwen3_dir(tmp_path / "qwen3", tokenizer=own_tokenizer(tmp_path / "tok"))
    run = tmp_path / "run"
    args = ["--model", str(model), "--steps", "2", "--batch-turns", "4", "--synth-tasks", "6", "--max-turns", "3"]
    args += ["--actors", "1", "--concurrency", "2", "--max-new-tokens", "16", "--plain"]
    with cluster_up(run, args, env=repo_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-3000:]
    assert "learner finished" in out.splitlines()[-1], out[-2000:]
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    drift = [m["drift"] for m in metrics if m.get("component") == "learner" and "drift" in m][-1]
    assert drift["clean"] > 0 and drift["realign"] == 0 and drift["fork"] == 0, drift
    ckpt = latest_checkpoint(run / "checkpoints")
    assert ckpt is not None and ckpt.policy_version == 2
    saved = ChatTokenizer.load(ckpt.path)
    assert saved.template.source == PHI3 and saved.vocab_size == ChatTokenizer.load(model).vocab_size
    assert (ckpt.path / "tokenizer.json").read_bytes() == (model / "tokenizer.json").read_bytes()
