"""A full disk is backpressure, not a crash: on a real size-limited tmpfs, a journal append that cannot be
written leaves nothing behind, the learner holds its batch unacked (one log event), says so in its metrics,
and resumes by itself when space returns, every turn trained once."""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from t1async.ingest.journal import Journal, JournalWriteError, read_journal
from t1async.learner.service import Learner
from t1async.learner.settings import LearnerConfig
from t1async.protocol import wire
from t1async.testing.models import tiny_model_dir
from t1async.transport import MemoryBroker, MemoryTransport
from t1async.transport.base import traj_subject
from tests.clean_episodes import episodes

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a size-limited tmpfs needs root (CI runs as root)")


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 512 KiB tmpfs, unmounted afterwards whatever happens."""
    d = tmp_path / "fs"
    d.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(d)], check=True)
    try:
        yield d
    finally:
        subprocess.run(["umount", "-l", str(d)], check=False)


def fill(fs: Path, leave: int = 0) -> Path:
    """Write a filler file until the filesystem refuses, then give back ``leave`` bytes (whole pages)."""
    path = fs / "filler"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError as exc:
        assert exc.errno == errno.ENOSPC
    finally:
        os.close(fd)
    os.truncate(path, max(path.stat().st_size - leave, 0))
    return path


def records(first: int, n: int, policy_version: int = 0) -> list[wire.Record]:
    return episodes(first, n, policy_version)  # three clean turns and an end each (tests/clean_episodes.py)


def test_a_failed_append_leaves_nothing_and_the_retry_lands_once(small_fs: Path) -> None:
    j = Journal(small_fs / "journal")
    first, second = records(0, 2), records(10, 6)
    j.append(first)
    size = j.size_bytes()
    assert sum(len(wire.encode(r)) for r in second) > 3 * 4096  # more than the room left
    filler = fill(small_fs, leave=4096)  # room for part of the next append: a torn write, cut back
    with pytest.raises(JournalWriteError, match="nothing of it was kept") as info:
        j.append(second)
    assert info.value.errno == errno.ENOSPC
    active = sorted((small_fs / "journal").glob("*.jf"))[-1]
    assert j.size_bytes() == size and active.stat().st_size == size  # the partial bytes were cut back
    with pytest.raises(JournalWriteError):  # still full: still nothing
        j.append(second)
    filler.unlink()
    assert j.append(second) == len(second)
    j.close()
    back = list(read_journal(small_fs / "journal"))
    assert len(back) == len(first) + len(second)
    assert all(wire.records_equal(a, b) for a, b in zip(back, first + second, strict=True))


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_dir(tmp_path_factory.mktemp("model"))


async def until(cond, what: str, timeout: float = 120.0) -> None:  # noqa: ANN001 - a predicate
    with anyio.fail_after(timeout):
        while not cond():
            await anyio.sleep(0.05)
    assert cond(), what


async def test_the_learner_holds_its_batch_while_the_disk_is_full_and_resumes(
    tmp_path: Path, small_fs: Path, tiny_model: Path
) -> None:
    run = tmp_path / "run"
    (run / "learner").mkdir(parents=True)
    (run / "learner" / "journal").symlink_to(small_fs)  # only the journal is on the small filesystem
    cfg = LearnerConfig(run_dir=run, model=tiny_model, batch_turns=6, steps=0, metrics_every_s=60, lr=1e-4)
    broker = MemoryBroker()
    wave1, wave2, wave3 = records(0, 2), records(10, 2, policy_version=1), records(20, 2, policy_version=1)
    async with MemoryTransport(broker) as lt, MemoryTransport(broker) as pub:
        learner = Learner(cfg, lt, None)
        async with anyio.create_task_group() as tg:
            tg.start_soon(learner.run)
            for r in wave1:
                await pub.publish(traj_subject(r.episode), r)
            await until(lambda: learner.state.step >= 1, "the first wave trains")
            filler = fill(small_fs)
            for r in wave2:
                await pub.publish(traj_subject(r.episode), r)
            await until(lambda: learner.metrics()["journal_blocked_s"] > 0, "the learner reports the full disk")
            # blocked: only what reached the disk before it filled (a page's slack) may be taken (and may even
            # complete a batch: the learner trains what it durably holds), the rest waits untrained
            on_disk = {
                (r.episode, r.turn)
                for r in read_journal(small_fs)
                if isinstance(r, wire.TurnRecord) and r.episode in ("e10", "e11")
            }
            turns2 = [r for r in wave2 if isinstance(r, wire.TurnRecord)]
            assert len(on_disk) < len(turns2)
            assert not any(
                learner.state.was_trained(r.episode, r.turn) for r in turns2 if (r.episode, r.turn) not in on_disk
            )
            filler.unlink()
            # a step needs batch_turns untrained turns: if the slack made a step above, what is left of wave 2 is
            # fewer than that, and (as in a run whose actors stopped) waits for more: wave 3 brings it
            for r in wave3:
                await pub.publish(traj_subject(r.episode), r)
            await until(
                lambda: all(learner.state.was_trained(r.episode, r.turn) for r in turns2),
                "wave 2 trains once the disk takes writes",
            )
            assert learner.ingest.blocked_s() == 0.0  # the last write succeeded, so the flag is down
            tg.cancel_scope.cancel()
    learner.journal.close()
    back = [r for r in read_journal(small_fs) if isinstance(r, wire.TurnRecord)]
    keys = [(r.episode, r.turn) for r in back]
    assert len(keys) == len(set(keys)) == sum(isinstance(r, wire.TurnRecord) for r in wave1 + wave2 + wave3)
    assert all(learner.state.was_trained(r.episode, r.turn) for r in wave2 if isinstance(r, wire.TurnRecord))
