"""Decontamination: n-gram near-duplicates and identical test files between a corpus and a benchmark."""

from __future__ import annotations

import shutil
from pathlib import Path

from sandbox_agent.synth import generate
from sandbox_agent.tasks.decontam import decontaminate, file_digest, instruction_overlaps, shingles

FIXTURES = Path(__file__).resolve().parents[1] / "sandbox_agent" / "fixtures"


def test_shingles():
    assert shingles("One two, THREE four!", 2) == {"one two", "two three", "three four"}
    assert shingles("too short", 8) == {"too short"}
    assert shingles("", 8) == frozenset()


def test_instruction_overlap_scores():
    base = " ".join(f"w{i}" for i in range(40))
    near = base.replace("w20", "changed")  # one word differs: 8 of 33 shingles lost
    far = " ".join(f"x{i}" for i in range(40))
    sub = " ".join(f"w{i}" for i in range(10, 30))  # a passage of the benchmark text
    hits = instruction_overlaps([("near", near), ("far", far), ("sub", sub)], [("bench", base)], n=8, threshold=0.5)
    by = {o.corpus_task: o for o in hits}
    assert set(by) == {"near", "sub"}
    assert 0.5 < by["near"].jaccard < 1 and by["sub"].containment == 1.0 and by["sub"].jaccard < 0.5
    assert instruction_overlaps([("same", base)], [("bench", base)])[0].jaccard == 1.0


def test_file_digest_normalises_whitespace_only():
    assert file_digest(b"a = 1  \r\nb = 2\n\n") == file_digest(b"a = 1\nb = 2")
    assert file_digest(b"a = 1\nb = 2") != file_digest(b"a = 1\nb = 3")


def test_synth_corpus_is_clean_against_fixtures_and_leaks_are_caught(tmp_path):
    corpus = tmp_path / "corpus"
    generate(corpus, 22, seed=3)
    clean = decontaminate(corpus, FIXTURES)
    assert clean.corpus_tasks == 22 and clean.against_tasks == 6 and clean.flagged == ()
    # plant two leaks: a copied benchmark task under a new name, and a reworded instruction
    shutil.copytree(FIXTURES / "tb1" / "hello-world", corpus / "leak-copy")
    (corpus / "leak-copy" / "task.yaml").write_text(
        (corpus / "leak-copy" / "task.yaml").read_text() + "id: leak-copy\n"
    )
    shutil.copytree(FIXTURES / "tb2" / "word-count", corpus / "leak-reworded")
    instr = (FIXTURES / "tb2" / "word-count" / "instruction.md").read_text()
    (corpus / "leak-reworded" / "instruction.md").write_text("Please do this. " + instr)
    (corpus / "leak-reworded" / "tests" / "test_outputs.py").write_text("def test_changed():\n    pass\n")
    rep = decontaminate(corpus, FIXTURES)
    assert rep.flagged == ("leak-copy", "leak-reworded")
    kinds = {(o.corpus_task, o.kind) for o in rep.overlaps}
    assert ("leak-copy", "tests") in kinds and ("leak-copy", "instruction") in kinds
    assert ("leak-reworded", "instruction") in kinds and ("leak-reworded", "tests") in kinds  # test.sh still identical
    j = rep.to_json()
    assert j["flagged_count"] == 2 and j["overlaps"][0]["corpus_task"] == "leak-copy"


def test_unreadable_tasks_are_reported_not_fatal(tmp_path):
    generate(tmp_path / "c", 2, seed=0)
    bad = tmp_path / "c" / "broken"
    bad.mkdir()
    (bad / "task.yaml").write_text("no_instruction: here\n")
    rep = decontaminate(tmp_path / "c", FIXTURES)
    assert rep.corpus_tasks == 2 and len(rep.unreadable) == 1 and "broken" in rep.unreadable[0]
