"""Wire records: round-trips, validation that names the field, and hostile bytes."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from t1async.protocol import wire
from t1async.protocol.errors import WireError

ids = st.lists(st.integers(0, 2**31 - 1), max_size=40).map(lambda x: np.asarray(x, dtype=np.int32))
text = st.text(max_size=20)
name = st.text(min_size=1, max_size=20)
finite = st.floats(allow_nan=False, allow_infinity=False, width=32)


@st.composite
def turns(draw):
    n_out = draw(st.integers(1, 30))
    out = np.asarray(draw(st.lists(st.integers(0, 50_000), min_size=n_out, max_size=n_out)), dtype=np.int32)
    lps = np.asarray(draw(st.lists(finite, min_size=n_out, max_size=n_out)), dtype=np.float32)
    delta = draw(ids)
    keep = draw(st.integers(0, 1000))
    routing = None
    if draw(st.booleans()):
        layers, topk, rows = draw(st.integers(1, 4)), draw(st.integers(1, 3)), draw(st.integers(0, 20))
        dt = draw(st.sampled_from([np.uint8, np.uint16]))
        routing = wire.Routing(
            draw(st.integers(0, 100)),
            np.asarray(
                draw(st.lists(st.integers(0, 255), min_size=rows * layers * topk, max_size=rows * layers * topk)),
                dtype=dt,
            ).reshape(rows, layers, topk),
        )
    if keep + len(delta) == 0:
        keep = 1
    version = draw(st.integers(0, 10**6))
    versions = None
    if draw(st.booleans()):  # a weight update landed mid-turn: per-token versions, the oldest is policy_version
        steps = draw(st.lists(st.integers(0, 3), min_size=n_out, max_size=n_out))
        versions = version + np.sort(np.asarray(steps, np.int32))
        versions -= versions.min() - version
    return wire.TurnRecord(
        output_versions=versions,
        episode=draw(name),
        turn=draw(st.integers(0, 10_000)),
        policy_version=version,
        keep=keep,
        input_delta=delta,
        input_len=keep + len(delta),
        input_digest=draw(st.binary(min_size=16, max_size=16)),
        output_ids=out,
        output_logprobs=lps,
        finish=draw(st.sampled_from(list(wire.Finish))),
        routing=routing,
        reward=draw(st.floats(-100, 100)),
        tests_passed=draw(st.integers(-1, 50)),
        t_sample_s=draw(st.floats(0, 1e4)),
        t_exec_s=draw(st.floats(0, 1e4)),
        action=draw(text),
        observation=draw(text),
        last=draw(st.booleans()),
    )


records = st.one_of(
    turns(),
    st.builds(wire.StartRecord, name, name, name, st.integers(1, 10**6), st.floats(0, 2e9)),
    st.builds(
        lambda e, n, r, p, extra, res, d, u: wire.EndRecord(e, n, r, p, p + extra, res, d, u),
        name,
        st.integers(0, 10**4),
        st.sampled_from(list(wire.EndReason)),
        st.integers(0, 100),
        st.integers(0, 100),
        st.booleans(),
        text,
        st.floats(-100, 100),
    ),
    st.builds(wire.PolicyRecord, st.integers(0, 10**6), st.integers(0, 10**6), name),
    st.builds(wire.CreditRequest, name, name, st.integers(1, 64), st.integers(-1, 1000)),
    st.builds(wire.CreditGrant, st.integers(0, 64), st.integers(0, 10**6), st.floats(0, 1e4), name),
    st.builds(
        wire.MetricsRecord,
        name,
        st.integers(0, 10**6),
        st.integers(0, 10**6),
        st.dictionaries(
            st.sampled_from(["loss", "reward_mean", "drift", "staleness_hist"]),
            st.one_of(st.integers(0, 9), finite, st.lists(st.integers(0, 9), max_size=4)),
        ),
    ),
)


@given(records)
@settings(max_examples=300, deadline=None)
def test_every_record_round_trips(rec):
    back = wire.decode(wire.encode(rec))
    assert wire.records_equal(rec, back), (rec, back)


@given(st.binary(max_size=200))
@settings(max_examples=500, deadline=None)
def test_arbitrary_bytes_raise_only_wire_error(data):
    try:
        wire.decode(data)
    except WireError as exc:
        assert str(exc)


@given(records, st.data())
@settings(max_examples=200, deadline=None)
def test_mutated_maps_raise_only_wire_error(rec, data):
    m = wire.to_map(rec)
    key = data.draw(st.sampled_from(sorted(m)))
    m[key] = data.draw(
        st.one_of(
            st.none(),
            st.integers(-5, 5),
            st.text(max_size=3),
            st.binary(max_size=3),
            st.just([1, "x"]),
            st.just({"dtype": "i4"}),
        )
    )
    try:
        wire.decode(msgpack.packb(m, use_bin_type=True))
    except WireError as exc:
        assert exc.reason and str(exc)


def _turn(**over):
    base = dict(
        episode="e1",
        turn=0,
        policy_version=3,
        keep=0,
        input_delta=np.arange(5, dtype=np.int32),
        input_len=5,
        input_digest=wire.digest_ids(np.arange(5)),
        output_ids=np.array([7, 8], np.int32),
        output_logprobs=np.array([-0.5, -1.0], np.float32),
        finish=wire.Finish.STOP,
        routing=wire.Routing(0, np.zeros((6, 2, 2), np.uint8)),
        reward=0.0,
        tests_passed=-1,
        t_sample_s=0.1,
        t_exec_s=0.2,
    )
    base.update(over)
    return wire.TurnRecord(**base)


def test_plain_msgpack_reader_sees_design_field_names():
    m = msgpack.unpackb(wire.encode(_turn()), raw=False)
    for k in (
        "v",
        "kind",
        "episode",
        "turn",
        "policy_version",
        "keep",
        "input_delta",
        "input_len",
        "input_digest",
        "output_ids",
        "output_logprobs",
        "finish",
        "routing",
        "reward",
        "tests_passed",
        "t_sample_s",
        "t_exec_s",
    ):
        assert k in m
    assert m["kind"] == "turn" and m["routing"]["dtype"] == "u1" and m["routing"]["shape"] == [6, 2, 2]
    assert np.frombuffer(m["output_ids"]["data"], "<i4").tolist() == [7, 8]


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda m: m.pop("episode"), "episode"),
        (lambda m: m.__setitem__("input_len", 99), "input_len"),
        (lambda m: m["output_logprobs"].__setitem__("shape", [3]), "output_logprobs"),
        (lambda m: m.__setitem__("finish", "exploded"), "finish"),
        (lambda m: m["routing"].__setitem__("dtype", "f4"), "routing.dtype"),
        (lambda m: m.__setitem__("input_digest", b"short"), "input_digest"),
        (lambda m: m.__setitem__("turn", -1), "turn"),
        (lambda m: m.__setitem__("reward", float("nan")), "reward"),
    ],
)
def test_errors_name_the_field(mutate, field):
    m = wire.to_map(_turn())
    mutate(m)
    with pytest.raises(WireError) as info:
        wire.decode(msgpack.packb(m, use_bin_type=True))
    assert info.value.field.startswith(field.split(".")[0]) and field in str(info.value)


def test_output_versions_are_optional_per_token_and_checked():
    plain = msgpack.unpackb(wire.encode(_turn()), raw=False)
    assert "output_versions" not in plain and wire.decode(wire.encode(_turn())).output_versions is None
    rec = _turn(output_versions=np.array([3, 4], np.int32))
    m = msgpack.unpackb(wire.encode(rec), raw=False)
    assert m["output_versions"]["dtype"] == "i4"
    assert np.frombuffer(m["output_versions"]["data"], "<i4").tolist() == [3, 4]
    assert wire.decode(wire.encode(rec)).output_versions.tolist() == [3, 4]
    for versions, what in (
        ([3], "has 1 values for 2 output_ids"),
        ([4, 5], "oldest version 4 != policy_version 3"),
        ([2, 3], "oldest version 2 != policy_version 3"),
    ):
        with pytest.raises(WireError, match=what) as info:
            wire.decode(wire.encode(_turn(output_versions=np.array(versions, np.int32))))
        assert info.value.field == "output_versions"
    with pytest.raises(WireError, match="output_versions.dtype"):
        m["output_versions"]["dtype"] = "f4"
        wire.decode(msgpack.packb(m, use_bin_type=True))


def test_last_is_an_optional_bool_and_old_records_without_it_decode_as_not_last():
    assert wire.decode(wire.encode(_turn(last=True))).last is True
    old = wire.to_map(_turn())
    del old["last"]  # an actor from before the field
    assert wire.decode(msgpack.packb(old, use_bin_type=True)).last is False
    old["last"] = 1
    with pytest.raises(WireError, match="turn.last: expected bool"):
        wire.decode(msgpack.packb(old, use_bin_type=True))


def test_ext_types_and_wrong_versions_are_refused():
    with pytest.raises(WireError, match="ext type"):
        wire.decode(msgpack.packb({"v": 1, "kind": "start", "x": msgpack.ExtType(1, b"x")}))
    with pytest.raises(WireError) as info:
        wire.decode(msgpack.packb({"v": 99, "kind": "start"}))
    assert info.value.reason == "version"


def test_digest_depends_on_every_id():
    a = wire.digest_ids([1, 2, 3])
    assert a == wire.digest_ids(np.array([1, 2, 3], np.int64)) and a != wire.digest_ids([1, 2, 4]) and len(a) == 16
