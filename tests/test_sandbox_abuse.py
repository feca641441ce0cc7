"""Abuse tests for BwrapSandbox: each tries to hurt or read the host from inside and checks from the host
that it was contained and that the host is unaffected."""

from __future__ import annotations

import os
import resource
import secrets
import time
from pathlib import Path

import anyio
import pytest

from sandbox_agent.sandbox import BwrapSandbox, SandboxConfig, uids

CFG = SandboxConfig(command_timeout_s=10.0, kill_grace_s=0.5)


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    d = tmp_path / "work"
    d.mkdir()
    return d


@pytest.fixture
async def sb(workdir: Path):
    async with BwrapSandbox.open(workdir, CFG) as s:
        yield s


def _pids_with(uid: int, needle: str) -> set[int]:
    found = set()
    for pid in uids.uid_pids(uid):
        try:
            if needle in Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode():
                found.add(pid)
        except FileNotFoundError:
            pass
    return found


def _alive(pid: int) -> bool:
    info = uids._proc_uid_state(pid)
    return info is not None and info[1] not in ("Z", "X")


async def test_no_network_egress_and_no_host_loopback(sb: BwrapSandbox) -> None:
    connections = 0

    async def handler(stream: anyio.abc.SocketStream) -> None:
        nonlocal connections
        connections += 1
        await stream.aclose()

    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, handler)
        script = (
            "import socket, sys\n"
            "for host, port in (('1.1.1.1', 80), ('8.8.8.8', 53), ('127.0.0.1', int(sys.argv[1]))):\n"
            "    s = socket.socket(); s.settimeout(3)\n"
            "    try:\n"
            "        s.connect((host, port)); print('CONNECTED', host)\n"
            "    except OSError as e:\n"
            "        print('refused', host, e.errno)\n"
        )
        await sb.write_file("net.py", script.encode())
        r = await sb.exec(f"python3 net.py {port}; getent hosts example.com || echo no-dns", timeout=20)
        # The host's own loopback server is reachable from the host (the check is live)...
        async with await anyio.connect_tcp("127.0.0.1", port):
            pass
        await anyio.sleep(0.1)
        tg.cancel_scope.cancel()
    assert "CONNECTED" not in r.output, r.output
    assert r.output.count("refused") == 3 and "no-dns" in r.output
    assert connections == 1  # ...and only the host's own connection ever arrived


async def test_host_files_are_not_visible(sb: BwrapSandbox, tmp_path: Path) -> None:
    secret = tmp_path / "host-secret.txt"
    secret.write_text("s3cret")
    r = await sb.exec(
        f"cat {secret}; cat /etc/shadow; ls /root; ls /work/main; cat /work/main/pyproject.toml; "
        "ls /home; cat /proc/1/environ; ls /proc/1/root/; cat /proc/1/cmdline >/dev/null && echo cmdline-ok; "
        "ls /etc"
    )
    assert "s3cret" not in r.output and "root:" not in r.output.split("cmdline-ok")[0].replace("root:x:0:0", "")
    assert "[project]" not in r.output
    for needle in ("No such file", "Permission denied"):
        assert needle in r.output
    etc = r.output.split("cmdline-ok\n")[1].split()
    assert "shadow" not in etc and "gshadow" not in etc and "passwd" in etc
    r = await sb.exec("grep -c . /etc/passwd; id -un; cat /proc/self/status | grep -E '^(CapEff|CapBnd|NoNewPrivs)'")
    assert r.output.splitlines() == [
        "3",
        "agent",
        "CapEff:\t0000000000000000",
        "CapBnd:\t0000000000000000",
        "NoNewPrivs:\t1",
    ]


async def test_writes_outside_the_work_dir_fail_or_stay_private(sb: BwrapSandbox, workdir: Path) -> None:
    name = f"t1-abuse-{secrets.token_hex(4)}"
    r = await sb.exec(
        f"for p in /usr/{name} /etc/{name} /{name} /bin/{name} /proc/{name} /dev/{name}; do "
        f"touch $p 2>/dev/null && echo WROTE $p; done; echo private > /tmp/{name}; cat /tmp/{name}; "
        f"echo ok > /workspace/{name}"
    )
    assert "WROTE" not in r.output and r.output.startswith("private\n")
    for host in (f"/usr/{name}", f"/etc/{name}", f"/{name}", f"/tmp/{name}", f"/dev/{name}"):
        assert not os.path.exists(host), host
    assert (workdir / name).read_text() == "ok\n"


async def test_fork_bomb_is_contained_and_cleaned_up(workdir: Path) -> None:
    cfg = SandboxConfig(command_timeout_s=3.0, kill_grace_s=0.5, processes=64)
    peak, lag = 0, 0.0
    async with BwrapSandbox.open(workdir, cfg) as s:
        uid = s.uid

        async def watch() -> None:  # from the host, while the bomb goes off
            nonlocal peak, lag
            for _ in range(20):
                t0 = time.monotonic()
                await anyio.sleep(0.1)
                lag = max(lag, time.monotonic() - t0 - 0.1)
                peak = max(peak, len(uids.uid_pids(uid)))

        async with anyio.create_task_group() as tg:
            tg.start_soon(watch)
            await s.exec("bomb() { bomb | bomb & }; bomb; sleep 1", timeout=3)
        assert 0 < peak <= cfg.processes, peak  # RLIMIT_NPROC binds: the uid is a real unprivileged one
        assert lag < 1.0, lag  # the host event loop kept running
        r = await s.exec("echo survived", timeout=5)  # the same shell or a restarted one; never a hang
        assert r.exit_code is not None or r.timed_out
    assert uids.uid_pids(uid, include_zombies=True) == set()


async def test_filling_the_disk_hits_fsize_and_tmpfs_size(workdir: Path) -> None:
    cfg = SandboxConfig(file_size_bytes=8 << 20, tmp_size_bytes=16 << 20, kill_grace_s=0.5)
    async with BwrapSandbox.open(workdir, cfg) as s:
        r = await s.exec("dd if=/dev/zero of=/workspace/big bs=1M count=64 2>&1; stat -c %s /workspace/big")
        assert int(r.output.split()[-1]) <= cfg.file_size_bytes
        r = await s.exec(
            "for i in 1 2 3 4; do "
            "dd if=/dev/zero of=/tmp/f$i bs=1M count=7 2>&1 | grep -o 'No space.*'; done; "
            "du -sm /tmp | cut -f1"
        )
        assert "No space left on device" in r.output
        assert int(r.output.split()[-1]) <= 16
    assert os.path.getsize(workdir / "big") <= cfg.file_size_bytes


async def test_allocating_20_gb_fails_under_rlimit_as(sb: BwrapSandbox) -> None:
    r = await sb.exec(
        "python3 -c 'x = bytearray(20 << 30)'; echo rc=$?; "
        "python3 -c 'import resource; print(resource.getrlimit(resource.RLIMIT_AS))'"
    )
    assert "MemoryError" in r.output and "rc=1" in r.output
    assert f"({CFG.address_space_bytes}, {CFG.address_space_bytes})" in r.output
    r = await sb.exec("ulimit -v unlimited; echo rc=$?")  # the hard limit cannot be raised from inside
    assert "rc=1" in r.output


async def test_printing_100_mb_is_capped_and_host_memory_stays_flat(sb: BwrapSandbox) -> None:
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.monotonic()
    r = await sb.exec("head -c 100000000 /dev/urandom | base64 -w 1000", timeout=60)
    dt = time.monotonic() - t0
    peak_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert r.exit_code == 0 and r.truncated
    assert len(r.output.encode()) < CFG.output_limit_bytes + 200
    assert "bytes truncated" in r.output
    assert (peak_after - peak_before) * 1024 < 64 << 20, (peak_before, peak_after)
    assert dt < 60


async def test_background_processes_die_with_the_sandbox(workdir: Path) -> None:
    async with BwrapSandbox.open(workdir, CFG) as s:
        uid = s.uid
        await s.exec("sleep 10000 & (setsid sleep 10001 &) ; nohup sleep 10002 >/dev/null 2>&1 &")
        with anyio.fail_after(5):  # background jobs may not have exec'd yet
            while len(pids := _pids_with(uid, "sleep 1000")) < 3:
                await anyio.sleep(0.02)
    assert not any(_alive(p) for p in pids)
    assert uids.uid_pids(uid, include_zombies=True) == set()


async def test_a_command_ignoring_sigterm_is_killed_by_the_timeout(sb: BwrapSandbox) -> None:
    await sb.exec("STATE=kept")
    prog = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "print('armed', flush=True); time.sleep(1000)"
    )
    t0 = time.monotonic()
    r = await sb.exec(f'python3 -c "{prog}"; echo not-reached', timeout=1.5)
    assert r.timed_out and r.exit_code is None and "armed" in r.output and "not-reached" not in r.output
    assert time.monotonic() - t0 < 1.5 + CFG.kill_grace_s + 1.5
    assert not _pids_with(sb.uid, "time.sleep")
    r = await sb.exec("trap '' TERM; sleep 1000", timeout=0.5)  # the shell itself ignores TERM too now
    assert r.timed_out and not _pids_with(sb.uid, "sleep 1000")
    assert (await sb.exec("echo $STATE")).output == "kept\n"


async def test_300_turn_episode_leaks_no_process_or_fd(workdir: Path) -> None:
    fds_before = len(os.listdir("/proc/self/fd"))
    async with BwrapSandbox.open(workdir, CFG) as s:
        uid = s.uid
        await s.exec("n=0; mkdir -p logs")
        for turn in range(300):
            match turn % 5:
                case 0:
                    r = await s.exec("n=$((n + 1)); echo turn $n >> logs/turns.txt; echo $n")
                case 1:
                    r = await s.exec("n=$((n + 1)); ls logs | wc -l >/dev/null; echo $n")
                case 2:
                    r = await s.exec("n=$((n + 1)); cd logs && cd ..; (exit 3) || echo $n")
                case 3:
                    r = await s.exec("n=$((n + 1)); printf '%s\\n' \"$n\" | cat")
                case _:
                    await s.write_file("scratch.txt", f"{turn}\n".encode())
                    r = await s.exec("n=$((n + 1)); grep -q . scratch.txt && echo $n")
            assert r.output == f"{turn + 1}\n" and r.exit_code == 0, (turn, r)
        assert len(uids.uid_pids(uid)) == 1  # only the shell
        assert (await s.read_file("logs/turns.txt")).count(b"turn") == 60
    assert uids.uid_pids(uid, include_zombies=True) == set()
    assert len(os.listdir("/proc/self/fd")) == fds_before
