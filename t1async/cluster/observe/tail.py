"""``cluster tail``: print every record on a subject as it goes by (core subscription: live only).

Human lines (default) show, for a turn: episode, turn, policy version, token counts (input_len, keep, len of
input_delta, output), finish, reward, tests_passed, the drift view (``keep`` against the sequence length
this tail saw after the episode's previous turn, and the routing trace's start/rows against ``keep - 1``),
timings, the action and observation, and the decoded output when a tokenizer is available. ``fields``
picks which of these parts show (``TURN_FIELDS``); text is clipped to ``max_text`` characters and every
control character is escaped (``\n``, ``\x1b``, ...), so the output is plain text a pipe and grep take.
Colours only on a terminal (rich decides: a TTY, not ``NO_COLOR``).
``--json`` prints one object per record: the wire map with token/logprob arrays as lists, ``routing``
summarised as ``{start, dtype, shape}`` and bytes as hex (``fields`` keeps only those keys, plus
``subject`` and ``kind``). A malformed message prints one ``!`` line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np
from rich.console import Console
from rich.text import Text

from t1async.cluster.glossary import TURN_FIELDS
from t1async.protocol import wire
from t1async.protocol.fields import DTYPES
from t1async.transport import Message, NatsConfig, NatsTransport, traj_subject
from t1async.transport.auth import redact
from t1async.transport.base import HDR_DEAD_ERROR, HDR_DEAD_SUBJECT

_CLIP = 160
_ESCAPES = {c: f"\\x{c:02x}" for c in (*range(32), 127, *range(0x80, 0xA0))} | {9: "\\t", 10: "\\n", 13: "\\r"}


@dataclass(frozen=True)
class TailConfig:
    nats_url: str
    subject: str = "t1.traj.>"
    json: bool = False
    episode: str | None = None
    text: bool = True  # decode output ids when a tokenizer loads
    fields: tuple[str, ...] = ()  # () = all
    max_text: int = _CLIP  # 0 = no limit
    nats_creds: Path | None = None  # the reader's credentials (read only: transport/auth.py)


def escape(s: str) -> str:
    """Control characters (C0, DEL, C1) as escapes: the output stays one line of printable text."""
    return s.translate(_ESCAPES)


def _clip(s: str, n: int = _CLIP) -> str:
    s = escape(s)
    return s if n <= 0 or len(s) <= n else s[: max(n - 3, 1)] + "..."


class Formatter:
    """Turns messages into lines; remembers each episode's sequence length to show drift."""

    def __init__(self, *, text: bool = True, fields: tuple[str, ...] = (), max_text: int = _CLIP):
        self._seq_len: dict[str, int] = {}
        self._want_text = text and (not fields or "text" in fields)
        self.fields = set(fields or TURN_FIELDS)
        self.max_text = max_text
        self._tok: Any = None
        self._tok_tried = False

    def _tokenizer(self) -> Any:
        if self._want_text and not self._tok_tried:
            self._tok_tried = True
            try:
                from t1async.model.tokenizer import ChatTokenizer

                self._tok = ChatTokenizer.load()
            except Exception as exc:  # optional nicety: any failure just means "no text"
                self._tok = None
                self.tokenizer_error = f"{type(exc).__name__}: {exc}"
        return self._tok

    def line(self, msg: Message) -> str:
        if msg.error is not None:
            origin = msg.headers.get(HDR_DEAD_SUBJECT)
            extra = f" (dead letter from {origin}: {msg.headers.get(HDR_DEAD_ERROR, '')})" if origin else ""
            return (
                f"! malformed on {escape(msg.subject)}: [{msg.error.reason}] {_clip(str(msg.error), 300)} "
                f"({len(msg.data)} bytes){escape(extra)}"
            )
        rec = msg.record
        if isinstance(rec, wire.TurnRecord):
            return self._turn(rec)
        if isinstance(rec, wire.StartRecord):
            self._seq_len.pop(rec.episode, None)
            return escape(f"start ep={rec.episode} actor={rec.actor} task={rec.task} max_turns={rec.max_turns}")
        if isinstance(rec, wire.EndRecord):
            return escape(
                f"end   ep={rec.episode} turns={rec.turns} reason={rec.reason.value} "
                f"tests={rec.tests_passed}/{rec.tests_total} resolved={rec.resolved}"
                + (f" compactions={rec.compactions}" if rec.compactions else "")
                + (f" detail={_clip(rec.detail, self.max_text)}" if rec.detail else "")
            )
        if isinstance(rec, wire.MetricsRecord):
            vals = " ".join(f"{k}={_short(v)}" for k, v in sorted(rec.values.items()))
            return escape(f"metrics {rec.component} step={rec.step} v={rec.policy_version} {vals}")
        if isinstance(rec, wire.PolicyRecord):
            return escape(f"policy v={rec.policy_version} step={rec.step} weights={rec.weights}")
        fields = " ".join(f"{k}={v}" for k, v in wire.to_map(rec).items() if k not in ("v", "kind"))  # type: ignore[arg-type]
        return escape(f"{rec.kind} on {msg.subject}: {fields}")  # type: ignore[union-attr]

    def _turn(self, r: wire.TurnRecord) -> str:
        prev = self._seq_len.get(r.episode)
        self._seq_len[r.episode] = r.input_len + len(r.output_ids)
        if prev is None:
            drift = "prev=–"
        elif r.keep == prev:
            drift = f"prev={prev} clean"
        elif r.keep < prev and r.compacted:  # the context policy rebuilt the input: a FORK by construction
            drift = f"prev={prev} COMPACTED keep-prev={r.keep - prev}"
        elif r.keep < prev:
            drift = f"prev={prev} DRIFT keep-prev={r.keep - prev}"
        else:
            drift = f"prev={prev} GAP keep-prev=+{r.keep - prev}"
        if r.routing is None:
            route = "routing=none"
        else:
            rows, want = len(r.routing.experts), r.input_len + len(r.output_ids) - 1 - r.routing.start
            route = f"routing start={r.routing.start} rows={rows}" + ("" if rows == want else f" (expected {want})")
            if prev is not None and r.keep == prev and r.routing.start != r.keep - 1:
                route += f" (start != keep-1={r.keep - 1})"
        parts = {
            "ep": f"ep={r.episode}",
            "t": f"t={r.turn}",
            "v": f"v={r.policy_version}",
            "in": f"in={r.input_len}",
            "keep": f"keep={r.keep}",
            "delta": f"delta={len(r.input_delta)}",
            "out": f"out={len(r.output_ids)}",
            "finish": f"finish={r.finish.value}",
            "reward": f"reward={r.reward:+.3g}",
            "tests": f"tests={r.tests_passed if r.tests_passed >= 0 else '–'}",
            "drift": f"| {drift}",
            "routing": f"| {route}",
            "timing": f"| sample={r.t_sample_s:.2f}s exec={r.t_exec_s:.2f}s",
        }
        head = " ".join(p for k, p in parts.items() if k in self.fields)
        lines = [escape("turn  " + head)]
        if r.action and "action" in self.fields:
            lines.append(f"      action: {_clip(r.action, self.max_text)}")
        if r.observation and "obs" in self.fields:
            lines.append(f"      obs:    {_clip(r.observation, self.max_text)}")
        tok = self._tokenizer()
        if tok is not None:
            try:
                lines.append(f"      text:   {_clip(tok.decode(r.output_ids), self.max_text)}")
            except Exception as exc:  # an id outside this tokenizer's vocab: show why, keep tailing
                lines.append(f"      text:   (cannot decode: {_clip(f'{type(exc).__name__}: {exc}', 200)})")
        return "\n".join(lines)


def _short(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (list, dict)):
        return _clip(json.dumps(v, default=str), 60)
    return str(v)


def to_json(msg: Message) -> dict:
    """A JSON-ready dict for one message (see the module docstring for the array rules)."""
    if msg.error is not None:
        return {
            "subject": msg.subject,
            "error": str(msg.error),
            "reason": msg.error.reason,
            "bytes": len(msg.data),
            "headers": dict(msg.headers),
        }
    m = wire.to_map(msg.record)  # type: ignore[arg-type]
    return {"subject": msg.subject, **{k: _jsonable(k, v) for k, v in m.items()}}


def _jsonable(key: str, v: Any) -> Any:
    if isinstance(v, dict) and {"dtype", "shape", "data"} <= v.keys():
        if key == "routing":
            return {"start": v.get("start"), "dtype": v["dtype"], "shape": v["shape"]}
        return np.frombuffer(v["data"], dtype=DTYPES[v["dtype"]]).tolist()
    if isinstance(v, bytes):
        return v.hex()
    if isinstance(v, dict):
        return {str(k): _jsonable(str(k), x) for k, x in v.items()}
    if isinstance(v, list):
        return [_jsonable("", x) for x in v]
    if isinstance(v, float) and not np.isfinite(v):
        return str(v)
    return v


_STYLES = {"turn": "bold", "start": "green", "end": "cyan", "!": "bold red", "metrics": "dim", "policy": "magenta"}


def _styled(line: str) -> Text:
    text = Text(line)
    head = line.split(" ", 1)[0]
    if head in _STYLES:
        text.stylize(_STYLES[head], 0, len(head))
    for marker, style in (("DRIFT", "bold yellow"), ("GAP", "bold yellow"), ("(expected", "bold red")):
        start = line.find(marker)
        if start >= 0:
            text.stylize(style, start, start + len(marker))
    return text


class _PipeConsole(Console):
    """A reader that leaves (``tail | head``) is the caller's BrokenPipeError, not rich's ``SystemExit(1)``:
    the command exits quietly with 141 as ``status | head`` does, and no task group wraps an exit."""

    def on_broken_pipe(self) -> None:
        raise BrokenPipeError(32, "the reader closed tail's output")


def select(obj: dict, fields: tuple[str, ...]) -> dict:
    """``--json --fields``: keep ``subject``, ``kind`` and the named keys."""
    if not fields:
        return obj
    return {k: v for k, v in obj.items() if k in ("subject", "kind") or k in fields}


async def tail(config: TailConfig, out: IO[str], err: IO[str]) -> None:
    """Print records until cancelled. Only records go to ``out``; the header goes to ``err``."""
    subject = config.subject
    if config.episode and subject == "t1.traj.>":
        subject = traj_subject(config.episode)
    fmt = Formatter(text=config.text and not config.json, fields=config.fields, max_text=config.max_text)
    # rich colours only a terminal (and honours NO_COLOR); markup and highlighting off: the text is data
    console = _PipeConsole(file=out, highlight=False, markup=False, emoji=False, soft_wrap=True)
    nats = NatsConfig(url=config.nats_url, creds=config.nats_creds)
    async with NatsTransport(config=nats) as t, t.subscribe(subject, include_malformed=True) as messages:
        print(f"# tailing {subject} on {redact(config.nats_url)} (Ctrl-C to stop)", file=err, flush=True)
        async for msg in messages:
            ep = getattr(msg.record, "episode", None)
            if config.episode and ep is not None and ep != config.episode:
                continue
            if config.json:
                print(json.dumps(select(to_json(msg), config.fields)), file=out, flush=True)
                continue
            for line in fmt.line(msg).split("\n"):
                console.print(_styled(line))
            out.flush()
