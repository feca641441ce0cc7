"""Warm-start SFT: demonstrations are token-in sequences identical to the agent's, and training on real
oracle demonstrations (bubblewrap sandbox) lowers their loss."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sandbox_agent.agent.loop import run_agent
from sandbox_agent.agent.types import AgentConfig
from sandbox_agent.sandbox.memory import MemorySandbox
from sandbox_agent.tasks.verifier import VerifyResult
from t1async.learner.settings import SFTConfig
from t1async.model.config import MoEConfig
from t1async.model.moe import MoETransformer
from t1async.model.tokenizer import ChatTokenizer
from t1async.protocol.errors import ConfigError
from t1async.protocol.sampling import Generation, SamplingParams
from t1async.recipes.sft import Demo, collect_demos, demo_loss, demo_tokens, sft_train, synth_tasks
from t1async.testing.models import TINY

REPLIES = ["```bash\nls -la  data/\n```", "Let me look:\n```bash\ncat data/a.txt | sort -u\n```", "DONE"]


class ScriptedSampler:
    """The outer edge: replies with fixed texts (encoded + end of turn) and records every input."""

    def __init__(self, tok: ChatTokenizer, replies: list[str]) -> None:
        self.tok, self.replies, self.inputs = tok, list(replies), []

    async def generate(self, input_ids, params: SamplingParams, *, routed_experts_start_len=None, rid=None):
        self.inputs.append([int(t) for t in input_ids])
        out = np.asarray([*self.tok.encode(self.replies[len(self.inputs) - 1]), self.tok.end_of_turn_id], np.int32)
        return Generation(output_ids=out, logprobs=np.zeros(len(out), np.float32), finish="stop", policy_version=0)

    async def aclose(self) -> None:
        pass


async def test_demo_tokens_are_exactly_the_agents_token_in_sequence():
    tok = ChatTokenizer.load()
    sampler = ScriptedSampler(tok, REPLIES)
    turns = []

    async def on_turn(tr):
        turns.append(tr)

    async def verify():
        return VerifyResult(tests={"t": True}, passed=1, total=1, resolved=True, status="ok")

    outputs = {"ls -la  data/": "total 8\n-rw-r--r--  1 u u   12 a.txt\n", "cat data/a.txt | sort -u": "  x\n\ty\n"}
    sandbox = MemorySandbox(lambda cmd: outputs[cmd])
    await run_agent(
        instruction="Sort the words in data/a.txt.",
        sampler=sampler,
        tokenizer=tok,
        sandbox=sandbox,
        verify=verify,
        config=AgentConfig(max_turns=5, request_routing=False),
        on_turn=on_turn,
    )
    assert len(turns) == 3
    demo = Demo("t", "Sort the words in data/a.txt.", tuple((r, tr.observation) for r, tr in zip(REPLIES, turns)))
    ex = demo_tokens(demo, tok)
    final = list(turns[-1].input_ids) + list(turns[-1].output_ids)
    assert ex.tokens.tolist() == final
    want_mask = np.zeros(len(final), bool)
    for tr in turns:
        want_mask[len(tr.input_ids) : len(tr.input_ids) + len(tr.output_ids)] = True
    assert ex.loss_mask.tolist() == want_mask.tolist()
    # every turn's input is a prefix of the demonstration (token-in, no re-encoding)
    for inp in sampler.inputs:
        assert ex.tokens[: len(inp)].tolist() == inp


def test_empty_demo_and_bad_config_are_rejected():
    tok = ChatTokenizer.load()
    with pytest.raises(ConfigError, match="no turns"):
        demo_tokens(Demo("t", "x", ()), tok)
    with pytest.raises(ConfigError, match="steps"):
        SFTConfig(steps=0)


@pytest.mark.slow
async def test_sft_on_real_oracle_demonstrations_reduces_their_loss(tmp_path):
    tasks = synth_tasks(3, seed=7, root=tmp_path / "tasks")
    demos = await collect_demos(tasks, concurrency=2)
    assert len(demos) >= 2, "oracle solutions of synthetic tasks should resolve in the sandbox"
    assert all(d.turns[-1] == ("DONE", "") and len(d.turns) >= 2 for d in demos)
    assert all("[exit code:" in d.turns[0][1] for d in demos)  # real observations from the sandbox
    tok = ChatTokenizer.load()
    examples = [demo_tokens(d, tok) for d in demos]
    for dtype in ("float32", "bfloat16"):  # --train-dtype bfloat16: bf16 autocast, the weights stay fp32
        torch.manual_seed(0)
        model = MoETransformer(MoEConfig(**{**TINY, "vocab_size": tok.vocab_size, "max_seq_len": 4096}))
        before = demo_loss(model, examples, pad_id=tok.pad_id)
        cfg = SFTConfig(steps=12, lr=3e-3, warmup_steps=2, batch_tokens=4096, train_dtype=dtype)
        losses = sft_train(model, examples, cfg, pad_id=tok.pad_id)
        after = demo_loss(model, examples, pad_id=tok.pad_id)
        assert len(losses) == 12 and all(p.dtype == torch.float32 for p in model.parameters())
        assert after < before - 0.5, (dtype, before, after)


def test_sft_refuses_a_bad_device_or_dtype_in_one_line(tmp_path, capsys):
    from t1async.learner.__main__ import main

    with pytest.raises(ConfigError, match="train_dtype"):
        SFTConfig(train_dtype="float16")
    if not torch.cuda.is_available():
        argv = ["sft", "--synth", "2", "--steps", "1", "--out", str(tmp_path / "out"), "--device", "cuda"]
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "--device cuda" in err[0] and "no CUDA GPU" in err[0], err
