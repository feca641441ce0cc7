"""Conformance checks for any Sandbox (sandbox_agent.sandbox.Sandbox): exec, files under the work dir, paths
that leave it, the output cap, bad input and the lifecycle, as one check every implementation passes.

    from t1async.testing import check_sandbox, memory_shell

    async with BwrapSandbox.open(workdir, config) as sb:   # or ContainerSandbox, or yours
        await check_sandbox(sb)

It runs shell commands: ``SHELL_PRELUDE`` first (bash functions ``exit-with N`` and ``yes-long``), then
``echo WORD``, ``cat FILE``, ``exit-with 5`` and ``yes-long`` (50,000 lines of ``y``), so any bash-backed
sandbox can be checked as it is. A MemorySandbox is checked with ``memory_shell`` as its handler, a stand-in
for exactly those commands. The check closes the sandbox (closing twice is fine) and raises AssertionError
naming the broken property.
"""

from __future__ import annotations

from collections.abc import Callable

from sandbox_agent.sandbox import (
    SANDBOX_WORKDIR,
    ExecResult,
    MemorySandbox,
    Sandbox,
    SandboxClosedError,
    SandboxPathError,
)
from t1async.testing.asserts import raises

__all__ = ["SHELL_PRELUDE", "check_sandbox", "memory_shell"]

SHELL_PRELUDE = "yes-long() { yes | head -n 50000; }; exit-with() { return $1; }"


def memory_shell(box: list[MemorySandbox]) -> Callable[[str], ExecResult]:
    """A MemorySandbox handler for the commands check_sandbox runs (``box[0]`` is the sandbox, for ``cat``)."""

    def handle(command: str) -> ExecResult:
        word, _, arg = command.partition(" ")
        if word == "echo":
            return ExecResult(arg + "\n", 0, False, False, 0.0)
        if word == "cat":
            try:
                return ExecResult(box[0].files[f"{SANDBOX_WORKDIR}/{arg}"].decode(), 0, False, False, 0.0)
            except KeyError:
                return ExecResult(f"cat: {arg}: No such file or directory\n", 1, False, False, 0.0)
        if word == "yes-long":
            return ExecResult("y\n" * 50_000, 0, False, False, 0.0)
        return ExecResult("", int(arg) if word == "exit-with" else 0, False, False, 0.0)

    return handle


async def check_sandbox(s: Sandbox) -> None:
    """Check an open sandbox against the Sandbox contract; closes it."""
    assert isinstance(s, Sandbox), f"{type(s).__name__} does not implement the Sandbox protocol"
    await s.exec(SHELL_PRELUDE)
    r = await s.exec("echo hello")
    assert (r.output, r.exit_code, r.timed_out, r.truncated) == ("hello\n", 0, False, False), f"echo hello: {r}"
    assert (await s.exec("exit-with 5")).exit_code == 5, "exit code of `exit-with 5` is not 5"
    await _check_files(s)
    long = await s.exec("yes-long")
    assert long.truncated and "bytes truncated" in long.output, f"output of 100 kB not capped: {long.output[-80:]!r}"
    assert long.output.startswith("y\ny\n"), f"capped output lost its head: {long.output[:20]!r}"
    with raises(ValueError):
        await s.exec("echo \0")  # a NUL cannot reach a shell: refused before it is sent
    await s.aclose()
    await s.aclose()  # idempotent
    with raises(SandboxClosedError):
        await s.exec("echo hello")
    with raises(SandboxClosedError):
        await s.read_file("a.txt")


async def _check_files(s: Sandbox) -> None:
    await s.write_file("a.txt", b"alpha\n")
    assert (await s.exec("cat a.txt")).output == "alpha\n", "a written file is not what the shell reads"
    assert await s.read_file(f"{SANDBOX_WORKDIR}/a.txt") == b"alpha\n", "absolute work dir path reads differ"
    await s.write_file("a.txt", b"beta\n")
    assert await s.read_file("a.txt") == b"beta\n", "overwriting a file does not truncate it"
    await s.write_file("sub/dir/b.bin", bytes(range(256)))
    assert await s.read_file("sub/dir/b.bin") == bytes(range(256)), "binary file in new subdirs differs"
    assert (await s.exec("cat missing.txt")).exit_code == 1, "cat of a missing file does not exit 1"
    with raises(FileNotFoundError):
        await s.read_file("missing.txt")
    for outside in ("/etc/passwd", "../escape", "/tmp/x"):
        with raises(SandboxPathError):
            await s.read_file(outside)
        with raises(SandboxPathError):
            await s.write_file(outside, b"x")
    with raises(SandboxPathError):
        await s.read_file("sub")  # a directory
