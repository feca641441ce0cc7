"""A scripted agent episode for tests of the turn loop: a byte-level ChatML tokenizer (``ByteTok``), a sampler
that replies with scripted texts (``ScriptedSampler``), a verifier that counts ``touch``ed files
(``counting_verifier``), and ``episode``, which runs the real ``run_agent`` on them in a MemorySandbox."""

from __future__ import annotations

import numpy as np
import trio

from sandbox_agent.agent.loop import run_agent
from sandbox_agent.agent.types import AgentConfig, TurnResult
from sandbox_agent.sandbox import MemorySandbox
from sandbox_agent.tasks.verifier import VerifyResult
from t1async.protocol.errors import SamplerError
from t1async.protocol.sampling import Generation, SamplingParams

IM_START, IM_END = 256, 257


class ByteTok:
    """A byte-level ChatML tokenizer with the ChatTokenizer methods the agent uses."""

    end_of_turn_id = IM_END
    eos_ids = (IM_END,)

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        out = bytearray()
        for i in ids:
            if i < 256:
                out.append(i)
            elif not skip_special_tokens:
                out += {IM_START: b"<|im_start|>", IM_END: b"<|im_end|>"}[i]
        return out.decode(errors="replace")

    def message_ids(self, role: str, content: str) -> list[int]:
        return [IM_START, *self.encode(role + "\n"), *self.encode(content), IM_END, *self.encode("\n")]

    def generation_prompt_ids(self) -> list[int]:
        return [IM_START, *self.encode("assistant\n")]

    def render(self, messages, add_generation_prompt: bool = True) -> list[int]:
        ids = [t for m in messages for t in self.message_ids(m["role"], m["content"])]
        return ids + (self.generation_prompt_ids() if add_generation_prompt else [])

    def bridge_ids(self, output_ids) -> list[int]:
        ends = len(output_ids) > 0 and int(output_ids[-1]) == IM_END
        return ([] if ends else [IM_END]) + self.encode("\n")


class ScriptedSampler:
    """Replies with scripted texts (each + <|im_end|>, unless a reply is given as (text, "length"))."""

    def __init__(self, tok, replies, *, layers: int = 2, topk: int = 2, delay: float = 0.0, fail_at: int | None = None):
        self.tok, self.replies, self.layers, self.topk = tok, list(replies), layers, topk
        self.delay, self.fail_at = delay, fail_at
        self.calls: list[dict] = []

    async def generate(
        self, input_ids, params: SamplingParams, *, routed_experts_start_len=None, rid=None
    ) -> Generation:
        k = len(self.calls)
        self.calls.append(
            {"input_ids": list(input_ids), "params": params, "start": routed_experts_start_len, "rid": rid}
        )
        if self.delay:
            await trio.sleep(self.delay)
        if self.fail_at == k:
            raise SamplerError("sampler unreachable (scripted)")
        reply = self.replies[k % len(self.replies)]
        finish = "stop"
        if isinstance(reply, tuple):
            reply, finish = reply
        out = self.tok.encode(reply) + ([self.tok.end_of_turn_id] if finish == "stop" else [])
        out = out[: params.max_new_tokens]
        start = routed_experts_start_len or 0
        rows = len(input_ids) + len(out) - 1 - start
        routing = np.full((rows, self.layers, self.topk), k, dtype=np.uint8)
        return Generation(
            output_ids=np.asarray(out, dtype=np.int32),
            logprobs=np.full(len(out), -0.5, np.float32),
            finish=finish,
            policy_version=7,
            routing=routing,
            routing_start=start,
        )

    async def aclose(self) -> None:
        pass


def counting_verifier(sandbox: MemorySandbox, total: int = 3):
    """Tests passed = files t0..t{total-1} present after replaying `touch tN` / `rm tN` commands."""
    calls = []

    async def verify() -> VerifyResult:
        present: set[str] = set()
        for c in sandbox.commands:
            verb, _, arg = c.partition(" ")
            if verb == "touch":
                present.add(arg)
            elif verb == "rm":
                present.discard(arg)
        tests = {f"t{i}": f"t{i}" in present for i in range(total)}
        calls.append(sum(tests.values()))
        return VerifyResult.from_tests(tests)

    verify.calls = calls  # type: ignore[attr-defined]
    return verify


def bash(cmd: str) -> str:
    return f"I will run it.\n```bash\n{cmd}\n```"


async def episode(replies, *, tok=None, config=AgentConfig(), handler=None, sampler=None, wall=900.0, total=3):
    tok = tok or ByteTok()
    sb = MemorySandbox(handler or (lambda c: f"ran {c}"))
    sampler = sampler or ScriptedSampler(tok, replies)
    turns: list[TurnResult] = []

    async def on_turn(t: TurnResult) -> None:
        turns.append(t)

    verify = counting_verifier(sb, total)
    res = await run_agent(
        instruction="Make t0 t1 t2.",
        sampler=sampler,
        tokenizer=tok,
        sandbox=sb,
        verify=verify,
        config=config,
        wall_time_s=wall,
        on_turn=on_turn,
        rid="ep1",
    )
    return res, turns, sampler, sb, verify
