"""The persistent-shell protocol: a small bash driver loop, and the host side that frames commands and
finds where each one's output ends.

Protocol. The host writes ``COMMAND \\0 NONCE \\0`` to the shell's stdin. The driver (below) reads the
command up to the NUL, ``eval``s it in the shell itself (so cd, variables, functions and jobs persist)
with stdin from /dev/null and the control fds closed, then reads the nonce (it was not readable by
the command through its own fds) and prints the marker ``__T1_DONE_<nonce>_<status> <pwd %q>\\n`` on a
saved copy of stdout. The host scans the byte stream for ``__T1_DONE_<nonce>_``: a fresh 128-bit nonce per
command, so output that merely looks like a marker (an old marker replayed by ``cat``, a ``set -x``
trace, a forged one with another nonce) cannot end the command. Everything before the marker is the
command's output; bytes after it (late output of background jobs) open the next command's output.

Commands go through ``eval``, so a syntax error or an unbalanced quote is reported by bash (status 2)
instead of leaving the shell waiting for more input, and a heredoc without its terminator is closed at
the end of the command. The driver shields itself from the user's shell options: after each command it
records ``set -e/-u/-x/-v`` and turns them off, and turns them back on before the next command, and it
restores ``$?`` to the previous command's status.

Aborting a timed-out command. The host sends the shell SIGUSR1 and kills the command's processes. The
shell's USR1 trap arms a DEBUG trap (with ``extdebug``) that skips every further simple command of that
command and returns from its functions, so ``sleep 100; rm -rf build`` stops after the sleep as a ^C
would stop it, and a finite loop runs out without doing anything. (At most one more simple command may
start before the trap runs.) The next command disarms it. The trap cannot break loops: ``break`` would
also leave the driver's own loop, so an endless loop (``while :; do :; done``) keeps the shell busy and
the host restarts it (bwrap.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import anyio
from anyio.abc import ByteReceiveStream, ByteSendStream

from sandbox_agent.sandbox.base import OutputBuffer

MARK = b"__T1_DONE_"
_CHUNK = 1 << 16

DRIVER = r"""
exec 62<&0 0</dev/null 63>&1 2>&1
__t1_ret() { return "$1"; }
__t1_flags= __t1_rc=0 __t1_abort=0 __t1_cmd= __t1_nonce=
__t1_dbg='if [[ $__t1_abort == 1 && $BASH_COMMAND != __t1_* && ${FUNCNAME[0]-} != __t1_* ]]; then
  if [[ -n ${FUNCNAME[0]-} ]]; then __t1_ret 2; else __t1_ret 1; fi
else __t1_ret 0; fi'
__t1_on_usr1() { __t1_abort=1; builtin shopt -s extdebug; builtin trap -- "$__t1_dbg" DEBUG; }
__t1_read() {
  while :; do
    IFS= builtin read -r -d '' -u 62 "$1" && return 0
    (( $? > 128 )) || return 1
  done
}
__t1_before() {
  if [[ $__t1_abort == 1 ]]; then __t1_abort=0; builtin trap - DEBUG; builtin shopt -u extdebug; fi
  if [[ -n $__t1_flags ]]; then builtin set "-$__t1_flags"; fi
  if [[ $__t1_flags == *e* ]]; then return 0; fi
  return "$__t1_rc"
}
__t1_after() {
  __t1_rc=$? __t1_flags=
  [[ $- == *e* ]] && __t1_flags+=e; [[ $- == *u* ]] && __t1_flags+=u
  [[ $- == *x* ]] && __t1_flags+=x; [[ $- == *v* ]] && __t1_flags+=v
  builtin set +euxv
  __t1_read __t1_nonce || builtin exit 0
  builtin printf '%s%s_%s_%s %q\n' __T1_ DONE "$__t1_nonce" "$__t1_rc" "$PWD" >&63
  __t1_nonce= __t1_cmd=
}
builtin trap __t1_on_usr1 USR1
while __t1_read __t1_cmd; do
  { __t1_before; } 2>/dev/null
  builtin eval "$__t1_cmd" 62<&- 63>&-
  { __t1_after; } 2>/dev/null
done
"""


@dataclass(frozen=True)
class Done:
    """The marker of a finished command: its status and the shell's cwd after it (bash-quoted)."""

    status: int
    cwd_quoted: str


class ShellEOF(Exception):
    """The shell's stdout ended: the shell (and so the sandbox) exited."""


class ShellChannel:
    """Frames commands to the driver and reads output up to a command's marker, in bounded memory.

    ``read_until_done`` is resumable: if it is cancelled (a timeout), what was read so far stays in the
    channel and in the OutputBuffer, and calling it again with the same nonce continues.
    """

    def __init__(self, stdin: ByteSendStream, stdout: ByteReceiveStream) -> None:
        self._stdin, self._stdout = stdin, stdout
        self._pending = bytearray()  # read but not yet attributed (may hold a partial marker)

    async def send(self, command: str, nonce: str) -> None:
        await self._stdin.send(command.encode("utf-8", errors="surrogateescape") + b"\0" + nonce.encode() + b"\0")

    async def read_until_done(self, nonce: str, out: OutputBuffer) -> Done:
        needle = MARK + nonce.encode() + b"_"
        keep = len(needle) - 1
        while True:
            at = self._pending.find(needle)
            if at >= 0:
                out.feed(self._pending[:at])
                del self._pending[:at]  # keep the marker itself until its line is complete
                nl = self._pending.find(b"\n", len(needle))
                if nl >= 0:
                    line = bytes(self._pending[len(needle) : nl])
                    del self._pending[: nl + 1]
                    status, _, cwd = line.decode("utf-8", errors="surrogateescape").partition(" ")
                    return Done(int(status) if status.isdigit() else -1, cwd)
                if len(self._pending) > 1 << 20:  # a marker line is short; this is not one
                    out.feed(self._pending[:1])
                    del self._pending[:1]
                    continue
            elif len(self._pending) > keep:
                cut = len(self._pending) - keep
                out.feed(self._pending[:cut])
                del self._pending[:cut]
            try:
                chunk = await self._stdout.receive(_CHUNK)
            except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
                out.feed(self._pending)
                self._pending.clear()
                raise ShellEOF() from None
            self._pending += chunk

    def take_pending(self, out: OutputBuffer) -> None:
        """Move output read but not yet attributed into ``out`` (used when giving up on a shell)."""
        out.feed(self._pending)
        self._pending.clear()
