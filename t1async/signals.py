"""Signal handling, written once: how a process stops on Ctrl-C/SIGTERM and what it ignores meanwhile.

Async (anyio, under trio or asyncio), for long-running commands:

    async with anyio.create_task_group() as tg:
        await tg.start(signals.cancel_on_stop, tg.cancel_scope)  # from here, Ctrl-C or SIGTERM cancels the group
        await run()
        tg.cancel_scope.cancel()                                 # done: stop listening

    sig = await signals.wait_for_stop()                          # until Ctrl-C or SIGTERM; returns which

    rows = signals.run_until_stop(work)    # a sync command's async part: Ctrl-C or SIGTERM cancels it, its
                                           # finally blocks run, then SystemExit(128 + the signal's number)

    with signals.receive(*signals.STOP, signal.SIGHUP) as received:   # caught from here on (no window)
        ...                                                            # say "running"
        sig = await signals.next_signal(received)

Sync (``signal.signal``), where Python allows it (the main thread; elsewhere nothing is installed):

    saved = signals.set_handlers({signal.SIGHUP: signal.SIG_IGN})   # the previous handlers
    signals.set_handlers(saved)                                     # put back
    with signals.handlers({signal.SIGTERM: exit_143}): ...          # the same, scoped
"""

from __future__ import annotations

import contextlib
import functools
import signal
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from types import FrameType
from typing import Any, TypeAlias, TypeVar

import anyio
from anyio.abc import TaskStatus

from t1async.log import get_logger

__all__ = [
    "STOP",
    "Handler",
    "cancel_on_stop",
    "handlers",
    "next_signal",
    "receive",
    "run_until_stop",
    "set_handlers",
    "wait_for_stop",
]

STOP: tuple[signal.Signals, ...] = (signal.SIGINT, signal.SIGTERM)
"""The signals that stop a component gracefully: Ctrl-C and SIGTERM (`cluster down`, the supervisor)."""

Handler: TypeAlias = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None
T = TypeVar("T")


def receive(*sigs: signal.Signals) -> AbstractContextManager[AsyncIterator[int]]:
    """Catch ``sigs`` (default ``STOP``) from now until the block ends; iterate to receive them."""
    return anyio.open_signal_receiver(*(sigs or STOP))


async def next_signal(received: AsyncIterator[int]) -> signal.Signals:
    """The next signal ``received`` (from ``receive``)."""
    async for sig in received:
        return signal.Signals(sig)
    raise RuntimeError("the signal receiver ended")  # anyio's never does


async def wait_for_stop(*sigs: signal.Signals) -> signal.Signals:
    """Until one of ``sigs`` (default ``STOP``) arrives; returns it."""
    with receive(*sigs) as received:
        return await next_signal(received)


async def cancel_on_stop(
    scope: anyio.CancelScope,
    *sigs: signal.Signals,
    on_stop: Callable[[signal.Signals], object] | None = None,
    task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Cancel ``scope`` at the first of ``sigs`` (default ``STOP``), after calling ``on_stop`` with it. Start it
    with ``await tg.start(...)`` in the task group whose scope it is: it reports started once the signals are
    caught, so none sent after that is missed. Cancel that scope when the work is done (this task waits for a
    signal until then)."""
    with receive(*sigs) as received:
        task_status.started()
        sig = await next_signal(received)
    if on_stop is not None:
        on_stop(sig)
    scope.cancel()


def run_until_stop(fn: Callable[[], Awaitable[T]], *sigs: signal.Signals) -> T:
    """``fn()`` under trio, from a sync caller, until it returns or one of ``sigs`` (default ``STOP``) arrives.
    A signal cancels it: its ``finally`` blocks run (its sandboxes, work dirs and servers are removed), then the
    event ``signals.stopped`` is logged and ``SystemExit`` raised, with 128 + the signal's number as a shell's
    exit status (an exit, not an error: outside ``protocol/errors.py``'s tree). Without this a SIGTERM killed a
    sync command (``bench.learning``'s evals) at once and left its episodes' work dirs behind."""
    done: list[T] = []
    got: list[signal.Signals] = []
    failed: list[Exception] = []

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            await tg.start(functools.partial(cancel_on_stop, tg.cancel_scope, *sigs, on_stop=got.append))
            try:
                done.append(await fn())
            except Exception as e:  # raised as anyio.run(fn) would, not wrapped in the group's ExceptionGroup
                failed.append(e)
            tg.cancel_scope.cancel()

    anyio.run(main, backend="trio")
    if failed:
        raise failed[0]
    if not done:
        sig = got[0] if got else signal.SIGTERM
        get_logger("signals").warning("signals.stopped", signal=sig.name, exit_status=128 + int(sig))
        raise SystemExit(128 + int(sig))
    return done[0]


def set_handlers(new: Mapping[signal.Signals, Handler]) -> dict[signal.Signals, Handler]:
    """Install signal handlers; returns the previous ones (none off the main thread, where Python forbids it)."""
    old: dict[signal.Signals, Handler] = {}
    for sig, handler in new.items():
        try:
            old[sig] = signal.signal(sig, handler)
        except ValueError:  # not the main thread
            pass
    return old


@contextlib.contextmanager
def handlers(new: Mapping[signal.Signals, Handler]) -> Iterator[None]:
    """``set_handlers(new)`` for the block; the previous handlers are put back after it."""
    old = set_handlers(new)
    try:
        yield
    finally:
        set_handlers(old)
