"""The agent's action format: parse a model reply into an action, render observations.

Pure functions, no I/O. The format, as the system prompt (``SYSTEM_PROMPT``) tells the model:

- run a command: one fenced block ```` ```bash\\n<command>\\n``` ```` (``sh``/``shell``/no label also accepted),
  or a JSON tool call ``{"tool": "bash", "command": "..."}`` (``{"name": "bash", "arguments":
  {"command": ...}}`` also accepted, optionally inside ``<tool_call>...</tool_call>``);
- finish: a line ``DONE`` or ``<done/>``, or ``{"tool": "done"}``. A reply with both a command and a done
  marker runs the command, then finishes.

Text inside ``<think>...</think>`` is ignored. Anything else is an ``invalid`` action whose ``error`` is a
helpful observation for the model; parsing never raises.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Literal

ActionKind = Literal["bash", "done", "invalid"]

SYSTEM_PROMPT = """\
You are an expert Linux user working in a bash shell inside a sandbox. Your job is to complete the task \
the user gives you by running shell commands. The shell is persistent: the working directory, variables \
and files carry over between your commands. There is no network access.

Each reply runs at most ONE command. Put it in a fenced block:

```bash
ls -la
```

(or, equivalently, reply with a JSON tool call: {"tool": "bash", "command": "ls -la"}).
After each command you will see its exit code and output (long output is truncated).
When the task is complete, reply with a line containing only:
DONE
(or {"tool": "done"}). Do not ask questions; nobody will answer. Work step by step and check your work \
before you finish."""

_THINK = re.compile(r"<think>.*?</think>", re.DOTALL)
_SPECIAL = re.compile(r"<\|[A-Za-z0-9_]+\|>")
_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[ \t]*\n(.*?)```", re.DOTALL)
_OPEN_FENCE = re.compile(r"```[ \t]*(bash|sh|shell|console)?[ \t]*\n", re.DOTALL)
_DONE_LINE = re.compile(r"^[ \t]*(DONE|<done\s*/?>)[ \t]*$", re.MULTILINE)
_SHELL_LABELS = frozenset({"", "bash", "sh", "shell", "console", "zsh"})


@dataclass(frozen=True)
class Action:
    kind: ActionKind
    command: str = ""  # the shell command (kind == "bash")
    done: bool = False  # the reply also declared the task done (finish after running the command)
    error: str = ""  # kind == "invalid": what was wrong and what to do (shown to the model)
    note: str = ""  # a warning to prepend to the observation (e.g. extra blocks ignored)


def _clean(text: str) -> str:
    text = _THINK.sub("", text)
    if "<think>" in text:  # unclosed: everything after it is thinking
        text = text[: text.index("<think>")]
    return _SPECIAL.sub("", text)


def _json_calls(text: str) -> list[dict]:
    out: list[dict] = []
    dec = json.JSONDecoder()
    i = text.find("{")
    while i != -1:
        try:
            obj, end = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            i = text.find("{", i + 1)
            continue
        if isinstance(obj, dict) and ("tool" in obj or "name" in obj):
            out.append(obj)
        i = text.find("{", end)
    return out


def _from_call(obj: dict) -> Action:
    tool = obj.get("tool", obj.get("name"))
    args = obj.get("arguments", obj)
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            args = {}
    if not isinstance(args, dict):
        args = {}
    if tool == "done":
        return Action("done", done=True)
    if tool == "bash":
        cmd = args.get("command")
        if not isinstance(cmd, str) or not cmd.strip():
            return Action(
                "invalid",
                error='Your bash tool call has no "command" string. Use {"tool": "bash", "command": "ls"}.',
            )
        return Action("bash", command=cmd.strip("\n"))
    return Action(
        "invalid",
        error=f'Unknown tool {tool!r}. The tools are "bash" (with a "command") and "done".',
    )


def parse_action(text: str) -> Action:
    """Parse one model reply. Never raises; a malformed reply gives ``kind == "invalid"``."""
    body = _clean(text)
    done = bool(_DONE_LINE.search(body))
    blocks = [(m.group(1).lower(), m.group(2)) for m in _FENCE.finditer(body)]
    shell = [b for lab, b in blocks if lab in _SHELL_LABELS]
    if shell:
        cmd = shell[0].strip("\n")
        if not cmd.strip():
            return Action("invalid", error="Your ```bash block is empty. Put one command inside it.")
        note = f"[note: your reply had {len(shell)} command blocks; only the first was run]" if len(shell) > 1 else ""
        return Action("bash", command=cmd, done=done, note=note)
    calls = _json_calls(body)
    if calls:
        act = _from_call(calls[0])
        if act.kind == "bash" and done:
            return Action("bash", command=act.command, done=True)
        return act
    if done:
        return Action("done", done=True)
    if _OPEN_FENCE.search(body):
        return Action(
            "invalid",
            error="Your ```bash block was not closed (it needs a closing ``` line), so nothing was run. "
            "Keep commands short; reply with one complete block.",
        )
    if blocks:
        return Action(
            "invalid",
            error=f"Your reply has a ```{blocks[0][0]} block, but only ```bash blocks are run. "
            "To write a file, use a shell command (e.g. cat > file <<'EOF' ... EOF) in a ```bash block.",
        )
    return Action(
        "invalid",
        error="No command found in your reply. Reply with one ```bash block containing a command, "
        "or with a line DONE when the task is complete.",
    )


def format_observation(
    output: str,
    exit_code: int | None,
    *,
    timed_out: bool = False,
    truncated: bool = False,
    timeout_s: float | None = None,
    max_chars: int = 8192,
    note: str = "",
) -> str:
    """The text the model sees after a command: a status line, then the output (head and tail kept)."""
    if timed_out:
        limit = f" after {timeout_s:g}s" if timeout_s else ""
        status = f"[command timed out{limit}; it was stopped]"
    elif exit_code is None:
        status = "[command ended without an exit code]"
    else:
        status = f"[exit code: {exit_code}]"
    if len(output) > max_chars:
        half = max_chars // 2
        cut = len(output) - 2 * half
        output = f"{output[:half]}\n[... {cut} characters cut ...]\n{output[-half:]}"
        truncated = True
    parts = [p for p in (note, status) if p]
    text = "\n".join(parts)
    if output:
        text += "\n" + output.rstrip("\n")
    if truncated:
        text += "\n[output truncated]"
    return text
