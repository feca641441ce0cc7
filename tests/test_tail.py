"""`cluster tail` as a pipe reads it: only records on stdout, control characters escaped, no colour codes,
--fields and --max-text; and the small CLI fixes (`status | head`, the "start it" hint)."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys

import anyio
import pytest

from t1async.cluster import cli
from t1async.cluster.observe.tail import Formatter, escape, select
from t1async.cluster.state import ClusterState
from t1async.testing.harness import end, start, turn
from t1async.transport import Message, NatsTransport, traj_subject
from tests.cluster_watch import read_until

NASTY = "ls\x00\x1b[31mred\x1c\r\nnext\x7f\x9b"


def msg(rec) -> Message:
    return Message(subject=traj_subject(rec.episode), data=b"", record=rec)


def test_escape_leaves_one_printable_line():
    out = escape(NASTY)
    assert out == "ls\\x00\\x1b[31mred\\x1c\\r\\nnext\\x7f\\x9b"
    assert out.isprintable()
    assert escape("plain – ünïcode") == "plain – ünïcode"


def test_turn_lines_escape_clip_and_pick_fields():
    rec = dataclasses.replace(turn("ep-\x1bx", 0), action=NASTY * 20, observation="o\x00")
    lines = Formatter(text=False).line(msg(rec)).split("\n")
    assert all(x.isprintable() for x in lines), lines
    assert "ep=ep-\\x1bx" in lines[0] and "tests=–" in lines[0] and "prev=–" in lines[0]
    action = next(x for x in lines if "action:" in x)
    assert len(action.split("action: ", 1)[1]) == 160 and action.endswith("...")
    assert Formatter(text=False, max_text=0).line(msg(rec)).count("\\x1b[31m") == 20, "0: no limit"
    picked = Formatter(text=False, fields=("ep", "reward", "action"), max_text=10).line(msg(rec)).split("\n")
    assert picked[0] == "turn  ep=ep-\\x1bx reward=+0" and picked[1] == "      action: ls\\x00\\..."
    assert len(picked) == 2, "obs was not asked for"
    verified = dataclasses.replace(turn("e", 0), tests_passed=2)
    assert "tests=2" in Formatter(text=False).line(msg(verified))
    e = dataclasses.replace(end("e", 1), detail="boom\x00\n")
    assert Formatter().line(msg(e)).endswith("detail=boom\\x00\\n")
    assert select({"subject": "s", "kind": "turn", "reward": 1, "action": "x"}, ("reward",)) == {
        "subject": "s",
        "kind": "turn",
        "reward": 1,
    }


async def test_tail_through_a_pipe_prints_only_escaped_records(nats_server, repo_env):
    env = {**repo_env, "T1_LOG_LEVEL": "info", "FORCE_COLOR": ""}
    env.pop("FORCE_COLOR")
    argv = [
        sys.executable,
        "-m",
        "t1async.cluster",
        "tail",
        "--nats",
        nats_server.url,
        "--no-text",
        "--fields",
        "ep,t,reward,action",
        "--max-text",
        "40",
    ]
    async with await anyio.open_process(argv, env=env) as proc:
        try:
            out, err = bytearray(), bytearray()
            await read_until(proc.stderr, err, b"# tailing t1.traj.>", timeout=90)
            async with NatsTransport(nats_server.url) as t:
                await t.publish(traj_subject("ep-p"), start("ep-p"))
                await t.publish(traj_subject("ep-p"), dataclasses.replace(turn("ep-p", 0), action=NASTY))
                await t.publish(traj_subject("ep-p"), end("ep-p", 1))
            await read_until(proc.stdout, out, b"resolved=True", timeout=60)
            proc.send_signal(signal.SIGINT)
            with anyio.fail_after(10):
                await proc.wait()
        finally:
            if proc.returncode is None:
                proc.kill()
    text = out.decode()
    lines = text.splitlines()
    assert [x.split()[0] for x in lines] == ["start", "turn", "action:", "end"], lines
    assert lines[1] == "turn  ep=ep-p t=0 reward=+0"
    assert lines[2] == "      action: " + escape(NASTY)
    assert all(x.isprintable() for x in lines) and "\x1b" not in text, "no control characters, no colour codes"
    assert "transport.connected" not in text and "transport.connected" not in err.decode(), "no log lines"


def test_tail_rejects_unknown_fields_and_negative_max_text(capsys):
    """Checked before connecting: no server needed."""
    assert cli.main(["tail", "--nats", "nats://127.0.0.1:1", "--fields", "ep,bogus"]) == 2
    err = capsys.readouterr().err
    assert "--fields: unknown field(s) bogus; known: ep,t,v" in err and err.count("\n") == 1
    assert cli.main(["tail", "--nats", "nats://127.0.0.1:1", "--max-text", "-1"]) == 2
    assert "--max-text must be >= 0" in capsys.readouterr().err


def test_tail_hint_keeps_the_run_dir(tmp_path, capsys):
    run_dir = tmp_path / "my run"
    ClusterState(run_dir=str(run_dir), status="stopped").save()
    assert cli.main(["tail", "--run-dir", str(run_dir)]) == 2
    assert f"`python -m t1async.cluster up --run-dir {run_dir}`" in capsys.readouterr().err


@pytest.mark.parametrize("command", [["status"], ["status", "--json"]])
def test_status_into_a_closed_pipe_is_quiet(tmp_path, repo_env, command):
    """`status | head`: the reader is gone before status writes; no BrokenPipeError traceback."""
    run_dir = tmp_path / "run"
    ClusterState(run_dir=str(run_dir), status="stopped").save()
    r, w = os.pipe()
    os.close(r)
    try:
        res = subprocess.run(
            [sys.executable, "-m", "t1async.cluster", *command, "--run-dir", str(run_dir)],
            stdout=w,
            stderr=subprocess.PIPE,
            env=repo_env,
            text=True,
            timeout=60,
        )
    finally:
        os.close(w)
    assert res.stderr == "" and res.returncode == 141, res.stderr


@pytest.mark.parametrize("as_json", [False, True], ids=["lines", "json"])
async def test_tail_into_a_reader_that_leaves_exits_quietly(nats_server, repo_env, as_json):
    """`tail | head -30`: the reader closes its end after the first records; tail's next write meets a broken
    pipe and tail exits with 141 (128 + SIGPIPE, as `status | head` does) and nothing on stderr but its
    header: no traceback, no exception group (rich's own broken-pipe exit used to raise SystemExit(1) inside
    the task group)."""
    argv = [sys.executable, "-m", "t1async.cluster", "tail", "--nats", nats_server.url, "--no-text"]
    async with await anyio.open_process([*argv, *(["--json"] if as_json else [])], env=repo_env) as proc:
        try:
            out, err = bytearray(), bytearray()
            await read_until(proc.stderr, err, b"# tailing t1.traj.>", timeout=90)
            async with NatsTransport(nats_server.url) as t:
                await t.publish(traj_subject("ep-h"), start("ep-h"))
                await read_until(proc.stdout, out, b"ep-h", timeout=60)
                await proc.stdout.aclose()  # the reader leaves, as head does after its lines
                with anyio.fail_after(60):
                    for i in range(1000):  # each record is a write into the closed pipe; the first one ends tail
                        await t.publish(traj_subject("ep-h"), turn("ep-h", i))
                        with anyio.move_on_after(0.5):
                            await proc.wait()
                        if proc.returncode is not None:
                            break
            with anyio.fail_after(10):
                async for chunk in proc.stderr:
                    err.extend(chunk)
        finally:
            if proc.returncode is None:
                proc.kill()
    stderr = err.decode()
    assert stderr.splitlines() == [f"# tailing t1.traj.> on {nats_server.url} (Ctrl-C to stop)"], stderr
    assert proc.returncode == 141


def test_status_json_still_parses(tmp_path, capsys):
    run_dir = tmp_path / "run"
    ClusterState(run_dir=str(run_dir), status="stopped").save()
    assert cli.main(["status", "--run-dir", str(run_dir), "--json"]) == cli.EXIT_NOT_RUNNING
    assert json.loads(capsys.readouterr().out)["status"] == "stopped"
