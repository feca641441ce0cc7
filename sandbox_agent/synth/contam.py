"""Decontamination of a corpus's train split against its test split. A train task is dropped when its content
key is a test task's, when its test file is identical to one, or when its instruction overlaps a test task's by
``sandbox_agent decontam``'s own 8-gram check (``sandbox_agent.tasks.decontam``): Jaccard or containment 0.5.

Run on specs, before anything is written (``generate`` and ``corpus_entries`` both drop the same tasks), for
the families in ``DECONTAMINATED`` (the content-dependent ones; the older families' corpora are as they were).

The families in ``KEYED`` (``choresn``, ``choresnsome``) are combinatorial: the instruction is a fixed header
and a numbered list of menu phrases, so it is fixed by the ordered chores, and what the split holds out is the
content key (n and the chore set). For them the 8-gram check in the train -> test direction measures the
template, not a leak: a two-chore train instruction that shares only its first chore with a five-chore test
one is "contained" in it at 0.62 (the header and one phrase make the shingles), and 157 of 265 train tasks of
the ``choresn`` warm start's corpus were dropped, none with a test key. For them a train task is dropped when
its key is a test key (the same chores, in any order), or when it contains a whole test instruction (every
shingle of the test one: training text that asks for everything a test task asks, e.g. its chores as a prefix).

``observe``'s instruction is one fixed sentence per variant (the name it acts on is only in a file), so the
instruction check would flag every pair of tasks of a variant, whatever their names: for the families in
``TEMPLATE_INSTRUCTIONS`` only the test-file and key checks run (their test files name the value, so they
differ), and what keeps test names out of training is the content key (the variant and the names).
"""

from __future__ import annotations

from collections.abc import Mapping

from sandbox_agent.synth.common import TEST_HEADER, SynthSpec
from sandbox_agent.tasks.decontam import file_digest, instruction_overlaps

DECONTAMINATED = frozenset({"choresn", "choresnsome", "observe", "chain"})
TEMPLATE_INSTRUCTIONS = frozenset({"observe"})
KEYED = frozenset({"choresn", "choresnsome"})  # checked by key and whole test instructions
NGRAM, THRESHOLD = 8, 0.5  # sandbox_agent decontam's defaults


def contaminated(
    train: Mapping[str, SynthSpec], test: Mapping[str, SynthSpec], *, n: int = NGRAM, threshold: float = THRESHOLD
) -> dict[str, str]:
    """train task id -> why it is dropped (the first test task it overlaps, and by which check)."""
    out: dict[str, str] = {}
    test_keys = {s.content_key: t for t, s in test.items() if s.content_key}
    for t, s in train.items():
        if s.content_key and s.content_key in test_keys:
            out[t] = f"content key of {test_keys[s.content_key]} ({s.content_key})"
    worded = [(t, s.instruction) for t, s in train.items() if s.family not in TEMPLATE_INSTRUCTIONS | KEYED]
    against = [(t, s.instruction) for t, s in test.items() if s.family not in TEMPLATE_INSTRUCTIONS]
    for o in instruction_overlaps(worded, against, n, threshold):
        out.setdefault(o.corpus_task, f"instruction of {o.against_task} (containment {o.containment:.2f})")
    keyed = [(t, s.instruction) for t, s in train.items() if s.family in KEYED]
    if keyed:  # the other direction: the share of a test instruction's shingles found in a train one
        for o in instruction_overlaps(against, keyed, n, threshold):
            if o.containment >= 1.0:
                out.setdefault(o.against_task, f"instruction contains all of {o.corpus_task}'s")
    digests = {file_digest((TEST_HEADER + s.tests).encode()): t for t, s in test.items()}
    for t, s in train.items():
        hit = digests.get(file_digest((TEST_HEADER + s.tests).encode()))
        if hit is not None:
            out.setdefault(t, f"test file of {hit}")
    return out
