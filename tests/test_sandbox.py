"""BwrapSandbox (real bubblewrap) and MemorySandbox: the shell protocol, timeouts, output cap, files,
teardown, start errors, and one conformance set run against both."""

from __future__ import annotations

import os
import time
from pathlib import Path

import anyio
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sandbox_agent.sandbox import (
    SANDBOX_WORKDIR,
    BwrapSandbox,
    MemorySandbox,
    OutputBuffer,
    Sandbox,
    SandboxClosedError,
    SandboxConfig,
    SandboxPathError,
    SandboxStartError,
    uids,
)
from sandbox_agent.sandbox.shell import MARK, ShellChannel, ShellEOF
from t1async.testing.sandbox import check_sandbox, memory_shell

FAST = SandboxConfig(command_timeout_s=10.0, kill_grace_s=0.5)


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    d = tmp_path / "work"  # below pytest's 0700 tmp dirs on purpose: the bind must still work
    d.mkdir()
    return d


@pytest.fixture
async def sb(workdir: Path):
    async with BwrapSandbox.open(workdir, FAST) as s:
        yield s


def _sandbox_cmdlines(uid: int) -> list[str]:
    out = []
    for pid in uids.uid_pids(uid):
        try:
            out.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode())
        except FileNotFoundError:
            pass
    return out


# -- the persistent shell -------------------------------------------------------------------------------


async def test_state_persists_across_exec(sb: BwrapSandbox) -> None:
    assert (await sb.exec("pwd")).output == f"{SANDBOX_WORKDIR}\n"
    await sb.exec("mkdir -p sub/dir && cd sub/dir")
    await sb.exec('COUNT=41; greet() { echo "hi $1"; }; export EXPORTED=yes')
    await sb.exec("sleep 30 & echo $! > /tmp/bgpid")
    r = await sb.exec(
        "pwd; echo $((COUNT + 1)); greet bob; bash -c 'echo $EXPORTED'; "
        'kill -0 "$(cat /tmp/bgpid)" && echo bg-alive; jobs | wc -l'
    )
    assert r.output == f"{SANDBOX_WORKDIR}/sub/dir\n42\nhi bob\nyes\nbg-alive\n1\n"
    assert r.exit_code == 0 and not r.timed_out and not r.truncated


async def test_process_tree_walk_finds_exactly_the_uid_processes(sb: BwrapSandbox) -> None:
    await sb.exec("sleep 30 & (setsid sleep 31 &); (sleep 32 | cat &); nohup sleep 33 >/dev/null 2>&1 &")
    session = sb._session
    assert session is not None and session.init_pid is not None  # the fast path is in use on this kernel
    with anyio.fail_after(5):
        while len(uids.uid_pids(sb.uid)) < 6:  # shell + 4 sleeps + cat
            await anyio.sleep(0.02)
    assert session.pids(sb.uid) == uids.uid_pids(sb.uid)


async def test_exit_codes_and_dollar_question(sb: BwrapSandbox) -> None:
    assert (await sb.exec("true")).exit_code == 0
    assert (await sb.exec("false")).exit_code == 1
    assert (await sb.exec("(exit 42)")).exit_code == 42
    assert (await sb.exec("echo $?")).output == "42\n"  # $? carries over from the previous command
    assert (await sb.exec("nosuchcommand-xyz")).exit_code == 127


async def test_multiline_heredoc_and_no_trailing_newline(sb: BwrapSandbox) -> None:
    r = await sb.exec("cat > f.txt <<'EOF'\nline 1 $HOME\n  line 2\nEOF\ncat f.txt\nprintf 'no newline'")
    assert r.output == "line 1 $HOME\n  line 2\nno newline"
    r = await sb.exec('for i in 1 2 3; do\n  echo "n=$i"\ndone | tail -n 1')
    assert r.output == "n=3\n"


async def test_syntax_errors_and_unbalanced_quotes_do_not_hang(sb: BwrapSandbox) -> None:
    t0 = time.monotonic()
    for bad in ("echo 'unbalanced", 'echo "unbalanced', "if then fi", "echo $(", "cat <<EOF\nno terminator"):
        r = await sb.exec(bad, timeout=5)
        assert not r.timed_out, bad
        assert r.exit_code is not None
    assert time.monotonic() - t0 < 5
    assert (await sb.exec("echo 'unbalanced")).exit_code == 2
    assert (await sb.exec("echo still-here")).output == "still-here\n"


async def test_forged_and_replayed_markers_do_not_end_a_command(sb: BwrapSandbox) -> None:
    fake = f"{MARK.decode()}{'0' * 32}_0 /x"
    r = await sb.exec(f"echo '{fake}'; sleep 0.3; echo real-end")
    assert r.output == f"{fake}\nreal-end\n"
    # xtrace echoes the shell's own commands: neither the trace nor the marker may leak into the protocol.
    r = await sb.exec("set -x; echo traced")
    assert "traced" in r.output and MARK.decode() not in r.output
    r = await sb.exec("set +x; echo after")
    assert r.output.endswith("after\n") and r.exit_code == 0


class _DribbleStream:
    """Serves fixed bytes a few at a time (marker split across reads), then EOF."""

    def __init__(self, data: bytes, step: int) -> None:
        self.data, self.step = data, step

    async def receive(self, max_bytes: int = 65536) -> bytes:
        if not self.data:
            raise anyio.EndOfStream
        chunk, self.data = self.data[: min(self.step, max_bytes)], self.data[min(self.step, max_bytes) :]
        return chunk


@pytest.mark.parametrize("step", [1, 3, 7, 4096])
async def test_channel_finds_split_marker_and_ignores_other_nonces(step: int) -> None:
    nonce = "ab" * 16
    stream = (
        b"out "
        + MARK
        + b"cd" * 16
        + b"_0 /x\n"
        + b"more"
        + MARK
        + nonce.encode()
        + b"_7 /tmp/a\\ b\n"
        + b"late background output"
    )
    ch = ShellChannel(stdin=None, stdout=_DribbleStream(stream, step))  # type: ignore[arg-type]
    out = OutputBuffer(1 << 16)
    done = await ch.read_until_done(nonce, out)
    assert (done.status, done.cwd_quoted) == (7, "/tmp/a\\ b")
    assert out.text() == "out " + MARK.decode() + "cd" * 16 + "_0 /x\nmore"
    rest = OutputBuffer(1 << 16)
    with pytest.raises(ShellEOF):
        await ch.read_until_done("ef" * 16, rest)
    assert rest.text() == "late background output"


# -- timeouts -------------------------------------------------------------------------------------------


async def test_timeout_kills_the_command_and_the_shell_keeps_its_state(sb: BwrapSandbox) -> None:
    await sb.exec("cd /tmp && KEEP=me")
    t0 = time.monotonic()
    r = await sb.exec("sleep 100 | cat; echo never", timeout=1.0)
    assert r.timed_out and r.exit_code is None
    assert "never" not in r.output and "[timed out after 1 s" in r.output
    assert time.monotonic() - t0 < 1.0 + sb.config.kill_grace_s + 1.5
    assert not [c for c in _sandbox_cmdlines(sb.uid) if "sleep 100" in c]
    r = await sb.exec("pwd; echo $KEEP")
    assert r.output == "/tmp\nme\n" and r.exit_code == 0
    # The rest of a timed-out command is abandoned, as ^C would: later commands, loop bodies, functions.
    r = await sb.exec(
        "f() { sleep 100; touch in-f; }; for i in 1 2 3; do f; touch loop-$i; done; touch after", timeout=1.0
    )
    assert r.timed_out
    assert (await sb.exec("ls")).output == ""
    assert (await sb.exec("echo $KEEP")).output == "me\n"


async def test_timeout_in_a_busy_shell_restarts_it_in_the_same_cwd(sb: BwrapSandbox) -> None:
    await sb.exec("cd /tmp && LOST=1")
    r = await sb.exec("while :; do :; done", timeout=0.5)
    assert r.timed_out and r.exit_code is None and "did not recover" in r.output
    r = await sb.exec('pwd; echo "lost=${LOST:-}"')
    assert r.exit_code == 0
    assert r.output.startswith("/tmp\nlost=\n") and "shell was restarted" in r.output


async def test_exit_ends_the_shell_and_the_next_command_gets_a_fresh_one(sb: BwrapSandbox) -> None:
    await sb.exec("cd /tmp")
    r = await sb.exec("echo bye; exit 3")
    assert r.exit_code == 3 and r.output.startswith("bye\n") and not r.timed_out
    r = await sb.exec("pwd")
    assert r.output.startswith("/tmp\n") and r.exit_code == 0


async def test_a_cancelled_exec_is_stopped_before_the_next_one(sb: BwrapSandbox) -> None:
    await sb.exec("cd /tmp && KEEP=yes")
    with anyio.move_on_after(0.5) as scope:
        await sb.exec("sleep 100; touch /tmp/should-not-exist", timeout=60)
    assert scope.cancelled_caught
    r = await sb.exec("ls /tmp; echo $KEEP; pwd")
    assert r.output == "yes\n/tmp\n" and r.exit_code == 0
    assert not [c for c in _sandbox_cmdlines(sb.uid) if "sleep 100" in c]


# -- output cap -----------------------------------------------------------------------------------------


async def test_output_is_capped_keeping_head_and_tail(sb: BwrapSandbox) -> None:
    r = await sb.exec("echo START; head -c 100000 /dev/zero | tr '\\0' x; echo; echo END")
    limit = sb.config.output_limit_bytes
    total = len("START\n") + 100000 + 1 + len("END\n")
    assert r.truncated and r.exit_code == 0
    assert r.output.startswith("START\nxxx") and r.output.endswith("xxx\nEND\n")
    assert f"[... {total - limit} bytes truncated ...]" in r.output
    assert len(r.output) < limit + 100


@settings(max_examples=200, deadline=None)
@given(chunks=st.lists(st.binary(max_size=300), max_size=20), limit=st.integers(64, 700))
def test_output_buffer_keeps_exact_head_and_tail(chunks: list[bytes], limit: int) -> None:
    buf = OutputBuffer(limit)
    for c in chunks:
        buf.feed(c)
    data = b"".join(chunks)
    assert buf.total == len(data) and buf.truncated == (len(data) > limit)
    if len(data) <= limit:
        assert buf.text() == data.decode("utf-8", errors="replace")
    else:
        head, tail = data[: limit // 2], data[len(data) - (limit - limit // 2) :]
        note = f"\n[... {len(data) - len(head) - len(tail)} bytes truncated ...]\n"
        assert buf.text() == head.decode("utf-8", "replace") + note + tail.decode("utf-8", "replace")


# -- files ----------------------------------------------------------------------------------------------


async def test_files_cross_between_host_api_and_shell(sb: BwrapSandbox, workdir: Path) -> None:
    blob = bytes(range(256)) * 3
    await sb.write_file("deep/new/dir/blob.bin", blob)
    r = await sb.exec("sha256sum deep/new/dir/blob.bin | cut -c1-16; stat -c %u deep/new/dir/blob.bin deep/new")
    import hashlib

    assert r.output == f"{hashlib.sha256(blob).hexdigest()[:16]}\n{sb.uid}\n{sb.uid}\n"
    await sb.exec("echo from-shell > made.txt; ln -s made.txt link.txt; ln -s /workspace/made.txt abs.txt")
    assert await sb.read_file("made.txt") == b"from-shell\n"
    assert await sb.read_file(f"{SANDBOX_WORKDIR}/link.txt") == b"from-shell\n"
    assert await sb.read_file("abs.txt") == b"from-shell\n"
    assert (workdir / "made.txt").read_bytes() == b"from-shell\n"


async def test_file_api_refuses_to_leave_the_work_dir(sb: BwrapSandbox, tmp_path: Path) -> None:
    secret = tmp_path / "host-secret"
    secret.write_text("do not leak")
    await sb.exec(f"ln -s {secret} host.lnk; ln -s /etc/shadow shadow.lnk; ln -s ../../.. up.lnk; mkfifo fifo")
    for path in ("host.lnk", "shadow.lnk", "up.lnk/etc/passwd", "../x", "/etc/passwd", "/tmp/x", SANDBOX_WORKDIR):
        with pytest.raises(SandboxPathError):
            await sb.read_file(path)
    with pytest.raises(SandboxPathError):
        await sb.write_file("shadow.lnk", b"x")
    with pytest.raises(SandboxPathError):
        await sb.write_file("host.lnk", b"overwritten")
    assert secret.read_text() == "do not leak"
    with anyio.fail_after(5):  # a FIFO must not block the host
        with pytest.raises(SandboxPathError):
            await sb.read_file("fifo")
    with pytest.raises(FileNotFoundError):
        await sb.read_file("missing.txt")


async def test_python_and_pytest_work_inside(sb: BwrapSandbox) -> None:
    await sb.write_file("test_inside.py", b"def test_ok():\n    assert 1 + 1 == 2\n")
    r = await sb.exec("python3 -I -B -m pytest -q -p no:cacheprovider test_inside.py", timeout=60)
    assert r.exit_code == 0, r.output
    assert "1 passed" in r.output


async def test_extra_ro_binds_are_readable_not_writable(workdir: Path, tmp_path: Path) -> None:
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_x.py").write_text("X = 1\n")
    cfg = SandboxConfig(extra_ro_binds=((str(tests), "/tests"),))
    async with BwrapSandbox.open(workdir, cfg) as s:
        r = await s.exec("cat /tests/test_x.py; touch /tests/y 2>&1 | grep -c 'Read-only'")
        assert r.output == "X = 1\n1\n"
    os.chmod(tests, 0o700)
    with pytest.raises(SandboxStartError, match="not readable by the sandbox"):
        async with BwrapSandbox.open(workdir, cfg):
            pass


# -- start errors and lifecycle ------------------------------------------------------------------------


async def test_missing_bwrap_is_a_clear_start_error(workdir: Path) -> None:
    with pytest.raises(SandboxStartError, match="apt-get install bubblewrap"):
        async with BwrapSandbox.open(workdir, SandboxConfig(bwrap_path="/nonexistent/bwrap")):
            pass


async def test_bwrap_refusing_to_start_is_a_clear_start_error(workdir: Path, tmp_path: Path) -> None:
    src = tmp_path / "ro"
    src.mkdir(mode=0o755)
    bad = SandboxConfig(extra_ro_binds=((str(src), "/usr/cannot/create/here"),))
    with pytest.raises(SandboxStartError, match="bubblewrap sandbox failed to start") as info:
        async with BwrapSandbox.open(workdir, bad):
            pass
    assert "/usr/cannot/create/here" in str(info.value)
    with pytest.raises(SandboxStartError, match="does not exist"):
        async with BwrapSandbox.open(tmp_path / "nope", FAST):
            pass


async def test_teardown_leaves_no_process_even_when_cancelled(workdir: Path) -> None:
    async with BwrapSandbox.open(workdir, FAST) as s:
        await s.exec("sleep 1000 & setsid sleep 1001 & nohup sleep 1002 >/dev/null 2>&1 & disown -a")
        uid, bwrap_pid = s.uid, s._session.proc.pid  # type: ignore[union-attr]
        with anyio.fail_after(5):  # background jobs may not have exec'd yet
            while len([c for c in _sandbox_cmdlines(uid) if "sleep 100" in c]) < 3:
                await anyio.sleep(0.02)
    assert uids.uid_pids(uid, include_zombies=True) == set()
    assert not Path(f"/proc/{bwrap_pid}").exists() or uids._proc_uid_state(bwrap_pid) is None
    with pytest.raises(SandboxClosedError):
        await s.exec("echo")

    with anyio.move_on_after(1.0) as scope:
        async with BwrapSandbox.open(workdir, FAST) as s2:
            uid2 = s2.uid
            await s2.exec("sleep 1000 & sleep 100", timeout=60)
    assert scope.cancelled_caught
    assert uids.uid_pids(uid2, include_zombies=True) == set()


async def test_concurrent_sandboxes_get_distinct_uids_and_slots_are_exclusive(workdir: Path, tmp_path: Path) -> None:
    uids: list[int] = []

    async def one(i: int) -> None:
        d = tmp_path / f"w{i}"
        d.mkdir()
        async with BwrapSandbox.open(d, FAST) as s:
            uids.append(int((await s.exec("id -u")).output))
            await anyio.sleep(0.3)

    async with anyio.create_task_group() as tg:
        for i in range(3):
            tg.start_soon(one, i)
    assert len(set(uids)) == 3
    async with BwrapSandbox.open(workdir, FAST) as s:
        with pytest.raises(SandboxStartError, match="in use"):
            async with BwrapSandbox.open(workdir, FAST, slot=s.slot.index):
                pass


# -- conformance: the same expectations of BwrapSandbox and MemorySandbox ------------------------------


@pytest.fixture(params=["bwrap", "memory"])
async def any_sandbox(request, workdir: Path):
    if request.param == "memory":
        box: list[MemorySandbox] = []
        box.append(MemorySandbox(memory_shell(box), workdir=workdir))
        async with box[0] as s:
            yield s
    else:
        async with BwrapSandbox.open(workdir, FAST) as s:
            yield s


async def test_conformance(any_sandbox: Sandbox) -> None:
    """t1async.testing.check_sandbox against BwrapSandbox and MemorySandbox."""
    await check_sandbox(any_sandbox)


async def test_check_sandbox_catches_a_sandbox_that_lets_paths_escape(workdir: Path) -> None:
    class Leaky(MemorySandbox):
        async def read_file(self, path: str) -> bytes:
            if path.startswith("/etc"):
                return b"root:x:0:0"
            return await super().read_file(path)

    box: list[MemorySandbox] = []
    box.append(Leaky(memory_shell(box), workdir=workdir))
    async with box[0] as s:
        with pytest.raises(AssertionError, match="did not raise SandboxPathError"):
            await check_sandbox(s)
