"""The in-loop evaluator (t1async.eval.loop, ``cluster up --eval-every N``): it follows t1.policy, scores the
starting policy and every N-th version on the eval split with its own real embedded sampler and sandbox, and
publishes t1.metrics.eval; the curves read back from its TensorBoard files."""

from __future__ import annotations

import anyio
import pytest

from sandbox_agent.synth import generate
from sandbox_agent.tasks.task import load_tasks
from t1async.curves import read_scalars
from t1async.eval.loop import LoopSettings, run_loop
from t1async.model.weights import default_model_dir
from t1async.protocol import wire
from t1async.transport import MemoryBroker, MemoryTransport

pytestmark = pytest.mark.slow


async def test_scores_the_start_and_every_nth_version(tmp_path):
    tasks = tmp_path / "tasks"
    generate(tasks, 30, seed=0, families=["touch4"])
    held = [t for t in load_tasks(tasks) if t.split == "eval"]
    assert held, "the corpus needs a held-out task"
    model = default_model_dir()
    # a checkpoint as the learner writes it: model files plus trainer state the evaluator must not copy
    ckpt = tmp_path / "ckpt-v2"
    ckpt.mkdir()
    for f in model.iterdir():
        if f.is_file():
            (ckpt / f.name).write_bytes(f.read_bytes())
    (ckpt / "trainer_state.json").write_text("{}")
    cfg = LoopSettings(
        run_dir=tmp_path / "run", tasks=tasks, every=2, model=model, max_turns=1, max_new_tokens=16, max_context=2048
    )
    broker = MemoryBroker()
    got: list[wire.MetricsRecord] = []
    async with MemoryTransport(broker) as et, MemoryTransport(broker) as lt, anyio.create_task_group() as tg:
        async with lt.subscribe("t1.metrics.eval") as sub:
            tg.start_soon(run_loop, cfg, et)
            with anyio.fail_after(240):
                async for m in sub:
                    got.append(m.record)
                    if len(got) == 1:  # the start (version 0) is scored: the learner moves on
                        await lt.publish("t1.policy", wire.PolicyRecord(1, 1, str(ckpt)))  # not due
                        await lt.publish("t1.policy", wire.PolicyRecord(2, 2, str(ckpt)))
                    else:
                        break
        tg.cancel_scope.cancel()
    assert [(r.component, r.policy_version) for r in got] == [("eval", 0), ("eval", 2)]
    for r in got:
        assert r.values["tasks"] == len(held) and r.values["episodes"] == len(held)
        assert 0.0 <= r.values["pass1"] <= 1.0 and 0.0 <= r.values["tests_mean"] <= 4.0
        assert r.values["pass1_lo"] <= r.values["pass1"] <= r.values["pass1_hi"]
    snap = tmp_path / "run" / "eval" / "v2" / "model"
    assert (snap / "config.json").is_file() and not (snap / "trainer_state.json").exists()
    assert len((tmp_path / "run" / "eval" / "v2.jsonl").read_text().splitlines()) == len(held)
    curves = read_scalars(tmp_path / "run" / "tensorboard" / "eval")
    assert [s for s, _ in curves["eval/pass1"]] == [0, 2] and [s for s, _ in curves["eval/tests_mean"]] == [0, 2]
