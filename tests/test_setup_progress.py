"""The progress of ``cluster up``'s one-shot jobs (the warm start): each phase's bar follows its log event, and
a run without a terminal gets plain lines instead."""

from __future__ import annotations

import io
import json

import anyio

from t1async.cluster.observe.progress import phase_bars, watch_log_steps

PHASES = (("demonstrations", "sft.demo", None), ("SFT steps", "sft.step", 20))


def test_plain_lines_per_phase_at_each_tenth_with_the_total_from_the_log():
    out = io.StringIO()
    with phase_bars("warm-start", PHASES, out=out) as bar:
        for i in range(1, 41):
            bar("sft.demo", i, 40)
        bar("other.event", 3, None)  # not a phase: nothing
        for i in range(1, 21):
            bar("sft.step", i, None)
    lines = out.getvalue().splitlines()
    assert lines[0] == "warm-start: demonstrations 1/40"
    assert lines[10] == "warm-start: demonstrations 40/40"
    assert [ln for ln in lines if "SFT" in ln][-1] == "warm-start: SFT steps 20/20"
    assert len(lines) == 22 and not [ln for ln in lines if "other" in ln]


async def test_watch_log_steps_follows_both_events_as_the_log_grows(tmp_path):
    log = tmp_path / "warm-start.log"
    seen: list[tuple[str, int, int | None]] = []
    got_all = anyio.Event()

    def bar(event: str, completed: int, total: int | None) -> None:
        seen.append((event, completed, total))
        if event == "sft.step" and completed == 2:
            got_all.set()

    records = [
        {"event": "sft.demo", "step": 0, "total": 3},
        {"event": "warmstart.demos", "tasks": 3},  # no step: skipped
        {"event": "sft.step", "step": 1, "loss": 1.0},
    ]
    async with anyio.create_task_group() as tg:
        tg.start_soon(watch_log_steps, log, bar, 0.01)
        with log.open("a") as f:  # a line written in two parts is read once whole
            f.write(json.dumps(records[0])[:10])
            f.flush()
            f.write(json.dumps(records[0])[10:] + "\nnot json\n")
            f.write("".join(json.dumps(r) + "\n" for r in records[1:]))
        with anyio.fail_after(10):
            await got_all.wait()
        tg.cancel_scope.cancel()
    assert seen == [("sft.demo", 1, 3), ("sft.step", 2, None)]
