"""Terminal-Bench's own test entry point, as its harness runs it, offline.

TB1 runs ``bash /tests/run-tests.sh``, TB2 ``bash /tests/test.sh`` and reads ``/logs/verifier/reward.*``. Most
published scripts start by fetching uv (``curl -LsSf https://astral.sh/uv/<ver>/install.sh | sh``) and then
install their pins. The verifier runs them with no network, so:

- uv and pip install from the image's wheelhouse (``OFFLINE_ENV``; the verifier mounts a wheelhouse with
  the script's own pins over it, ``sandbox_agent.images.wheels``);
- ``curl``/``wget`` of uv's installer are answered from the image (``SHIM``, first on PATH), where uv is
  preinstalled: the installer's work is already done, so a ``set -e`` script goes on as it would online.
  Every other URL goes to the real ``curl``/``wget`` (and fails offline, as it should).
"""

from __future__ import annotations

import re
from pathlib import Path

from sandbox_agent.images.build import OFFLINE_ENV
from sandbox_agent.tasks.task import Task

SHIM_DIR = "/opt/t1async/verifier-bin"
TESTS_MOUNT = "/tests"
SHIM = r"""#!/bin/bash
# t1async's offline verifier: uv is preinstalled in the image, so uv's installer is answered from here;
# anything else goes to the real command (and fails offline).
for a in "$@"; do
  if [[ "$a" =~ ^https?://astral\.sh/uv/([^/]+/)?install\.sh$ ]]; then
    cat <<'UV'
mkdir -p "$HOME/.local/bin"
[ -f "$HOME/.local/bin/env" ] || cp /root/.local/bin/env "$HOME/.local/bin/env" 2>/dev/null
for b in uv uvx; do command -v $b >/dev/null && ln -sf "$(command -v $b)" "$HOME/.local/bin/$b" 2>/dev/null; done
echo "uv installed (t1async: preinstalled in the image; the verifier is offline)"
true
UV
    exit 0
  fi
done
me="$(basename "$0")"
PATH="${PATH//$(dirname "$0"):/}" exec "$me" "$@"
"""


def write_shims(dest: Path) -> None:
    """``curl`` and ``wget`` shims (``SHIM``) into ``dest``, to be mounted at ``SHIM_DIR``."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("curl", "wget"):
        (dest / name).write_text(SHIM)
        (dest / name).chmod(0o755)


_NETWORK = re.compile(r"\b(curl|wget)\s|astral\.sh|\buvx?\s|\bpip3?\s+install|apt(-get)?\s+(update|install)")


def needs_network(script: Path) -> bool:
    """Whether a test script fetches something (uv, pytest, packages): offline it cannot run as written."""
    try:
        text = script.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return True
    return bool(_NETWORK.search("\n".join(ln for ln in text.splitlines() if not ln.lstrip().startswith("#"))))


def script_command(task: Task, nonce: str, offline: bool = True) -> str:
    """Terminal-Bench's own entry point, as its harness runs it (cwd = the task's working dir):
    TB1 ``bash /tests/run-tests.sh``, TB2 ``bash /tests/test.sh`` and then /logs/verifier/reward.*.

    ``offline``: uv and pip install from the base image's wheelhouse (pytest 8.4.1, pytest-json-ctrf), so
    the usual preamble (curl the uv installer, ``source $HOME/.local/bin/env``, ``uv venv``/``uv pip
    install pytest==8.4.1``/``uv run pytest``, ``uvx --with pytest==8.4.1 pytest``) runs as written."""
    out = f"/tmp/t1v-{nonce}.out"
    name = "run-tests.sh" if task.format == "tb1" else "test.sh"
    env = " ".join(f"{k}={v}" for k, v in OFFLINE_ENV) + f' PATH={SHIM_DIR}:"$PATH" ' if offline else ""
    return (
        "mkdir -p /logs/verifier; rm -f /logs/verifier/reward.txt /logs/verifier/reward.json "
        "/logs/verifier/rewards.json; "
        f'{env}T1_WORKDIR="$PWD" TEST_DIR={TESTS_MOUNT} bash {TESTS_MOUNT}/{name} >{out} 2>&1 </dev/null; '
        f"t1rc=$?; echo; echo '{nonce} RC' $t1rc; "
        f"echo; echo '{nonce} OUT'; tail -c 65536 {out}; echo; "
        f"echo '{nonce} REWARD' $(cat /logs/verifier/reward.txt 2>/dev/null "
        f"|| cat /logs/verifier/reward.json 2>/dev/null || cat /logs/verifier/rewards.json 2>/dev/null "
        f"| tr -d '\n'); rm -f {out}"
    )


def harbor_rewards(text: str) -> dict[str, float] | None:
    """Harbor's rewards: reward.txt (a number: ``{"reward": x}``), reward.json (``{"reward": x}``) or
    rewards.json (named rewards, ``{"name": x, ...}``); the numeric entries, or None if absent/unreadable."""
    import json

    text = text.strip()
    if not text:
        return None
    try:
        return {"reward": float(text)}
    except ValueError:
        pass
    try:
        v = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(v, dict):
        return None
    out = {str(k): float(x) for k, x in v.items() if isinstance(x, (int, float)) and not isinstance(x, bool)}
    return out or None


def harbor_reward(text: str) -> float | None:
    """The one reward: ``reward`` if named, else the least of the named ones (all must be met)."""
    r = harbor_rewards(text)
    return None if r is None else r.get("reward", min(r.values()))
