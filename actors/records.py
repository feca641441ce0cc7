"""Turning the agent loop's TurnResults into wire records: ``keep``/``input_delta``/digest and routing."""

from __future__ import annotations

import numpy as np

from sandbox_agent.agent.types import TurnResult
from t1async.protocol.sampling import common_prefix_len
from t1async.protocol.wire import Finish, Routing, TurnRecord, digest_ids


class TurnEncoder:
    """Keeps the sequence the learner will have assembled and encodes each turn against it."""

    def __init__(self, episode: str) -> None:
        self.episode = episode
        self.seq = np.zeros(0, dtype=np.int32)  # S_k: all inputs and outputs so far
        self.turns = 0  # turns encoded: the next record's ``turn`` (an empty output is no turn, see ``skip``)
        self.carried_reward = 0.0  # reward of skipped outputs, added to the next record (or the end)

    def skip(self, t: TurnResult) -> None:
        """An output with no tokens is not streamed (the wire has no empty turn): its reward goes to the next
        record, and its routing rows are asked again by the next sample (``agent._next_input``)."""
        self.carried_reward += float(t.reward)

    def encode(self, t: TurnResult) -> TurnRecord:
        inp = np.asarray(t.input_ids, dtype=np.int32)
        keep = common_prefix_len(inp, self.seq)
        # per-token versions only when a weight update split the turn; policy_version is the oldest (design §7)
        versions, policy_version = None, int(t.policy_version)
        ov = getattr(t, "output_versions", None)
        if ov is not None and len(ov) == len(t.output_ids) and len(ov):
            policy_version = int(np.min(ov))
            versions = np.asarray(ov, dtype=np.int32) if np.ptp(ov) > 0 else None
        routing = None
        if t.routing is not None:
            routing = Routing(int(t.routing_start), np.asarray(t.routing))
        rec = TurnRecord(
            episode=self.episode,
            turn=self.turns,
            keep=keep,
            policy_version=policy_version,
            input_delta=inp[keep:].copy(),
            input_len=len(inp),
            input_digest=digest_ids(inp),
            output_ids=np.asarray(t.output_ids, dtype=np.int32),
            output_logprobs=np.asarray(t.logprobs, dtype=np.float32),
            finish=Finish(t.finish if t.finish in ("stop", "length", "abort") else "stop"),
            routing=routing,
            reward=float(t.reward) + self.carried_reward,
            tests_passed=-1 if t.tests_passed is None else int(t.tests_passed),
            t_sample_s=float(t.t_sample_s),
            t_exec_s=float(t.t_exec_s),
            action=t.action_text[:2000] if t.action_kind == "bash" else t.action_kind,
            observation=t.observation[:2000],
            compacted=bool(t.compacted),
            output_versions=versions,
        )
        self.seq = np.concatenate([inp, rec.output_ids])
        self.turns += 1
        self.carried_reward = 0.0
        return rec
