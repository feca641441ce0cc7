"""Decontamination of a corpus's train split against its test split, by ``sandbox_agent decontam``'s own
checks (``sandbox_agent.decontam``): a train task is dropped when its instruction's word 8-gram shingles reach
Jaccard or containment 0.5 against a test task's, or when its test file is identical to one.

Run on specs, before anything is written (``generate`` and ``corpus_entries`` both drop the same tasks), for
the families in ``DECONTAMINATED`` (the content-dependent ones; the older families' corpora are
as they were). ``choresn``'s short instructions make this bite: a train task asking for two chores in the
order a five-chore test task starts with is contained in it, and is dropped.

``observe``'s instruction is one fixed sentence per variant (the name it acts on is only in a file), so the
instruction check would flag every pair of tasks of a variant, whatever their names: for the families in
``TEMPLATE_INSTRUCTIONS`` only the test-file check runs (their test files name the value, so they differ), and
what keeps test names out of training is the content key (the variant and the names).
"""

from __future__ import annotations

from collections.abc import Mapping

from sandbox_agent.decontam import file_digest, instruction_overlaps
from sandbox_agent.synth.common import TEST_HEADER, SynthSpec

DECONTAMINATED = frozenset({"choresn", "choresnsome", "observe", "chain"})
TEMPLATE_INSTRUCTIONS = frozenset({"observe"})
NGRAM, THRESHOLD = 8, 0.5  # sandbox_agent decontam's defaults


def contaminated(
    train: Mapping[str, SynthSpec], test: Mapping[str, SynthSpec], *, n: int = NGRAM, threshold: float = THRESHOLD
) -> dict[str, str]:
    """train task id -> why it is dropped (the first test task it overlaps, and by which check)."""
    out: dict[str, str] = {}
    worded = {t: s for t, s in train.items() if s.family not in TEMPLATE_INSTRUCTIONS}
    against = [(t, s.instruction) for t, s in test.items() if s.family not in TEMPLATE_INSTRUCTIONS]
    for o in instruction_overlaps(((t, s.instruction) for t, s in worded.items()), against, n, threshold):
        out.setdefault(o.corpus_task, f"instruction of {o.against_task} (containment {o.containment:.2f})")
    digests = {file_digest((TEST_HEADER + s.tests).encode()): t for t, s in test.items()}
    for t, s in train.items():
        hit = digests.get(file_digest((TEST_HEADER + s.tests).encode()))
        if hit is not None:
            out.setdefault(t, f"test file of {hit}")
    return out
