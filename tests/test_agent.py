"""The agent turn loop: exact-ID inputs, routing start, actions, stop conditions, rewards.

Fast tests run the real loop with an in-memory scripted sampler and MemorySandbox; the last ones run a
scripted episode end to end in the real bubblewrap sandbox with the real verifier.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sandbox_agent.agent.context import ContextConfig
from sandbox_agent.agent.loop import initial_messages
from sandbox_agent.agent.runner import run_episode
from sandbox_agent.agent.types import AgentConfig, TurnResult
from sandbox_agent.sandbox import ExecResult
from sandbox_agent.tasks.task import load_task
from t1async.model.tokenizer import ChatTokenizer
from t1async.protocol.sampling import Generation
from t1async.protocol.wire import EndReason
from tests.scripted_episode import ByteTok, ScriptedSampler, bash, episode

FIXTURES = Path(__file__).resolve().parents[1] / "sandbox_agent" / "fixtures"


@pytest.mark.parametrize("tok", [ByteTok(), ChatTokenizer.load()], ids=["bytes", "chat"])
async def test_inputs_are_exact_ids_and_clean(tok):
    replies = [bash("touch t0"), ("rambling without end", "length"), bash("touch t1"), "DONE"]
    res, turns, sampler, sb, _ = await episode(replies, tok=tok)
    assert res.reason == "solved" and len(turns) == 4
    first = sampler.calls[0]["input_ids"]
    assert first == tok.render(initial_messages("Make t0 t1 t2.", AgentConfig().system_prompt))
    for k in range(1, 4):
        prev_in, prev_out = turns[k - 1].input_ids.tolist(), turns[k - 1].output_ids.tolist()
        want = (
            prev_in
            + prev_out
            + tok.bridge_ids(prev_out)
            + tok.message_ids("user", turns[k - 1].observation)
            + tok.generation_prompt_ids()
        )
        assert sampler.calls[k]["input_ids"] == want == turns[k].input_ids.tolist()
        assert want[: len(prev_in) + len(prev_out)] == prev_in + prev_out  # CLEAN boundary
    # the length-finished output got its end-of-turn from the bridge, not merged into the output
    assert turns[1].finish == "length" and turns[1].output_ids[-1] != tok.end_of_turn_id
    assert turns[2].input_ids[len(turns[1].input_ids) + len(turns[1].output_ids)] == tok.end_of_turn_id
    assert sb.commands == ["touch t0", "touch t1"]
    assert all(c["params"].stop_token_ids == tuple(sorted({tok.end_of_turn_id, *tok.eos_ids})) for c in sampler.calls)


async def test_routing_start_tiles_the_sequence():
    res, turns, sampler, _, _ = await episode([bash("touch t0"), bash("touch t1"), bash("touch t2"), "DONE"])
    starts = [c["start"] for c in sampler.calls]
    assert starts[0] == 0
    for k in range(1, len(turns)):
        assert starts[k] == len(turns[k - 1].input_ids) + len(turns[k - 1].output_ids) - 1
    covered = 0
    for t in turns:  # traces tile [0, final_len - 1) with no gap and no overlap
        assert t.routing_start == covered
        covered += t.routing.shape[0]
        assert covered == len(t.input_ids) + len(t.output_ids) - 1
    assert all(t.policy_version == 7 for t in turns)


async def test_no_routing_requested_when_disabled():
    _, _, sampler, _, _ = await episode([bash("touch t0"), "DONE"], config=AgentConfig(request_routing=False))
    assert [c["start"] for c in sampler.calls] == [None, None]


@pytest.mark.parametrize(
    "reply, needle",
    [
        ("I think I should look around first.", "No command found"),
        ("```bash\nls -la\n", "not closed"),
        ('{"tool": "rm_rf", "command": "x"}', "Unknown tool"),
        ("```python\nprint(1)\n```", "only ```bash blocks are run"),
        ("```bash\n\n```", "empty"),
        ('{"tool": "bash"}', 'no "command"'),
    ],
)
async def test_malformed_actions_get_helpful_observations(reply, needle):
    res, turns, _, sb, _ = await episode([reply, bash("touch t0"), "DONE"])
    assert turns[0].action_kind == "invalid" and needle in turns[0].observation
    assert turns[0].exit_code is None and sb.commands == ["touch t0"]
    assert res.reason == "solved" and res.turns == 3


async def test_json_tool_calls_and_command_plus_done():
    replies = ['{"tool": "bash", "command": "touch t0"}', bash("touch t1") + "\nDONE"]
    res, turns, _, sb, _ = await episode(replies)
    assert sb.commands == ["touch t0", "touch t1"]
    assert res.reason == "solved" and len(turns) == 2 and turns[-1].last
    assert res.tests_passed == 2 and turns[-1].reward == 2


async def test_observation_has_exit_code_and_is_truncated():
    def handler(cmd):
        return ExecResult(output="x" * 50_000, exit_code=3, timed_out=False, truncated=False, duration_s=0.1)

    cfg = AgentConfig(max_observation_chars=1000)
    _, turns, _, _, _ = await episode([bash("cat big"), "DONE"], handler=handler, config=cfg)
    obs = turns[0].observation
    assert obs.startswith("[exit code: 3]") and "[output truncated]" in obs and len(obs) < 1200
    assert turns[0].exit_code == 3 and turns[0].truncated


async def test_max_turns_stop_verifies_last_turn():
    cfg = AgentConfig(max_turns=3)
    res, turns, _, _, verify = await episode([bash("touch t0"), bash("echo hi")], config=cfg)
    assert res.reason is EndReason.MAX_TURNS and res.turns == 3 and len(turns) == 3
    assert f"{res.reason}" == "max_turns"  # one type from the agent to the wire, printed as its value
    assert [t.tests_passed for t in turns] == [None, None, 1] and turns[-1].last
    assert res.tests_passed == 1 and res.unstreamed_reward == 0 and verify.calls == [1]


async def test_context_budget_stops():
    cfg = AgentConfig(max_context_tokens=1400, min_new_tokens=16, context=ContextConfig(policy="stop"))
    res, turns, sampler, _, _ = await episode([bash("touch t0 " + "y" * 200)], config=cfg)
    assert res.reason == "context" and turns[-1].last
    assert all(len(c["input_ids"]) + c["params"].max_new_tokens <= 1400 for c in sampler.calls)
    assert sum(t.reward for t in turns) + res.unstreamed_reward == res.tests_passed


async def test_wall_time_stops_mid_sample(autojump_clock):
    tok = ByteTok()
    sampler = ScriptedSampler(tok, [bash("touch t0")], delay=40.0)
    res, turns, _, _, _ = await episode(None, sampler=sampler, wall=100.0)
    assert res.reason == "timeout"
    assert len(turns) == 2  # turn 2's sample was cut by the deadline; its output never streamed
    assert res.tests_passed == 1 and res.unstreamed_reward == 1  # final verification, owned by no turn
    assert sum(t.reward for t in turns) + res.unstreamed_reward == res.tests_passed


async def test_sampler_error_ends_episode_with_error():
    tok = ByteTok()
    sampler = ScriptedSampler(tok, [bash("touch t0")], fail_at=1)
    res, turns, _, _, _ = await episode(None, sampler=sampler)
    assert res.reason == "error" and "unreachable" in res.detail and len(turns) == 1
    assert res.tests_passed == 1


async def test_abort_finish_ends_episode():
    tok = ByteTok()

    class Aborting(ScriptedSampler):
        async def generate(self, input_ids, params, *, routed_experts_start_len=None, rid=None):
            g = await super().generate(input_ids, params, routed_experts_start_len=routed_experts_start_len, rid=rid)
            if len(self.calls) == 2:
                return Generation(g.output_ids[:3], g.logprobs[:3], "abort", g.policy_version)
            return g

    res, turns, _, sb, _ = await episode(None, sampler=Aborting(tok, [bash("touch t0")]))
    assert res.reason == "aborted" and turns[-1].action_kind == "none" and sb.commands == ["touch t0"]


async def test_periodic_rewards_sum_to_final_count():
    replies = [bash("touch t0"), bash("touch t1"), bash("rm t1"), bash("touch t2"), bash("touch t1"), "DONE"]
    cfg = AgentConfig(verify_every=2, stop_when_resolved=False)
    res, turns, _, _, verify = await episode(replies, config=cfg)
    assert [t.tests_passed for t in turns] == [None, 2, None, 2, None, 3]
    assert [t.reward for t in turns] == [0, 2, 0, 0, 0, 1]
    assert sum(t.reward for t in turns) + res.unstreamed_reward == res.tests_passed == 3
    cfg1 = AgentConfig(verify_every=1, stop_when_resolved=False)
    res1, turns1, _, _, _ = await episode(replies, config=cfg1)
    assert [t.reward for t in turns1] == [1, 1, -1, 1, 1, 0]  # the change in passing tests, turn by turn
    assert sum(t.reward for t in turns1) == res1.tests_passed == 3 and res1.resolved


async def test_periodic_verification_that_resolves_stops_the_episode():
    replies = [bash("touch t0"), bash("touch t1"), bash("touch t2"), bash("echo more")]
    res, turns, _, _, _ = await episode(replies, config=AgentConfig(verify_every=1))
    assert res.reason == "solved" and res.resolved and len(turns) == 3 and turns[-1].last


async def test_bwrap_episode_end_to_end(tmp_path):
    """A scripted policy in the real sandbox: verify_every=1 hands the work dir back after each check."""
    task = load_task(FIXTURES / "tb1" / "hello-world")
    tok = ByteTok()
    replies = [
        bash("mkdir private && echo secret > private/key && chmod 600 private/key && chmod 700 private"),
        bash("cat private/key && echo 'Hello, world!' > hello.txt"),
        "DONE",
    ]
    turns: list[TurnResult] = []

    async def on_turn(t):
        turns.append(t)

    res = await run_episode(
        task,
        sampler=ScriptedSampler(tok, replies),
        tokenizer=tok,
        config=AgentConfig(verify_every=1, stop_when_resolved=False),
        on_turn=on_turn,
    )
    assert turns[1].exit_code == 0 and "secret" in turns[1].observation
    assert [t.tests_passed for t in turns] == [0, 3, 3]
    assert res.reason == "solved" and res.resolved and res.tests_passed == 3 == res.tests_total


# ------------------------------------------------------------------------------- action parsing


def test_parse_action_variants():
    from sandbox_agent.agent.actions import parse_action

    a = parse_action("<think>maybe ```bash\nrm -rf /\n```</think>Let me list.\n```sh\nls\n```<|im_end|>")
    assert (a.kind, a.command, a.done) == ("bash", "ls", False)
    two = parse_action("```bash\necho 1\n```\nand\n```bash\necho 2\n```")
    assert two.command == "echo 1" and "only the first" in two.note
    hermes = parse_action('<tool_call>{"name": "bash", "arguments": {"command": "pwd"}}</tool_call>')
    assert (hermes.kind, hermes.command) == ("bash", "pwd")
    assert parse_action("All set.\n<done/>").kind == "done"
    assert parse_action('{"tool": "done"}').kind == "done"
    assert parse_action("I am DONE with it").kind == "invalid"  # DONE must be its own line
    assert parse_action("<think>still thinking ```bash\nls\n```").kind == "invalid"  # unclosed think
    multi = parse_action("```bash\ncat > f <<'EOF'\na\nb\nEOF\n```")
    assert multi.command == "cat > f <<'EOF'\na\nb\nEOF"


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.sampled_from(list('`{}":,\n <>/|_bashdonetoolcmDONE')) | st.characters(), max_size=200))
def test_parse_action_never_raises(text):
    from sandbox_agent.agent.actions import parse_action

    a = parse_action(text)
    assert a.kind in ("bash", "done", "invalid")
    assert (a.kind == "invalid") == bool(a.error)
    assert a.kind != "bash" or a.command.strip()


# ------------------------------------------------------------------------- oracle as agent turns


def test_solution_chunks_are_complete_shell_pieces():
    from sandbox_agent.agent.runner import solution_chunks

    script = "#!/bin/bash\nset -e\n\nmkdir d\n\nfor f in a b; do\n  touch d/$f\n\ndone\n\n# comment only\n\necho end\n"
    chunks = solution_chunks(script)
    assert chunks == ["mkdir d", "for f in a b; do\n  touch d/$f\n\ndone", "# comment only\n\necho end"]


async def test_oracle_turns_render_solution_with_real_observations():
    from sandbox_agent.agent.actions import parse_action
    from sandbox_agent.agent.runner import oracle_turns

    task = load_task(FIXTURES / "tb2" / "word-count")
    turns, result = await oracle_turns(task)
    assert result.resolved and turns[-1] == ("DONE", "")
    assert all(parse_action(text).kind == "bash" for text, _ in turns[:-1])
    assert all(obs.startswith("[exit code: 0]") for _, obs in turns[:-1])


@pytest.mark.parametrize("tok", [ByteTok(), ChatTokenizer.load()], ids=["bytes", "chat"])
async def test_sft_rendering_matches_the_loop_exactly(tok):
    from sandbox_agent.agent.loop import render_turns_ids

    replies = [bash("touch t0"), bash("echo hi"), "DONE"]
    res, turns, _, _, _ = await episode(replies, tok=tok)
    scripted = [(r, t.observation) for r, t in zip(replies, turns)]
    ids, mask = render_turns_ids(tok, "Make t0 t1 t2.", scripted)
    final = turns[-1].input_ids.tolist() + turns[-1].output_ids.tolist()
    assert ids.tolist() == final
    want_mask = np.zeros(len(final), bool)
    for t in turns:
        want_mask[len(t.input_ids) : len(t.input_ids) + len(t.output_ids)] = True
    assert (mask == want_mask).all()
