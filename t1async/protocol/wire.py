"""Wire records: frozen dataclasses, and the msgpack codec that is the only code in t1async that knows bytes.

Every payload is a msgpack map with ``v`` (schema version) and ``kind`` (design §3). Arrays are maps
``{"dtype": "i4", "shape": [...], "data": bin}`` holding little-endian raw values, so any msgpack decoder in
any language can read them: no pickle, no ext types. ``decode`` validates every field and raises
``WireError`` whose message names the field and what was wrong, and whose ``reason`` is the short token for
the dead-letter subject ``t1.dead.<reason>``. Arbitrary bytes never raise anything else. The array codec and
the typed field reader are fields.py.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from enum import Enum, StrEnum
from typing import Any

import msgpack
import numpy as np

from t1async.protocol.errors import DeadReason, WireError
from t1async.protocol.fields import Fields as _Fields
from t1async.protocol.fields import encode_array as _enc_array

SCHEMA_VERSION = 1


class Finish(StrEnum):
    """How a sample ended: a sampler's ``Generation.finish`` and the turn record's, one type. A StrEnum, so it
    prints and formats as its value ("stop") and equals it."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


class EndReason(StrEnum):
    """Why an episode ended: the agent's stop reason (sandbox_agent.agent.loop) and the end record's, one type.
    A StrEnum, so it prints and formats as its value ("solved")."""

    SOLVED = "solved"
    MAX_TURNS = "max_turns"
    CONTEXT = "context"
    TIMEOUT = "timeout"
    ERROR = "error"
    ABORTED = "aborted"


def digest_ids(ids: np.ndarray | list[int]) -> bytes:
    """The ``input_digest`` of a token sequence: the first 16 bytes of SHA-256 over its little-endian int32
    bytes (SHA-256 rather than BLAKE2: CPUs with SHA extensions hash it ~4x faster, and ingest hashes every
    token once)."""
    arr = np.ascontiguousarray(np.asarray(ids, dtype="<i4"))
    return hashlib.sha256(arr.tobytes()).digest()[:16]


# --------------------------------------------------------------------------------------------- records


@dataclass(frozen=True)
class Routing:
    """The routed experts of positions ``[start, start + len(experts))``: ``experts`` is [tokens, layers, topk]."""

    start: int
    experts: np.ndarray  # u1 when experts <= 256, else u2

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Routing) and self.start == other.start and _arr_eq(self.experts, other.experts)


@dataclass(frozen=True, eq=False)
class StartRecord:
    episode: str
    actor: str
    task: str
    max_turns: int
    created_at: float
    kind = "start"


@dataclass(frozen=True, eq=False)
class TurnRecord:
    episode: str
    turn: int
    policy_version: int
    keep: int
    input_delta: np.ndarray  # int32
    input_len: int
    input_digest: bytes
    output_ids: np.ndarray  # int32
    output_logprobs: np.ndarray  # float32
    finish: Finish
    routing: Routing | None
    reward: float
    tests_passed: int  # -1 when the verifier did not run this turn
    t_sample_s: float
    t_exec_s: float
    action: str = ""  # the parsed action, for humans (tail); never trained on
    observation: str = ""
    compacted: bool = False  # the context policy compacted this turn's input: a FORK by construction (design §12)
    # int32 [len(output_ids)]: the policy version that produced each output token (a weight update may land
    # mid-turn, design §7); ``policy_version`` is then the oldest of them. None: all are ``policy_version``.
    output_versions: np.ndarray | None = None
    # the agent stopped after this turn: it is the episode's last (the end record follows). The learner then
    # trains it as done (no value bootstrap) even when it is cut before the end record arrives. Records
    # without the field (older actors) decode as False.
    last: bool = False
    kind = "turn"


@dataclass(frozen=True, eq=False)
class EndRecord:
    episode: str
    turns: int
    reason: EndReason
    tests_passed: int
    tests_total: int
    resolved: bool
    detail: str = ""
    # the change in tests passed that no turn could carry (the episode stopped mid-sample: wall time, a
    # sampler failure); the learner adds it to the last turn's reward, so rewards still sum to tests_passed
    unstreamed_reward: float = 0.0
    compactions: int = 0  # inputs the context policy compacted in this episode (design §12)
    kind = "end"


@dataclass(frozen=True, eq=False)
class PolicyRecord:
    policy_version: int
    step: int
    weights: str  # a path or URI the samplers can load
    kind = "policy"


@dataclass(frozen=True, eq=False)
class CreditRequest:
    actor: str
    episode: str
    n: int = 1
    turn: int = -1  # the turn this credit is for; a retried request for the same turn gets the same grant
    kind = "credit_request"


@dataclass(frozen=True, eq=False)
class CreditGrant:
    granted: int
    policy_version: int
    lease_s: float
    grant_id: str
    kind = "credit_grant"


@dataclass(frozen=True, eq=False)
class Heartbeat:
    """An actor's sign of life on ``t1.actor.<actor>`` (core, every few seconds): the learner grants credits to
    live actors and closes a silent actor's episodes as ``aborted`` (design §7)."""

    actor: str
    sent_at: float  # the actor's wall clock (for humans; liveness uses the learner's receive time)
    # when this actor process started, on the same clock as its episodes' ``StartRecord.created_at``: an open
    # episode created before it belongs to an earlier process of this actor id, which is gone (0: not sent)
    started_at: float = 0.0
    kind = "heartbeat"


@dataclass(frozen=True, eq=False)
class MetricsRecord:
    component: str
    step: int
    policy_version: int
    values: Mapping[str, Any] = field(default_factory=dict)  # flattened into the top-level map on the wire
    kind = "metrics"


_OPTIONAL_ABSENT = {"output_versions"}  # optional fields left off the wire when None

Record = StartRecord | TurnRecord | EndRecord | PolicyRecord | CreditRequest | CreditGrant | MetricsRecord | Heartbeat
_KINDS: dict[str, type] = {
    c.kind: c
    for c in (StartRecord, TurnRecord, EndRecord, PolicyRecord, CreditRequest, CreditGrant, MetricsRecord, Heartbeat)
}


def _arr_eq(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        a, b = np.asarray(a), np.asarray(b)
        return a.dtype == b.dtype and a.shape == b.shape and bool(np.array_equal(a, b, equal_nan=a.dtype.kind == "f"))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def records_equal(a: Record, b: Record) -> bool:
    """Field-by-field equality that understands numpy arrays (records hold arrays, so ``==`` is not defined)."""
    return type(a) is type(b) and all(_arr_eq(getattr(a, f.name), getattr(b, f.name)) for f in fields(a))


# --------------------------------------------------------------------------------------------- encode


def to_map(record: Record) -> dict:
    """The plain map a record becomes on the wire (before msgpack)."""
    m: dict[str, Any] = {"v": SCHEMA_VERSION, "kind": record.kind}
    for f in fields(record):
        val = getattr(record, f.name)
        if isinstance(val, Enum):
            val = val.value
        elif isinstance(val, np.ndarray):
            val = _enc_array(val)
        elif isinstance(val, Routing):
            arr = _enc_array(val.experts)
            val = {"start": val.start, **arr}
        elif f.name == "values":
            m.update(val)
            continue
        elif val is None and f.name in _OPTIONAL_ABSENT:
            continue
        m[f.name] = val
    return m


def encode(record: Record) -> bytes:
    return msgpack.packb(to_map(record), use_bin_type=True)


def encode_map(m: Mapping[str, Any]) -> bytes:
    """msgpack of a plain map whose numpy arrays become array maps: the payload of a dead letter for
    something that is not a record (a segment a training step failed on)."""
    return msgpack.packb(
        {k: _enc_array(v) if isinstance(v, np.ndarray) else v for k, v in m.items()}, use_bin_type=True
    )


# --------------------------------------------------------------------------------------------- decode


def _decode_turn(f: _Fields) -> TurnRecord:
    delta = f.array("input_delta", dtypes=("i4",), ndim=1)
    out = f.array("output_ids", dtypes=("i4",), ndim=1)
    lps = f.array("output_logprobs", dtypes=("f4",), ndim=1)
    keep, input_len = f.int("keep"), f.int("input_len", lo=1)
    if input_len != keep + len(delta):
        raise f.error("input_len", f"{input_len} != keep {keep} + len(input_delta) {len(delta)}")
    if len(lps) != len(out):
        raise f.error("output_logprobs", f"has {len(lps)} values for {len(out)} output_ids")
    if len(out) == 0:
        raise f.error("output_ids", "is empty: a turn samples at least one token")
    if np.any(delta < 0) or np.any(out < 0):
        raise f.error("output_ids" if np.any(out < 0) else "input_delta", "holds a negative token id")
    digest = f.get("input_digest", bytes, what="bin")
    if len(digest) != 16:
        raise f.error("input_digest", f"expected 16 bytes, got {len(digest)}")
    versions = None
    if f.m.get("output_versions") is not None:
        versions = f.array("output_versions", dtypes=("i4",), ndim=1)
        if len(versions) != len(out):
            raise f.error("output_versions", f"has {len(versions)} values for {len(out)} output_ids")
        lo = int(versions.min())
        if lo != f.int("policy_version"):
            raise f.error(
                "output_versions",
                f"oldest version {lo} != policy_version {f.m['policy_version']} "
                "(policy_version must be the oldest per-token version)",
            )
    routing = None
    rm = f.get("routing", (dict, type(None)), default=None, what="routing map or nil")
    if rm is not None:
        start = rm.get("start")
        if not isinstance(start, int) or isinstance(start, bool) or start < 0:
            raise f.error("routing.start", f"expected a non-negative int, got {start!r}")
        routing = Routing(start, f.array("routing", rm, dtypes=("u1", "u2"), ndim=3))
    return TurnRecord(
        episode=f.str("episode"),
        turn=f.int("turn"),
        policy_version=f.int("policy_version"),
        keep=keep,
        input_delta=delta,
        input_len=input_len,
        input_digest=digest,
        output_ids=out,
        output_logprobs=lps,
        finish=f.enum("finish", Finish),
        routing=routing,
        reward=f.float("reward"),
        tests_passed=f.int("tests_passed", lo=-1),
        t_sample_s=f.float("t_sample_s"),
        t_exec_s=f.float("t_exec_s"),
        action=f.str("action", nonempty=False, default=""),
        observation=f.str("observation", nonempty=False, default=""),
        compacted=f.get("compacted", bool, default=False, what="bool"),
        output_versions=versions,
        last=f.get("last", bool, default=False, what="bool"),
    )


def _decode_metrics(f: _Fields) -> MetricsRecord:
    values = {k: v for k, v in f.m.items() if k not in ("v", "kind", "component", "step", "policy_version")}
    for k in values:
        if not isinstance(k, str):
            raise f.error(repr(k), "metric names must be strings")
    return MetricsRecord(
        component=f.str("component"), step=f.int("step"), policy_version=f.int("policy_version"), values=values
    )


def from_map(m: Any) -> Record:
    if not isinstance(m, dict):
        raise WireError(f"payload: expected a msgpack map, got {type(m).__name__}", reason=DeadReason.SCHEMA)
    v = m.get("v")
    if not isinstance(v, int) or isinstance(v, bool):
        raise WireError(f"envelope.v: expected int schema version, got {v!r}", field="v", reason=DeadReason.SCHEMA)
    if v != SCHEMA_VERSION:
        raise WireError(
            f"envelope.v: schema version {v} is not supported (this is {SCHEMA_VERSION})",
            field="v",
            reason=DeadReason.VERSION,
        )
    kind = m.get("kind")
    if not isinstance(kind, str) or kind not in _KINDS:
        raise WireError(f"envelope.kind: {kind!r} is not one of {sorted(_KINDS)}", field="kind", reason=DeadReason.KIND)
    f = _Fields(kind, m)
    if kind == "turn":
        return _decode_turn(f)
    if kind == "metrics":
        return _decode_metrics(f)
    if kind == "start":
        return StartRecord(
            f.str("episode"), f.str("actor"), f.str("task"), f.int("max_turns", lo=1), f.float("created_at")
        )
    if kind == "end":
        passed, total = f.int("tests_passed"), f.int("tests_total")
        if passed > total:
            raise f.error("tests_passed", f"{passed} > tests_total {total}")
        return EndRecord(
            f.str("episode"),
            f.int("turns"),
            f.enum("reason", EndReason),
            passed,
            total,
            f.get("resolved", bool, what="bool"),
            f.str("detail", nonempty=False, default=""),
            f.float("unstreamed_reward", default=0.0),
            f.int("compactions", default=0),
        )
    if kind == "policy":
        return PolicyRecord(f.int("policy_version"), f.int("step"), f.str("weights"))
    if kind == "heartbeat":
        return Heartbeat(f.str("actor"), f.float("sent_at"), f.float("started_at", default=0.0))
    if kind == "credit_request":
        return CreditRequest(
            f.str("actor"), f.str("episode"), f.int("n", lo=1, default=1), f.int("turn", lo=-1, default=-1)
        )
    return CreditGrant(f.int("granted"), f.int("policy_version"), f.float("lease_s"), f.str("grant_id"))


def _no_ext(code: int, data: bytes) -> Any:
    raise WireError(f"payload: msgpack ext type {code} is not allowed on the wire", reason=DeadReason.MSGPACK)


def decode(data: bytes | bytearray | memoryview) -> Record:
    """Decode and validate one payload. Raises ``WireError`` (and nothing else) on any bad input."""
    try:
        m = msgpack.unpackb(bytes(data), raw=False, strict_map_key=False, ext_hook=_no_ext)
    except WireError:
        raise
    except (
        ValueError,
        TypeError,
        msgpack.ExtraData,
        msgpack.FormatError,
        msgpack.StackError,
        UnicodeDecodeError,
    ) as exc:
        raise WireError(
            f"payload: not a valid msgpack message ({type(exc).__name__}: {exc})", reason=DeadReason.MSGPACK
        ) from exc
    except Exception as exc:  # msgpack raises a few undocumented types on hostile input
        raise WireError(
            f"payload: not a valid msgpack message ({type(exc).__name__}: {exc})", reason=DeadReason.MSGPACK
        ) from exc
    return from_map(m)
