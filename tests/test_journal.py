"""The learner's journal: journal files, torn tails, compaction that never loses an acked record."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from t1async.ingest.journal import Journal, JournalClosedError, read_journal
from t1async.protocol import wire

ROOT = Path(__file__).resolve().parent.parent


def rec(episode: str, i: int) -> wire.EndRecord:
    """A small record that names its episode and its index within the episode."""
    return wire.EndRecord(episode, i, wire.EndReason.SOLVED, 0, 0, False, detail="x" * 40)


def keys(records) -> list[tuple[str, int]]:
    return [(r.episode, r.turns) for r in records]


def test_records_replay_in_order_across_files_and_a_restart(tmp_path):
    j = Journal(tmp_path / "j", file_bytes=300)
    want = [("a", i) if i % 2 else ("b", i) for i in range(40)]
    for k in range(0, 40, 3):
        j.append([rec(ep, i) for ep, i in want[k : k + 3]])
    assert j.files > 3
    j.close()
    again = Journal(tmp_path / "j", file_bytes=300)
    assert keys(again.replay()) == want
    assert keys(read_journal(tmp_path / "j")) == want
    again.append([rec("c", 0)])
    again.close()
    assert keys(read_journal(tmp_path / "j"))[-1] == ("c", 0)


def test_a_torn_tail_of_the_last_file_is_truncated_and_appends_continue(tmp_path):
    j = Journal(tmp_path / "j")
    j.append([rec("a", 0), rec("a", 1)])
    j.close()
    last = sorted((tmp_path / "j").iterdir())[-1]
    whole = last.stat().st_size
    with open(last, "ab") as f:
        f.write(b"\x40\x00\x00\x00partial")  # a crash mid-append: the length prefix promises 64 bytes
    j = Journal(tmp_path / "j")
    assert last.stat().st_size == whole
    j.append([rec("a", 2)])
    assert keys(j.replay()) == [("a", 0), ("a", 1), ("a", 2)]
    j.close()


def test_compaction_deletes_settled_files_and_a_restart_never_sees_half_an_episode(tmp_path):
    j = Journal(tmp_path / "j", file_bytes=1)  # every append seals its file
    list(j.replay())
    j.append([rec("done", 0)])
    j.append([rec("done", 1), rec("long", 0)])  # "long" is still running
    j.append([rec("other", 0)])
    j.append([rec("other", 1)])
    r = j.compact(live={"long"})
    assert r.deleted_files == 3  # the file shared with the live "long" stays
    # "done" lost its first record with its file: the rest of it is settled, so no replay shows it
    assert keys(j.replay()) == [("long", 0)]
    assert keys(read_journal(tmp_path / "j")) == [("long", 0)]
    j.close()
    again = Journal(tmp_path / "j", file_bytes=1)
    assert keys(again.replay()) == [("long", 0)]
    again.append([rec("long", 1)])
    r = again.compact(live=set())
    assert keys(read_journal(tmp_path / "j")) == [] and r.kept_files == 1  # the (empty) active file
    again.close()


def test_a_journal_file_sealed_after_the_live_set_was_taken_is_never_deleted(tmp_path):
    """The learner computes ``live`` on its event loop, then compacts in a thread; meanwhile ingest may append
    a new episode's first record and seal that file. ``before`` keeps such a file."""
    j = Journal(tmp_path / "j", file_bytes=200)
    list(j.replay())
    j.append([rec("old", 0)])  # settled
    live, before = set(), j.active_seq  # what the loop computed ...
    j.append([rec("new", 0)] * 3)  # ... before ingest appended a new episode and rolled over
    assert j.files == 2
    j.compact(live, before)
    assert keys(read_journal(tmp_path / "j")) == [("old", 0)] + [("new", 0)] * 3
    j.compact(live)  # what a compaction without the watermark does: acked records of "new" gone
    assert keys(read_journal(tmp_path / "j")) == []
    j.close()


def test_journal_size_stays_bounded_in_a_long_run(tmp_path):
    j = Journal(tmp_path / "j", file_bytes=4096)
    list(j.replay())
    running: list[str] = []
    sizes = []
    for step in range(400):
        ep = f"e{step}"
        running.append(ep)
        j.append([rec(e, step) for e in running])
        if len(running) > 4:
            running.pop(0)  # the oldest episode ends and is trained: settled
        j.compact(live=set(running))
        sizes.append(j.size_bytes())
    assert max(sizes[200:]) <= 3 * 4096 + 2048
    assert j.files <= 4
    j.close()


def test_append_after_close_is_a_clear_error(tmp_path):
    j = Journal(tmp_path / "j")
    j.close()
    with pytest.raises(JournalClosedError, match="after close"):
        j.append([rec("a", 0)])


def test_appends_racing_compaction_in_threads_lose_no_acked_record(tmp_path):
    """The old journal rewrote the file while a worker thread appended to it: records fsynced to the old
    file after compaction read it were acked, then lost (51 of 473 in one run), and appends hit a closed file."""
    j = Journal(tmp_path / "j", file_bytes=2048)
    list(j.replay())
    for i in range(300):
        j.append([rec(f"dead{i}", 0)])
    acked: list[tuple[str, int]] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def writer() -> None:
        i = 0
        while not stop.is_set():
            try:
                j.append([rec("live", i)])
                acked.append(("live", i))
            except Exception as exc:  # noqa: BLE001 - collected and asserted below
                errors.append(exc)
            i += 1

    t = threading.Thread(target=writer)
    t.start()
    deadline = time.monotonic() + 30
    while len(acked) < 200 and time.monotonic() < deadline:
        j.compact(live={"live"})
    stop.set()
    t.join()
    j.close()
    got = set(keys(read_journal(tmp_path / "j")))
    assert not errors
    assert len(acked) >= 200 and set(acked) <= got
    # only a file shared with the live episode still holds dead records (about 28 records a file)
    assert sum(ep.startswith("dead") for ep, _ in got) < 60


WRITER = r"""
import random, sys, threading
sys.path.insert(0, sys.argv[3])
from t1async.protocol import wire
from t1async.ingest.journal import Journal

root, tag = sys.argv[1], sys.argv[2]
rng = random.Random(tag)
j = Journal(root, file_bytes=2048)
earlier = frozenset(r.episode for r in j.replay())  # earlier rounds' unsettled episodes: live forever
settled = set()
lock = threading.Lock()

def compactor():  # as the learner does: the watermark is read with ``live`` (an episode begun after is kept)
    while True:
        with lock:
            before = j.active_seq
            live = earlier | {e for e in episodes if e not in settled}
        j.compact(live, before)

episodes = []
threading.Thread(target=compactor, daemon=True).start()
print("READY", flush=True)
n = 0
while True:
    with lock:
        if len(episodes) - len(settled) < 6:
            episodes.append(f"{tag}-{n}")
            n += 1
        open_eps = [e for e in episodes if e not in settled]
    batch = [(e, rng.randrange(1 << 30)) for e in rng.sample(open_eps, rng.randint(1, len(open_eps)))]
    j.append([wire.EndRecord(e, i, wire.EndReason.SOLVED, 0, 0, False) for e, i in batch])
    sys.stdout.write("".join(f"A {e} {i}\n" for e, i in batch))
    sys.stdout.flush()
    if rng.random() < 0.2:
        e = rng.choice(open_eps)
        print(f"S {e}", flush=True)  # said before compaction may delete it
        with lock:
            settled.add(e)
"""


def test_sigkill_at_random_points_while_compacting_loses_no_acked_record(tmp_path):
    """A writer process appends (acking each record on stdout after the fsync) while another thread compacts;
    it is SIGKILLed at a random point, restarted on the same journal, killed again. After each kill every
    acked record of an unsettled episode replays, in the order it was acked."""
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    root = tmp_path / "j"
    rng = random.Random(7)
    acked: dict[tuple[str, int], int] = {}
    settled: set[str] = set()
    files_seen = 0
    for rnd in range(5):
        pre: list[bytes] = []
        p = subprocess.Popen(
            [sys.executable, str(script), str(root), f"r{rnd}", str(ROOT)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        try:
            assert p.stdout is not None
            first = p.stdout.readline()
            assert first == b"READY\n", first + p.stderr.read() if p.stderr else b""
            pre = [p.stdout.readline()]  # the first ack (an event: a loaded machine may take a while), then
            while pre[-1] and not pre[-1].startswith(b"A "):  # a random point after it
                pre.append(p.stdout.readline())
            time.sleep(rng.uniform(0.0, 1.3))
        finally:
            os.kill(p.pid, signal.SIGKILL)
            p.wait(timeout=30)
            # not communicate(): with two pipes it reads the raw fds and drops what readline() had buffered
            out, err = p.stdout.read(), p.stderr.read()  # type: ignore[union-attr]
        lines = (b"".join(pre) + out).split(b"\n")[:-1]  # the last piece may be a line cut by the kill
        for line in lines:
            kind, *rest = line.decode().split()
            if kind == "A":
                acked[(rest[0], int(rest[1]))] = len(acked)
            elif kind == "S":
                settled.add(rest[0])
        assert any(k[0].startswith(f"r{rnd}-") for k in acked), err.decode()[-2000:]
        files_seen = max(files_seen, len(list(root.iterdir())))
        j = Journal(root, file_bytes=2048)
        got = keys(j.replay())
        j.close()
        need = [k for k in sorted(acked, key=acked.get) if k[0] not in settled]
        have = set(got)
        missing = [k for k in need if k not in have]
        assert not missing, f"round {rnd}: {len(missing)} acked records lost, e.g. {missing[:3]}"
        order = {k: i for i, k in enumerate(got)}
        assert [order[k] for k in need] == sorted(order[k] for k in need)
    assert len(settled) > 10 and files_seen > 1
