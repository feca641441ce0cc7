"""The closed sets of strings that became StrEnums keep their values: they are on the wire (dead-letter
subjects and headers), in files (the poison book, cluster.json) and in logs, which outlive a rename."""

from __future__ import annotations

import json

from t1async.protocol.errors import DeadReason, WireError
from t1async.transport.base import HDR_DEAD_REASON, dead_letter


def test_dead_reasons_keep_their_values():
    assert {r.name: r.value for r in DeadReason} == {
        "INVALID": "invalid",
        "FIELD": "field",
        "MISSING": "missing",
        "SCHEMA": "schema",
        "VERSION": "version",
        "POLICY_VERSION": "policy_version",
        "KIND": "kind",
        "MSGPACK": "msgpack",
        "CHUNK": "chunk",
        "TOKEN_RANGE": "token_range",
        "LOGPROB": "logprob",
        "ROUTING_SHAPE": "routing_shape",
        "EXPERT_RANGE": "expert_range",
        "EXPERT_REPEAT": "expert_repeat",
        "LENGTH": "length",
        "ASSEMBLY": "assembly",
        "TRAIN_STEP": "train_step",
    }


def test_a_dead_reason_reads_as_its_plain_string():
    subject, headers, _ = dead_letter("t1.traj.x", b"xy", WireError("bad", reason=DeadReason.TOKEN_RANGE), 1 << 20)
    assert subject == "t1.dead.token_range" and headers[HDR_DEAD_REASON] == "token_range"
    assert json.dumps({"reason": DeadReason.TRAIN_STEP}) == '{"reason": "train_step"}'
    assert f"{DeadReason.MSGPACK}" == "msgpack" and DeadReason.MSGPACK == "msgpack"
    assert dead_letter("s", b"", WireError("bad"), 1 << 20)[0] == "t1.dead.invalid"


def test_cluster_statuses_keep_their_values(tmp_path):
    from t1async.cluster.state import ClusterState, ProcStatus, RunStatus

    assert [s.value for s in RunStatus] == ["starting", "running", "stopping", "stopped"]
    assert [s.value for s in ProcStatus] == ["alive", "gone"]
    st = ClusterState(run_dir=str(tmp_path), status=RunStatus.STOPPING)
    st.save()
    assert json.loads((tmp_path / "cluster.json").read_text())["status"] == "stopping"
    assert ClusterState.load(tmp_path).status is RunStatus.STOPPING
    assert f"status:   {RunStatus.RUNNING}  {ProcStatus.GONE}" == "status:   running  gone"
