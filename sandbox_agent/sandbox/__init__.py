"""Sandboxes for agent episodes: one small seam (``Sandbox``), a real one (``BwrapSandbox``: a persistent
bash in bubblewrap, its own uid, rlimits) and an in-memory one (``MemorySandbox``) for tests of the layers
above. A container or remote backend implements the same four methods.

    async with BwrapSandbox.open(workdir, SandboxConfig(), slot=None) as sb:
        r = await sb.exec("cd src && make test", timeout=60)   # ExecResult(output, exit_code, timed_out, ...)
        await sb.write_file("notes.txt", b"...")              # paths are under /workspace (= workdir)
        data = await sb.read_file("/workspace/out.json")

See ``bwrap.py`` for the isolation and timeout rules and ``shell.py`` for the shell protocol.
"""

from sandbox_agent.sandbox.base import (
    SANDBOX_WORKDIR,
    ExecResult,
    OutputBuffer,
    Sandbox,
    SandboxClosedError,
    SandboxConfig,
    SandboxPathError,
    SandboxStartError,
    cap_output,
)
from sandbox_agent.sandbox.bwrap import BwrapSandbox
from sandbox_agent.sandbox.memory import MemorySandbox
from sandbox_agent.sandbox.uids import Slot, SlotPool, slot_pool
from t1async.protocol.errors import SandboxError

__all__ = [
    "SANDBOX_WORKDIR",
    "BwrapSandbox",
    "ExecResult",
    "MemorySandbox",
    "OutputBuffer",
    "Sandbox",
    "SandboxClosedError",
    "SandboxConfig",
    "SandboxError",
    "SandboxPathError",
    "SandboxStartError",
    "Slot",
    "SlotPool",
    "cap_output",
    "slot_pool",
]
