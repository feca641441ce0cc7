"""t1async.signals: a stop signal cancels the work it guards; handlers installed for a block are put back."""

from __future__ import annotations

import functools
import os
import signal

import anyio
import pytest

from t1async import signals


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
async def test_a_stop_signal_cancels_the_group_it_guards(sig):
    """Sent as soon as ``tg.start`` returns (the receiver is open then: no sleep to guess it), the signal
    cancels the group, whose work would otherwise wait until fail_after fails the test."""
    reached_end = False
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            await tg.start(signals.cancel_on_stop, tg.cancel_scope)
            os.kill(os.getpid(), sig)
            await anyio.sleep_forever()
            reached_end = True
    assert not reached_end


async def test_a_receiver_catches_a_signal_sent_before_it_is_read():
    with signals.receive(*signals.STOP, signal.SIGHUP) as received:
        os.kill(os.getpid(), signal.SIGHUP)  # caught, not fatal: the receiver is open
        with anyio.fail_after(10):
            assert await signals.next_signal(received) is signal.SIGHUP


def test_handlers_are_put_back_after_the_block():
    before = signal.getsignal(signal.SIGHUP)
    with signals.handlers({signal.SIGHUP: signal.SIG_IGN}):
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    assert signal.getsignal(signal.SIGHUP) is before
    saved = signals.set_handlers({signal.SIGUSR2: signal.SIG_IGN})
    signals.set_handlers(saved)
    assert signal.getsignal(signal.SIGUSR2) is saved[signal.SIGUSR2]


def test_run_until_stop_returns_the_result_or_cleans_up_and_raises_stopped(tmp_path):
    """A sync command's async part (``bench.learning``'s evals) under ``run_until_stop``: a SIGTERM cancels it,
    its ``finally`` removes what it made (there, the episodes' work dirs), then it exits 143. The
    signal is sent once the work runs, so the receiver is open: no sleep to guess it."""
    made = tmp_path / "t1w-episode"

    async def work() -> None:
        made.mkdir()
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            await anyio.sleep_forever()
        finally:
            made.rmdir()

    with pytest.raises(SystemExit) as e:
        signals.run_until_stop(work)
    assert e.value.code == 143 and not made.exists()

    async def two() -> int:
        return 2

    assert signals.run_until_stop(two) == 2

    async def fails() -> None:
        raise ValueError("bad task dir")

    with pytest.raises(ValueError, match="bad task dir"):  # as anyio.run would raise it: not in an ExceptionGroup
        signals.run_until_stop(fails)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the receiver put the handler back


async def test_cancel_on_stop_says_which_signal_cancelled():
    got: list[signal.Signals] = []
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            await tg.start(functools.partial(signals.cancel_on_stop, tg.cancel_scope, on_stop=got.append))
            os.kill(os.getpid(), signal.SIGINT)
            await anyio.sleep_forever()
    assert got == [signal.SIGINT]
