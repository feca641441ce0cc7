"""TITO: drift check and repair at turn boundaries, episode assembly from an unordered, duplicated stream."""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from t1async.ingest import tito
from t1async.ingest.assembly import Assembler
from t1async.ingest.episode import AssemblerConfig
from t1async.ingest.tito import Boundary, Segment, check_input, classify, hash_update, new_hasher
from t1async.learner import ppo
from t1async.protocol import wire
from t1async.protocol.sampling import common_prefix_len
from t1async.testing.episodes import check_segments, episodes, make_episode


def _feed(asm: Assembler, records) -> list[Segment]:
    return [s for r in records for s in asm.feed(r)]


def _outputs(case) -> int:
    return sum(len(t.output_ids) for t in case.truth)


# ------------------------------------------------------------------------------------------ pure check


def test_classify_by_true_common_prefix():
    # S_k = 10 tokens, turn k's output starts at 6
    assert classify(10, 6, 10) is Boundary.CLEAN
    assert classify(10, 6, 6) is Boundary.REALIGN and classify(10, 6, 9) is Boundary.REALIGN
    assert classify(10, 6, 5) is Boundary.FORK and classify(10, 6, 0) is Boundary.FORK
    assert common_prefix_len(np.arange(5), np.arange(3)) == 3
    assert common_prefix_len(np.array([1, 2, 3]), np.array([1, 9, 3])) == 1
    assert common_prefix_len(np.zeros(0), np.arange(3)) == 0


def test_check_input_verifies_digest_and_finds_understated_keep():
    prev = np.arange(100, 110, dtype=np.int32)
    h = new_hasher()
    hash_update(h, prev)
    full = np.concatenate([prev, [7, 8]]).astype(np.int32)
    # the actor claimed keep = 4 but really shared all 10: still CLEAN, lcp 10
    chk = check_input(prev, 6, h, 4, full[4:], wire.digest_ids(full))
    assert chk.ok and chk.kind is Boundary.CLEAN and chk.lcp == 10 and chk.input_len == 12
    assert tito.hash_digest(chk.hasher) == wire.digest_ids(full)
    # the hasher of the open sequence is not consumed by a check
    assert tito.hash_digest(h) == wire.digest_ids(prev)
    bad = check_input(prev, 6, h, 10, np.array([7, 8], np.int32), wire.digest_ids([1, 2]))
    assert not bad.ok and "input_digest" in bad.reason
    over = check_input(prev, 6, h, 11, np.array([7], np.int32), wire.digest_ids(full))
    assert not over.ok and "exceeds" in over.reason


# ------------------------------------------------------------------------------------------ properties


@given(episodes())
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_invariant_every_drift_kind_any_delivery_order(case):
    asm = Assembler()
    segs = _feed(asm, case.records)
    counts = check_segments(case, segs)
    st_ = asm.stats()
    assert (st_.clean, st_.realign, st_.fork) == (
        case.expected["clean"],
        case.expected["realign"],
        case.expected["fork"],
    )
    assert st_.boundaries == len(case.truth) - 1 and st_.untrainable_turns == 0 and st_.conflicts == 0
    assert st_.tokens_dropped == case.dropped
    # every sampled token is trained exactly once, except those a REALIGN dropped
    assert counts["trained_tokens"] == _outputs(case) - case.dropped == st_.loss_tokens
    assert st_.duplicates + st_.late_turns == case.duplicates
    assert len(segs) == case.expected["fork"] + 1 and segs[-1].done and not any(s.done for s in segs[:-1])
    assert [s.index for s in segs] == list(range(len(segs)))
    assert sum(len(s.turn_ends) for s in segs) <= len(case.truth)
    assert asm.open == {} and asm.pending_turns == 0


@given(episodes(), st.lists(st.integers(0, 40), max_size=6))
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_invariant_with_cuts_for_partial_training(case, cut_at):
    asm = Assembler()
    segs: list[Segment] = []
    for i, rec in enumerate(case.records):
        segs += asm.feed(rec)
        if i in cut_at:
            segs += asm.cut(case.episode)
    counts = check_segments(case, segs)
    st_ = asm.stats()
    assert counts["trained_tokens"] == _outputs(case) - case.dropped + st_.dropped_after_cut
    assert [s.index for s in segs] == list(range(len(segs)))
    for s in segs:  # a cut continuation re-includes the context: its loss starts after the trained turns
        assert len(s.turn_ends) > 0 and s.loss_mask[s.turn_ends].all()


# ------------------------------------------------------------------------------------------ examples


def _turn(
    ep, t, inp, out, keep=None, *, prev=None, policy_version=0, reward=0.0, routing=None, digest=None, last=False
):
    inp = np.asarray(inp, np.int32)
    keep = common_prefix_len(inp, np.asarray(prev, np.int32)) if keep is None and prev is not None else (keep or 0)
    return wire.TurnRecord(
        episode=ep,
        turn=t,
        policy_version=policy_version,
        keep=keep,
        input_delta=inp[keep:],
        input_len=len(inp),
        input_digest=digest or wire.digest_ids(inp),
        output_ids=np.asarray(out, np.int32),
        output_logprobs=-np.arange(1, len(out) + 1, dtype=np.float32) / 10,
        finish=wire.Finish.STOP,
        routing=routing,
        reward=reward,
        tests_passed=-1,
        t_sample_s=0.0,
        t_exec_s=0.0,
        last=last,
    )


def _end(ep, turns):
    return wire.EndRecord(ep, turns, wire.EndReason.SOLVED, 1, 1, True)


def test_fork_ends_segment_and_masks_the_drifted_prefix():
    asm = Assembler()
    s0 = [1, 2, 3] + [10, 11]
    i1 = [1, 2, 99] + [10, 11] + [4]  # token 2 re-rendered: the prefix differs before turn 0's output
    assert asm.add(_turn("e", 0, [1, 2, 3], [10, 11], reward=1.0)) == []
    (old,) = asm.add(_turn("e", 1, i1, [20, 21, 22], prev=s0, reward=2.0))
    assert not old.done and old.tokens.tolist() == s0 and old.loss_mask.tolist() == [0, 0, 0, 1, 1]
    assert old.turn_ends.tolist() == [4] and old.turn_rewards.tolist() == [1.0]
    (new,) = asm.end(_end("e", 2))
    assert new.done and new.forked and new.index == 1 and new.tokens.tolist() == i1 + [20, 21, 22]
    assert new.loss_mask.tolist() == [0] * 6 + [1, 1, 1]
    # turn 0's outputs sit after the first difference: re-contextualised input, not marked as outputs
    assert new.turn_ids.tolist() == [-1] * 6 + [1, 1, 1]
    assert new.versions.tolist() == [-1] * 6 + [0] * 3 and new.turn_rewards.tolist() == [2.0]
    st_ = asm.stats()
    assert st_.fork == 1 and st_.tokens_recontextualised == 4 and st_.first_diff == [2 - 5]


def test_realign_drops_the_discarded_run_and_carries_a_fully_dropped_turns_reward():
    asm = Assembler()
    asm.add(_turn("e", 0, [1, 2], [10, 11, 12], reward=1.0))
    # the agent kept only [10] of turn 0's output
    asm.add(_turn("e", 1, [1, 2, 10, 5], [20, 21], prev=[1, 2, 10, 11, 12], reward=2.0))
    # turn 2 discards turn 1's whole output: its reward moves to turn 2
    asm.add(_turn("e", 2, [1, 2, 10, 5, 6], [30], prev=[1, 2, 10, 5, 20, 21], reward=4.0))
    (seg,) = asm.end(_end("e", 3))
    assert seg.tokens.tolist() == [1, 2, 10, 5, 6, 30]
    assert seg.loss_mask.tolist() == [0, 0, 1, 0, 0, 1]
    assert seg.turn_numbers.tolist() == [0, 2] and seg.turn_rewards.tolist() == [1.0, 6.0]
    assert seg.turn_ends.tolist() == [2, 5] and seg.turn_starts.tolist() == [2, 5]
    st_ = asm.stats()
    assert st_.realign == 2 and st_.tokens_dropped == 4 and st_.fork == 0


def test_cut_returns_the_segment_so_far_and_continues_with_full_context():
    asm = Assembler()
    asm.add(_turn("e", 0, [1, 2], [10, 11], reward=1.0))
    (a,) = asm.cut()
    assert not a.done and a.index == 0 and a.loss_mask.tolist() == [0, 0, 1, 1]
    assert asm.cut() == []  # nothing new to train
    asm.add(_turn("e", 1, [1, 2, 10, 11, 3], [20], prev=[1, 2, 10, 11], reward=2.0))
    (b,) = asm.end(_end("e", 2))
    assert b.done and b.index == 1 and b.tokens.tolist() == [1, 2, 10, 11, 3, 20]
    assert b.loss_mask.tolist() == [0, 0, 0, 0, 0, 1] and b.logprobs[:5].tolist() == [0] * 5
    assert b.turn_numbers.tolist() == [1] and b.turn_rewards.tolist() == [2.0]
    a.tokens[0] = 77  # returned segments own their arrays
    assert b.tokens[0] == 1 and asm.stats().ended_after_cut == 0
    asm.add(_turn("f", 0, [1], [2]))
    assert len(asm.cut("f")) == 1 and asm.end(_end("f", 1)) == [] and asm.stats().ended_after_cut == 1


def test_a_cut_of_the_episodes_last_turn_is_done_before_the_end_record_arrives():
    # a one-turn episode whose step starts after its turn but before its end record: trained as done (its
    # return is its reward), not as a cut bootstrapped with the value head on top of the reward
    asm = Assembler()
    asm.add(_turn("e", 0, [1, 2], [10, 11], reward=3.0, last=True))
    (a,) = asm.cut()
    assert a.done and a.turn_numbers.tolist() == [0] and a.turn_rewards.tolist() == [3.0]
    assert asm.end(_end("e", 1)) == [] and asm.stats().ended_after_cut == 0 and "e" not in asm.open
    # multi-turn: the earlier cut bootstraps (the episode goes on), the cut holding the last turn does not
    asm.add(_turn("f", 0, [1, 2], [10], reward=1.0))
    (b,) = asm.cut("f")
    asm.add(_turn("f", 1, [1, 2, 10, 3], [20], prev=[1, 2, 10], reward=2.0, last=True))
    (c,) = asm.cut("f")
    assert not b.done and c.done and c.turn_numbers.tolist() == [1]
    assert asm.end(_end("f", 2)) == [] and asm.stats().ended_after_cut == 0


def test_a_cut_holding_the_last_turn_gives_its_reward_with_no_bootstrap():
    asm = Assembler()
    asm.add(_turn("e", 0, [1, 2], [10, 11], reward=2.0, last=True))
    (seg,) = asm.cut()
    values = np.full(len(seg.tokens) + 1, 0.9)  # a value head that says ~1 everywhere
    _, ret = ppo.segment_advantages(
        seg.loss_mask, values, seg.turn_ends, seg.turn_rewards, seg.done, gamma=1.0, lam=1.0
    )
    assert np.allclose(ret[seg.loss_mask], 2.0), ret  # not 2.0 + 0.9


def test_duplicates_conflicts_reordering_and_late_turns_are_counted_not_fatal():
    asm = Assembler()
    t0 = _turn("e", 0, [1, 2], [10])
    t1 = _turn("e", 1, [1, 2, 10, 3], [20], prev=[1, 2, 10])
    t2 = _turn("e", 2, [1, 2, 10, 3, 20, 4], [30], prev=[1, 2, 10, 3, 20])
    conflicting = _turn("e", 1, [1, 2, 10, 3], [21], prev=[1, 2, 10])
    assert asm.add(t2) == [] and asm.add(t1) == [] and asm.pending_turns == 2
    assert asm.end(_end("e", 3)) == []  # waits for turn 0
    assert asm.add(t1) == [] and asm.add(conflicting) == []
    (seg,) = asm.add(t0)
    assert seg.done and seg.tokens.tolist() == [1, 2, 10, 3, 20, 4, 30]
    assert asm.add(t0) == [] and asm.add(_turn("e", 3, [9], [9])) == []
    st_ = asm.stats()
    assert (st_.duplicates, st_.conflicts, st_.late_turns) == (1, 1, 2)


def test_bad_digest_makes_the_turn_untrainable_and_a_full_input_resyncs():
    asm = Assembler()
    asm.add(_turn("e", 0, [1, 2], [10, 11]))
    (closed,) = asm.add(_turn("e", 1, [1, 2, 10, 11, 3], [20], prev=[1, 2, 10, 11], digest=wire.digest_ids([0])))
    assert not closed.done and closed.tokens.tolist() == [1, 2, 10, 11]
    # turn 2 builds on turn 1's (unknown) sequence: cannot be reconstructed either
    assert asm.add(_turn("e", 2, [1, 2, 10, 11, 3, 20, 4], [30], keep=6)) == []
    # turn 3 sends its whole input (keep = 0): trainable again, in a new segment
    asm.add(_turn("e", 3, [1, 2, 10, 11, 3, 20, 4, 30, 5], [40], keep=0))
    (seg,) = asm.end(_end("e", 4))
    assert seg.done and seg.forked and seg.loss_mask.sum() == 1 and seg.turn_numbers.tolist() == [3]
    st_ = asm.stats()
    assert (st_.untrainable_turns, st_.digest_mismatch, st_.resyncs) == (2, 1, 1)  # turn 2: keep > assembled


def test_a_turn_that_never_arrives_abandons_the_episode_within_bounds():
    asm = Assembler(AssemblerConfig(max_pending_turns=3))
    asm.add(_turn("e", 0, [1], [10]))
    out = []
    for t in range(2, 6):  # turn 1 is lost
        out += asm.add(_turn("e", t, [1, 10, t], [t], keep=0))
    assert len(out) == 1 and not out[0].done and out[0].turn_numbers.tolist() == [0]
    assert asm.open == {} and asm.stats().untrainable_turns == 4


def test_many_episodes_interleaved():
    rng = np.random.default_rng(7)
    cases = [
        make_episode(
            rng, list(rng.choice(["clean", "realign", "fork"], size=8)), episode=f"ep{i}", shuffle=1.0, duplicate=0.2
        )
        for i in range(6)
    ]
    stream = [r for c in cases for r in c.records]
    rng.shuffle(stream)
    asm = Assembler()
    segs = _feed(asm, stream)
    for c in cases:
        check_segments(c, [s for s in segs if s.episode == c.episode])
        assert asm.episode_stats(c.episode).fork == c.expected["fork"]
    assert asm.stats().boundaries == sum(len(c.truth) - 1 for c in cases)


def test_segment_validates_lengths():
    z = np.zeros(3, np.int32)
    with pytest.raises(ValueError, match="loss_mask"):
        Segment("e", 0, z, np.zeros(2, bool), z.astype(np.float32), z, z, None, z[:0], z[:0].astype(np.float32), True)


# ------------------------------------------------------------------------------------------ real BPE drift

SHELL_OUTPUTS = [
    "total 48\ndrwxr-xr-x  5 user user 4096 Mar  3 10:12 .\ndrwxr-xr-x 18 user user 4096 Mar  3 09:58 ..\n"
    "-rw-r--r--  1 user user  220 Mar  3 09:58 .bash_logout\n-rw-r--r--  1 user user 3771 Mar  3 09:58 .bashrc\n",
    "    def parse(self, line):\n        if not line.strip():\n"
    "            return None\n        return line.split(':', 1)\n",
    "============================= test session starts ==============================\n"
    "collected 4 items\n\ntests/test_parse.py ..F.                                               [100%]\n",
    "  File \"/app/main.py\", line 12, in <module>\n    main()\nNameError: name 'mian' is not defined\n",
    "   \n\t  indented\t\ttabs   and  spaces  \n\n\n",
]
ACTIONS = [
    "\n```bash\nls -la\n```",
    "  I'll look at the parser.\n```bash\ncat src/parse.py\n```",
    "```bash\npython -m pytest -q tests/\n```\n\n",
    " ```bash\nsed -i 's/mian/main/' main.py\n```",
    '\n\nLet me check again:\n```bash\ngrep -rn "def " src/ | head\n```  ',
]


def _sampled_ids(tok, text: str) -> list[int]:
    """What a model samples: a valid but not canonical tokenization (pieces at whitespace, encoded apart)."""
    return [i for piece in re.split(r"(\s+)", text) if piece for i in tok.encode(piece)]


def _run_agent(tok, turns: int, *, token_in: bool) -> Assembler:
    asm = Assembler()
    msgs = [{"role": "system", "content": "You are a terminal agent."}, {"role": "user", "content": "Fix the tests."}]
    seq: list[int] = []
    seq_out: list[int] = []  # the previous turn's output, bridged from at turn t > 0
    for t in range(turns):
        action = ACTIONS[t % len(ACTIONS)]
        if token_in:
            inp = (
                tok.render(msgs)
                if t == 0
                else seq
                + tok.bridge_ids(seq_out)
                + tok.message_ids("user", SHELL_OUTPUTS[(t - 1) % len(SHELL_OUTPUTS)])
                + tok.generation_prompt_ids()
            )
        else:
            inp = tok.render(msgs)  # re-encode the whole chat text every turn
        out = _sampled_ids(tok, action)
        if t % 3 != 2:  # sometimes a length finish: no end-of-turn token
            out.append(tok.end_of_turn_id)
        asm.add(_turn("agent", t, inp, out, prev=seq if t else None))
        seq, seq_out = inp + out, out
        msgs += [
            {"role": "assistant", "content": tok.decode(out, skip_special_tokens=True)},
            {"role": "user", "content": SHELL_OUTPUTS[t % len(SHELL_OUTPUTS)]},
        ]
    return asm


def test_retokenizing_agent_drifts_and_token_in_agent_stays_clean():
    from t1async.model.tokenizer import ChatTokenizer

    tok = ChatTokenizer.load()
    text = _run_agent(tok, 12, token_in=False).stats()
    assert text.boundaries == 11 and text.fork + text.realign > 0, text.as_dict()
    exact = _run_agent(tok, 12, token_in=True).stats()
    assert exact.boundaries == 11 and exact.clean == 11 and exact.fork == exact.realign == 0, exact.as_dict()


def test_an_end_records_unstreamed_reward_lands_on_the_last_turn_unless_already_trained():
    asm = Assembler()
    asm.add(_turn("e", 0, [1, 2], [10, 11], reward=1.0))
    asm.add(_turn("e", 1, [1, 2, 10, 11, 5], [20], prev=[1, 2, 10, 11], reward=0.0))
    (seg,) = asm.end(wire.EndRecord("e", 2, wire.EndReason.TIMEOUT, 3, 4, False, "", unstreamed_reward=2.0))
    assert seg.turn_rewards.tolist() == [1.0, 2.0] and sum(seg.turn_rewards) == 3.0
    # the last turn was already returned by a cut (and trained): the reward cannot land, and that is counted
    asm2 = Assembler()
    asm2.add(_turn("f", 0, [1, 2], [10, 11], reward=1.0))
    asm2.cut()
    assert asm2.end(wire.EndRecord("f", 1, wire.EndReason.TIMEOUT, 2, 4, False, "", unstreamed_reward=1.0)) == []
    assert asm2.stats().unstreamed_unapplied == 1
