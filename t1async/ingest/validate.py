"""Ingest validation: everything a training step relies on, checked per record before it is journaled.

``wire.decode`` checks that a record is well formed; this checks that it fits *this learner's model*, so that
``Trainer.step`` can assume valid input (design §3, §7). Vectorised over each record's arrays:

    token ids        input_delta and output_ids < vocab_size                     reason ``token_range``
    logprobs         every output logprob finite (a null SGLang logprob is NaN)  reason ``logprob``
    routing shape    [rows, n_layers, top_k]                                     reason ``routing_shape``
    expert range     every expert id < n_experts                                 reason ``expert_range``
    expert repeats   no (token, layer) names one expert twice                    reason ``expert_repeat``
                     (a layer all 0 over the trace is a broken capture: the assembler drops that layer)
    length           input_len + len(output_ids) <= max_seq_len                  reason ``length``
    policy version   no token sampled by a version newer than the learner's      reason ``policy_version``
                     (a learner resumed from an older checkpoint than the samplers served)

A failure is a ``WireError`` (the sender's fault) whose ``reason`` is the dead-letter subject's last token
(``t1.dead.<reason>``) and whose message names the episode, turn, field and the offending values. A trace
with the wrong *row count* is not a failure here: the assembler rejects that trace alone and the turn
routes freely, counted (design §6).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from t1async.ingest.routing import zero_layers
from t1async.protocol import wire
from t1async.protocol.errors import DeadReason, WireError

REASONS = ("token_range", "logprob", "routing_shape", "expert_range", "expert_repeat", "length", "policy_version")


@dataclass(frozen=True)
class ModelLimits:
    """What a record must fit: the learner model's sizes."""

    vocab_size: int
    n_layers: int
    top_k: int
    n_experts: int
    max_seq_len: int

    @classmethod
    def of(cls, cfg: object) -> ModelLimits:
        """From a ``MoEConfig`` (or anything with the same attributes)."""
        return cls(cfg.vocab_size, cfg.n_layers, cfg.top_k, cfg.n_experts, cfg.max_seq_len)  # type: ignore[attr-defined]


def _fail(rec: wire.TurnRecord, field: str, reason: DeadReason, what: str) -> WireError:
    return WireError(f"turn {rec.episode}#{rec.turn}: {field} {what}", field=field, reason=reason)


def check_record(rec: wire.Record, limits: ModelLimits, policy_version: int | None = None) -> None:
    """Raise ``WireError`` if a training step could not use ``rec``. Only turns carry what a step reads.
    ``policy_version``: the learner's policy version (no turn may claim a newer one)."""
    if isinstance(rec, wire.TurnRecord):
        check_turn(rec, limits, policy_version)


def check_turn(rec: wire.TurnRecord, lim: ModelLimits, policy_version: int | None = None) -> None:
    out, delta = rec.output_ids, rec.input_delta
    for name, ids in (("output_ids", out), ("input_delta", delta)):
        if len(ids) and int(ids.max()) >= lim.vocab_size:
            bad = int(np.argmax(ids >= lim.vocab_size))
            raise _fail(
                rec,
                name,
                DeadReason.TOKEN_RANGE,
                f"[{bad}] = {int(ids[bad])} is not below the model's vocab_size "
                f"{lim.vocab_size} (max {int(ids.max())}): was it sampled by another model or tokenizer?",
            )
    lps = rec.output_logprobs
    finite = np.isfinite(lps)
    if not finite.all():
        bad = int(np.argmin(finite))
        raise _fail(
            rec,
            "output_logprobs",
            DeadReason.LOGPROB,
            f"[{bad}] = {float(lps[bad])} is not finite "
            f"({int((~finite).sum())} of {len(lps)}): the sampler returned no logprob for that token",
        )
    n = rec.input_len + len(out)
    if n > lim.max_seq_len:
        raise _fail(
            rec,
            "input_len",
            DeadReason.LENGTH,
            f"{rec.input_len} + {len(out)} outputs = {n} tokens exceeds the model's max_seq_len {lim.max_seq_len}",
        )
    if policy_version is not None:
        ov = getattr(rec, "output_versions", None)
        newest = max(rec.policy_version, int(ov.max()) if ov is not None and len(ov) else 0)
        if newest > policy_version:
            raise _fail(
                rec,
                "policy_version",
                DeadReason.POLICY_VERSION,
                f"{newest} is newer than the learner's version {policy_version}: "
                "the samplers served weights this learner never had (was it resumed from an older checkpoint?)",
            )
    if rec.routing is not None:
        check_routing(rec, rec.routing.experts, lim)


def check_routing(rec: wire.TurnRecord, ex: np.ndarray, lim: ModelLimits) -> None:
    if ex.ndim != 3 or tuple(ex.shape[1:]) != (lim.n_layers, lim.top_k):
        raise _fail(
            rec,
            "routing",
            DeadReason.ROUTING_SHAPE,
            f"has shape {list(ex.shape)}, expected [rows, n_layers "
            f"{lim.n_layers}, top_k {lim.top_k}]: was it routed by another model?",
        )
    if not ex.size:
        return
    hi = int(ex.max())
    if hi >= lim.n_experts:
        t, layer, _ = (int(v) for v in np.argwhere(ex >= lim.n_experts)[0])
        raise _fail(
            rec,
            "routing",
            DeadReason.EXPERT_RANGE,
            f"row {t} layer {layer} holds expert {hi}, not below the model's n_experts {lim.n_experts}",
        )
    if lim.top_k > 1:
        s = np.sort(ex, axis=-1)
        dup = (s[..., 1:] == s[..., :-1]).any(-1)
        dup[:, zero_layers(ex)] = False  # an all-zero layer is a broken capture the assembler drops (design §6)
        if dup.any():
            t, layer = (int(v) for v in np.argwhere(dup)[0])
            raise _fail(
                rec,
                "routing",
                DeadReason.EXPERT_REPEAT,
                f"row {t} layer {layer} names an expert twice: "
                f"{ex[t, layer].tolist()} (a top-k picks k distinct experts)",
            )
