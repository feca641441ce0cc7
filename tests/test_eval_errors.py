"""Episodes that error (the sampler, the sandbox, the wall clock, the verifier, the task's setup) are counted
apart from the policy's failures: in the real bwrap sandbox with the real verifier, an episode whose sampler
fails is neither a pass nor a fail of the policy, and the eval says how many there were and why."""

from __future__ import annotations

import numpy as np
import pytest

from sandbox_agent.agent.runner import render_command, solution_chunks
from sandbox_agent.synth import generate
from sandbox_agent.tasks.task import load_tasks
from t1async.eval.run import EvalConfig, run_eval
from t1async.eval.stats import EPISODE_ERRORS, episode_error, split_errors, summarise, task_scores
from t1async.model.tokenizer import ChatTokenizer
from t1async.protocol.errors import SamplerError
from t1async.protocol.sampling import Generation, SamplingParams


class ThreeWays:
    """Task 0: the oracle (resolves); task 1: DONE at once (the policy fails); task 2: the sampler fails."""

    def __init__(self, tok: ChatTokenizer, tasks) -> None:
        self.tok, self.ids = tok, [t.id for t in tasks]
        self.chunks = {t.id: solution_chunks(t.solution.read_text()) for t in tasks}

    async def generate(self, input_ids, params: SamplingParams, *, routed_experts_start_len=None, rid=None):
        task, k = rid.removeprefix("eval-").rsplit("-s", 1)[0], int(rid.rsplit("/", 1)[1])
        if task == self.ids[2]:
            raise SamplerError("connection refused (stand-in for a dead sampler)")
        chunks = self.chunks[task] if task == self.ids[0] else []
        text = render_command(chunks[k]) if k < len(chunks) else "DONE"
        ids = list(self.tok.encode(text)) + [self.tok.end_of_turn_id]
        return Generation(np.asarray(ids, np.int32), np.full(len(ids), -0.1, np.float32), "stop", 0)

    async def aclose(self) -> None:
        return None


async def test_a_failed_sampler_is_an_error_not_a_failure_of_the_policy(tmp_path):
    generate(tmp_path / "tasks", 3, seed=5, families=["text"])
    ts = load_tasks(tmp_path / "tasks")
    tok = ChatTokenizer.load()
    cfg = EvalConfig(samples=2, concurrency=3, seed=0, max_turns=20, max_new_tokens=1024, max_context=32768)
    rows = await run_eval(ts, ThreeWays(tok, ts), tok, cfg)
    by = {r["task"]: r for r in rows}
    assert by[ts[0].id]["error"] is None and by[ts[0].id]["resolved"]
    assert by[ts[1].id]["error"] is None and not by[ts[1].id]["resolved"]  # a failure of the policy
    assert by[ts[2].id]["error"] == "sampler" and "connection refused" in by[ts[2].id]["detail"]
    counted, errors = split_errors(rows)
    assert errors == {**dict.fromkeys(EPISODE_ERRORS, 0), "sampler": 2}
    assert summarise(task_scores(counted))["pass@1"]["mean"] == pytest.approx(0.5)  # 1 of 2, not 1 of 3
    assert summarise(task_scores(rows))["pass@1"]["mean"] == pytest.approx(1 / 3)  # what counting it as a fail says


@pytest.mark.parametrize(
    ("row", "kind"),
    [
        ({"reason": "solved", "verify_status": "ok"}, None),
        ({"reason": "max_turns", "verify_status": "ok"}, None),
        ({"reason": "context"}, None),  # rows written before verify_status: an outcome
        ({"reason": "error", "detail": "sampler failed on turn 3: 502"}, "sampler"),
        ({"reason": "error", "detail": "sandbox failed on turn 0: bwrap died"}, "sandbox"),
        ({"reason": "error", "detail": "SandboxError: could not start"}, "sandbox"),
        ({"reason": "error", "detail": "TaskSetupError: setup.sh exited 1"}, "setup"),
        ({"reason": "timeout", "verify_status": "ok"}, "timeout"),
        ({"reason": "aborted"}, "aborted"),
        ({"reason": "solved", "verify_status": "timeout"}, "verifier"),
        ({"reason": "max_turns", "verify_status": "parse_error"}, "verifier"),
        ({"reason": "image_build_failed"}, None),  # stats.scored counts it apart
    ],
)
def test_episode_error_kinds(row, kind):
    assert episode_error(row) == kind
