"""The `cluster up` dashboard: figures over nothing are '–', it names the bottleneck from where the actors'
time goes, it fits an 80-column terminal, and the progress task feeds it from a real nats-server."""

from __future__ import annotations

import io
import json

import anyio
from rich.console import Console

from t1async.cluster.observe.dashboard import DASH, RunView, lines, plain_line, render
from t1async.cluster.observe.progress import sampler_state, show_progress
from t1async.protocol.wire import MetricsRecord
from t1async.transport import NatsTransport


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def actor(i: int, *, wait: float, sample: float, exec_: float, slots: int = 4) -> dict:
    """Cumulative actor counters after ``i`` ticks, each tick adding the given seconds."""
    return {
        "episodes_running": slots,
        "episodes_done": i,
        "turns": 10 * i,
        "tokens": 1000 * i,
        "credit_wait_s": wait * i,
        "sample_s": sample * i,
        "exec_s": exec_ * i,
        "slots": slots,
    }


def learner(i: int, **extra) -> dict:
    return {
        "turns_trained": 16 * i,
        "t_busy_s": 9.0 * i,
        "t_forward_s": 2.0,
        "t_backward_s": 5.0,
        "t_checkpoint_s": 0.5,
        "t_push_s": 1.0,
        "t_step_wall_s": 8.6,
        "episodes_ended": 0,
        "max_staleness": 1,
        "eta": 1,
        "drift": {"clean": 10, "realign": 1, "fork": 0},
        **extra,
    }


def fed(ticks: int, **shares) -> RunView:
    clock = Clock()
    view = RunView("runs/x", "nats://127.0.0.1:4222", ["http://s:1"], clock=clock)
    for i in range(ticks):
        clock.t = 10.0 * i
        view.on_metrics("actor", "actor-0", 0, 0, actor(i, **shares))
        view.on_metrics("learner", "learner", i, i, learner(i))
        view.samplers["http://s:1"].record(clock.t, "ok", 2 if i % 2 else 0)
    return view


def text(view: RunView) -> str:
    return "\n".join(t for _, t in lines(view))


def test_figures_over_nothing_are_dashes_not_zeros():
    view = RunView("runs/x", "nats://h:1", [])
    out = text(view)
    assert "waiting for their first metrics" in out and "bottleneck: –" in out and "0.00" not in out
    view.on_metrics(
        "learner",
        "learner",
        0,
        0,
        {
            "episodes_ended": 0,
            "reward_mean": 0.0,
            "resolved_rate": 0.0,
            "turns_trained": 0,
            "max_staleness": 0,
            "eta": 1,
        },
    )
    out = text(view)
    assert f"staleness max {DASH} (η 1)" in out, "no maximum over no trained token"
    view.on_metrics(
        "learner", "learner", 4, 4, {"turns_trained": 81, "max_staleness": 0, "staleness_hist": {}, "eta": 1}
    )
    assert f"staleness max {DASH} (η 1)" in text(view), "a resumed learner has trained nothing yet this session"
    view.on_metrics("learner", "learner", 0, 0, {"episodes_ended": 0, "turns_trained": 0, "max_staleness": 0, "eta": 1})
    assert f"reward {DASH} resolved {DASH} (0 ended)" in out and "reward 0.00" not in out
    assert f"mismatch {DASH} shift {DASH}" in out and f"settled {DASH}" in out
    assert f"reward {DASH} resolved {DASH}" in plain_line(view)
    # figures over something are shown, the learner's split of its step time included
    view.on_metrics(
        "learner",
        "learner",
        3,
        3,
        learner(
            3,
            episodes_ended=4,
            reward_mean=1.5,
            resolved_rate=0.25,
            mismatch=0.0012,
            mismatch_tokens=40,
            policy_shift=0.031,
            policy_shift_tokens=60,
            settled={"trained": 7, "expired": 1},
        ),
    )
    out = text(view)
    assert "reward 1.50 resolved 25% (4 ended)" in out and "mismatch 0.0012 shift 0.0310" in out
    assert "step 8.6s: fwd 2.0s bwd 5.0s ckpt 0.5s push 1.0s" in out and "settled expired 1 trained 7" in out
    view.on_metrics("learner", "learner", 3, 3, learner(3, settled={"trained": 0, "poisoned": 0}))
    assert "settled 0" in text(view), "reasons with no turns are left out"
    view.on_metrics("learner", "learner", 3, 3, learner(3, training=True))
    assert "policy v3 step 3 training |" in text(view)
    view.on_metrics("learner", "learner", 3, 3, learner(3, training=False, untrained_turns=5))
    assert "policy v3 step 3 waiting (5 turns in hand) |" in text(view)
    view.on_metrics("learner", "learner", 3, 3, learner(3, training=True, learner_ranks=2))
    assert "policy v3 step 3 on 2 ranks training |" in text(view), "a distributed learner says so"
    view.on_metrics("learner", "learner", 4, 4, learner(4, mismatch=0.0, mismatch_tokens=0))
    assert f"mismatch {DASH}" in text(view), "a mismatch over no tokens is not a figure"


def test_the_learner_shows_its_clip_correction_and_critic():
    view = RunView("runs/x", "nats://h:1", [])
    view.on_metrics("learner", "learner", 0, 0, learner(0))
    assert f"ppo clip {DASH} (last epoch {DASH}) | IS trunc {DASH} masked {DASH} ESS {DASH}" in text(view)
    assert f"critic EV {DASH}" in text(view) and "grouped" not in text(view)
    step = dict(loss_tokens=900, clip_frac=0.03, clip_frac_last=0.061, is_trunc_frac=0.0, is_masked_frac=0.012)
    step |= dict(ess_corrected=0.9712, explained_variance=0.412, adv_grouped_share=0.85, adv_truncated_share=0.11)
    view.on_metrics("learner", "learner", 5, 5, learner(5, **step))
    out = text(view)
    assert "ppo clip 3.0% (last epoch 6.1%) | IS trunc 0.0% masked 1.2% ESS 0.971 | critic EV 0.41" in out
    assert "| grouped 85% cut short 11%" in out  # grpo/rloo: the returns that lack the episode's later turns


def test_it_names_the_bottleneck_from_where_actor_time_goes():
    assert fed(5, wait=30, sample=35, exec_=2).bottleneck().startswith("learner: actors wait 75%")
    sampler = fed(5, wait=1, sample=30, exec_=2).bottleneck()
    assert sampler.startswith("sampler: actors wait 72%") and "sampler busy" in sampler
    assert fed(5, wait=1, sample=3, exec_=30).bottleneck().startswith("sandbox: actors spend 75%")
    assert fed(1, wait=30, sample=35, exec_=2).bottleneck() == DASH, "one sample is no rate"
    short = RunView("r", "n", [], clock=lambda: 0.0)
    short.on_metrics("actor", "a", 0, 0, actor(0, wait=0, sample=0, exec_=0))
    short.clock = lambda: 2.0
    short.on_metrics("actor", "a", 0, 0, actor(1, wait=0.1, sample=0.1, exec_=0))
    assert short.bottleneck() == DASH, "two seconds of history name no bottleneck"
    view = fed(5, wait=30, sample=35, exec_=2)
    assert view.actor_series.rate("turns") == 1.0 and view.learner_busy() == 0.9
    assert "limit: learner (credits 75%)" in plain_line(view)
    # turn times land when a turn ends, credit waits when granted: a window can hold more than its slot time
    over = fed(5, wait=30, sample=60, exec_=20).actor_shares()
    assert over is not None and abs(sum(over.values()) - 1.0) < 1e-9 and over["sandbox"] == 0.25


def test_rates_need_history_and_decay_when_nothing_moves():
    clock = Clock()
    view = RunView("r", "n", [], clock=clock)
    for _ in range(4):  # a burst a few milliseconds apart
        clock.t += 0.001
        view.on_traj(1000)
    assert view.traj.rate("msgs") is None, "a burst over 3 ms is not 1000 records/s"
    clock.t = 10.0
    assert view.traj.rate("msgs") == 3 / (10.0 - 0.001)
    clock.t = 200.0  # nothing published for minutes
    assert view.traj.rate("msgs") == 0.0
    assert "0.00 turn records/s" in text(view)


def test_the_dashboard_fits_80_columns_and_the_plain_line_has_no_escapes():
    view = fed(5, wait=30, sample=35, exec_=2)
    console = Console(width=80, record=True, file=io.StringIO(), force_terminal=True)
    console.print(render(view))
    rendered = console.export_text()
    assert rendered.strip() and all(len(x) <= 80 for x in rendered.splitlines())
    for name in ("actors", "sampler", "learner", "nats", "eval"):
        assert any(x.startswith(name) for x in rendered.splitlines()), name
    line = plain_line(view)
    assert "\x1b" not in line and "\r" not in line and "\n" not in line


def test_a_full_disk_shows_on_the_learner_line():
    view = fed(3, wait=30, sample=35, exec_=2)
    view.on_metrics("learner", "learner", 3, 3, learner(3, journal_blocked_s=42.0))
    assert "DISK FULL 42s: not acking" in text(view)
    view.on_metrics("learner", "learner", 4, 4, learner(4, journal_blocked_s=0.0))
    assert "DISK FULL" not in text(view)


def test_sampler_state_reads_sglang_and_embedded_answers():
    import httpx

    def resp(status: int, body: object) -> httpx.Response:
        return httpx.Response(status, json=body)

    assert sampler_state(resp(200, {"internal_states": [{"running_requests": 3}]})) == ("ok", 3)
    assert sampler_state(resp(200, {"internal_states": [{"#running-req": 0}]})) == ("ok", 0)
    assert sampler_state(resp(200, {"version": "x"})) == ("ok", None)
    assert sampler_state(resp(503, {})) == ("HTTP 503", None)
    assert sampler_state(None, "ConnectError") == ("unreachable (ConnectError)", None)


async def test_show_progress_writes_metrics_and_plain_lines_from_a_real_nats(nats_server, tmp_path):
    out = io.StringIO()
    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: show_progress(nats_server.url, tmp_path, out=out, every_s=0.3))
        async with NatsTransport(nats_server.url) as t:
            with anyio.fail_after(30):
                while "v2" not in out.getvalue():
                    await t.publish("t1.metrics.learner", MetricsRecord("learner", 2, 2, learner(2)))
                    await t.publish(
                        "t1.metrics.actor.a0", MetricsRecord("actor", 0, 0, actor(2, wait=1, sample=2, exec_=3))
                    )
                    await anyio.sleep(0.2)
        tg.cancel_scope.cancel()
    plain = out.getvalue().splitlines()
    assert plain and all("\x1b" not in x for x in plain)
    assert any("step 8.6s (fwd 2.0 bwd 5.0 ckpt 0.5 push 1.0)" in x for x in plain)
    recs = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert {r["component"] for r in recs} == {"learner", "actor"}
    assert any(r["subject"] == "t1.metrics.actor.a0" and r["slots"] == 4 for r in recs)


async def test_the_nats_line_shows_the_servers_health(nats_server):
    from t1async.cluster.observe.progress import _poll_nats_health
    from t1async.transport.natsd import free_port

    view = RunView("r", nats_server.url, [])
    for url, want in (
        (nats_server.monitor_url, "healthy"),
        (f"http://127.0.0.1:{free_port()}", "monitor unreachable (ConnectError)"),
    ):
        async with anyio.create_task_group() as tg:
            tg.start_soon(_poll_nats_health, view, url, 0.1)  # runs until cancelled
            with anyio.fail_after(20):
                while view.nats_state != want:
                    await anyio.sleep(0.05)
            tg.cancel_scope.cancel()
    assert f"{nats_server.url} monitor unreachable (ConnectError)" in text(view)


def test_keys_are_not_echoed_while_the_dashboard_is_drawn_and_echo_comes_back():
    import os
    import pty
    import termios

    from t1async.cluster.observe.progress import _no_echo

    master, slave = pty.openpty()
    try:
        with os.fdopen(slave, "w", closefd=False) as tty:
            before = termios.tcgetattr(slave)[3]
            assert before & termios.ECHO
            with _no_echo(tty):
                assert not termios.tcgetattr(slave)[3] & (termios.ECHO | termios.ECHOCTL)
            assert termios.tcgetattr(slave)[3] == before
        with _no_echo(io.StringIO()):  # not a terminal: nothing to do
            pass
    finally:
        os.close(master)
        os.close(slave)


def test_the_plain_line_shows_the_latest_in_loop_eval():
    view = fed(5, wait=30, sample=35, exec_=2)
    assert "pass@1" not in plain_line(view)  # no evaluator: nothing made up
    view.on_metrics("eval", "eval", 3, 4, {"pass1": 0.25, "tests_mean": 1.5, "tasks": 18})
    view.on_metrics("eval", "eval", 6, 8, {"pass1": 0.5, "tests_mean": 2.25, "tasks": 18})
    assert plain_line(view).endswith("eval v8 pass@1 50% tests 2.25")
