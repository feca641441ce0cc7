"""``cluster tail``: print every record on a subject as it goes by (core subscription: live only).

Human lines (default) show, for a turn: episode, turn, policy version, token counts (input_len, keep, len of
input_delta, output), finish, reward, tests_passed, the drift view (``keep`` against the sequence length
this tail saw after the episode's previous turn, and the routing trace's start/rows against ``keep - 1``),
timings, the action and observation, and the decoded output when a tokenizer is available.
``--json`` prints one object per record: the wire map with token/logprob arrays as lists, ``routing``
summarised as ``{start, dtype, shape}`` and bytes as hex. A malformed message prints one ``!`` line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import IO, Any

import numpy as np

from t1async import wire
from t1async.transport import Message, NatsTransport, traj_subject
from t1async.transport.base import HDR_DEAD_ERROR, HDR_DEAD_SUBJECT

_CLIP = 160


@dataclass(frozen=True)
class TailConfig:
    nats_url: str
    subject: str = "t1.traj.>"
    json: bool = False
    episode: str | None = None
    text: bool = True  # decode output ids when a tokenizer loads


def _clip(s: str, n: int = _CLIP) -> str:
    s = s.replace("\n", "\\n")
    return s if len(s) <= n else s[: n - 3] + "..."


class Formatter:
    """Turns messages into lines; remembers each episode's sequence length to show drift."""

    def __init__(self, *, text: bool = True):
        self._seq_len: dict[str, int] = {}
        self._want_text = text
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
            return f"! malformed on {msg.subject}: [{msg.error.reason}] {_clip(str(msg.error), 300)} ({len(msg.data)} bytes){extra}"
        rec = msg.record
        if isinstance(rec, wire.TurnRecord):
            return self._turn(rec)
        if isinstance(rec, wire.StartRecord):
            self._seq_len.pop(rec.episode, None)
            return f"start ep={rec.episode} actor={rec.actor} task={rec.task} max_turns={rec.max_turns}"
        if isinstance(rec, wire.EndRecord):
            return (f"end   ep={rec.episode} turns={rec.turns} reason={rec.reason.value} "
                    f"tests={rec.tests_passed}/{rec.tests_total} resolved={rec.resolved}"
                    + (f" detail={_clip(rec.detail)}" if rec.detail else ""))  # fmt: skip
        if isinstance(rec, wire.MetricsRecord):
            vals = " ".join(f"{k}={_short(v)}" for k, v in sorted(rec.values.items()))
            return f"metrics {rec.component} step={rec.step} v={rec.version} {vals}"
        if isinstance(rec, wire.PolicyRecord):
            return f"policy v={rec.version} step={rec.step} weights={rec.weights}"
        fields = " ".join(f"{k}={v}" for k, v in wire.to_map(rec).items() if k not in ("v", "kind"))  # type: ignore[arg-type]
        return f"{rec.kind} on {msg.subject}: {fields}"  # type: ignore[union-attr]

    def _turn(self, r: wire.TurnRecord) -> str:
        prev = self._seq_len.get(r.episode)
        self._seq_len[r.episode] = r.input_len + len(r.output_ids)
        if prev is None:
            drift = "prev=?"
        elif r.keep == prev:
            drift = f"prev={prev} clean"
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
        lines = [
            f"turn  ep={r.episode} t={r.turn} v={r.policy_version} in={r.input_len} keep={r.keep} "
            f"delta={len(r.input_delta)} out={len(r.output_ids)} finish={r.finish.value} reward={r.reward:+.3g} "
            f"tests={r.tests_passed} | {drift} | {route} | sample={r.t_sample_s:.2f}s exec={r.t_exec_s:.2f}s"
        ]
        if r.action:
            lines.append(f"      action: {_clip(r.action)}")
        if r.observation:
            lines.append(f"      obs:    {_clip(r.observation)}")
        tok = self._tokenizer()
        if tok is not None:
            try:
                lines.append(f"      text:   {_clip(tok.decode(r.output_ids))}")
            except Exception as exc:  # an id outside this tokenizer's vocab: show why, keep tailing
                lines.append(f"      text:   (cannot decode: {type(exc).__name__}: {exc})")
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
        return {"subject": msg.subject, "error": str(msg.error), "reason": msg.error.reason, "bytes": len(msg.data),
                "headers": dict(msg.headers)}  # fmt: skip
    m = wire.to_map(msg.record)  # type: ignore[arg-type]
    return {"subject": msg.subject, **{k: _jsonable(k, v) for k, v in m.items()}}


def _jsonable(key: str, v: Any) -> Any:
    if isinstance(v, dict) and {"dtype", "shape", "data"} <= v.keys():
        if key == "routing":
            return {"start": v.get("start"), "dtype": v["dtype"], "shape": v["shape"]}
        return np.frombuffer(v["data"], dtype=wire._DTYPES[v["dtype"]]).tolist()
    if isinstance(v, bytes):
        return v.hex()
    if isinstance(v, dict):
        return {str(k): _jsonable(str(k), x) for k, x in v.items()}
    if isinstance(v, list):
        return [_jsonable("", x) for x in v]
    if isinstance(v, float) and not np.isfinite(v):
        return str(v)
    return v


async def tail(config: TailConfig, out: IO[str], err: IO[str]) -> None:
    """Print records until cancelled."""
    subject = config.subject
    if config.episode and subject == "t1.traj.>":
        subject = traj_subject(config.episode)
    fmt = Formatter(text=config.text and not config.json)
    async with NatsTransport(config.nats_url) as t, t.subscribe(subject, include_malformed=True) as messages:
        print(f"# tailing {subject} on {config.nats_url} (Ctrl-C to stop)", file=err, flush=True)
        async for msg in messages:
            ep = getattr(msg.record, "episode", None)
            if config.episode and ep is not None and ep != config.episode:
                continue
            line = json.dumps(to_json(msg)) if config.json else fmt.line(msg)
            print(line, file=out, flush=True)
