"""The container backend in tests: the TB task fixtures (``TB``, ``FIXTURES``), a sandbox config with short
timeouts (``FAST``), and the containers a test process owns (``ours``). The base image is conftest's
``base_image`` fixture."""

from __future__ import annotations

import os
from pathlib import Path

from sandbox_agent.images import build as images
from sandbox_agent.sandbox import SandboxConfig
from sandbox_agent.sandbox.lifecycle import OWNER_LABEL

TB = Path(__file__).resolve().parent / "tb_tasks"
FIXTURES = Path(__file__).resolve().parents[1] / "sandbox_agent" / "fixtures"
FAST = SandboxConfig(command_timeout_s=30.0, kill_grace_s=0.5)


def ours(owner: int | None = os.getpid()) -> set[str]:
    """Our containers: this test process's (default), or any t1async owner's (owner=None)."""
    label = OWNER_LABEL if owner is None else f"{OWNER_LABEL}={owner}"
    out = images.run_podman("ps", "-a", "--filter", f"label={label}", "--format", "{{.Names}}").stdout
    return set(out.decode().split())
