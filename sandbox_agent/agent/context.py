"""Context policies: what the agent does when the next input would not fit ``max_context`` (design §12).

An episode's input is ``head + turn_0 + turn_1 + ...`` where ``head`` is the first input (system prompt and
task, then the generation prompt) and each turn is its exact sampled output IDs followed by its suffix (the
bridge that closes the assistant turn, the observation message, the generation prompt; see
``loop.turn_suffix_ids``). ``History`` keeps those pieces, so a compacted input is built from exact IDs
like every input: no earlier text is re-encoded, outputs are never retokenized.

A compacted input no longer extends the sequence the learner assembled: that boundary is a FORK (design §5),
by construction. The earlier turns were trained in their own context; the turns after it are trained
in the new one.

Policies (``--context-policy``):

- ``truncate-observations`` (default): the head and the last ``keep_last`` turns stay whole; older turns'
  observations are shortened to a marker (their status line and ``[output omitted]``). If that is not
  enough, the oldest turns are dropped whole and one marker message after the task says how many. It
  compacts down to ``compact_to`` x ``max_context`` tokens (if the last ``keep_last`` turns alone are
  longer than that, fewer are kept whole, at least the last one), so that it does not have to compact
  again on the next turn (every compaction is a FORK and re-prefills the context after the first change). Once
  shortened or dropped, a turn stays so: the next compaction's input shares the longest possible prefix.
- ``stop``: end the episode with reason ``context`` (the behaviour before context management).

A new policy is a class with ``name`` and ``compact(history, limit, target)``, registered in ``POLICIES``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from t1async.protocol.errors import ConfigError

WHOLE, SHORT, DROPPED = "whole", "short", "dropped"
OMITTED = "[output omitted to fit the context]"


class PieceTokenizer(Protocol):
    def message_ids(self, role: str, content: str) -> list[int]: ...
    def generation_prompt_ids(self) -> list[int]: ...
    def bridge_ids(self, output_ids: Sequence[int]) -> list[int]: ...


@dataclass(frozen=True)
class ContextConfig:
    policy: str = "truncate-observations"
    keep_last: int = 8  # turns kept whole by truncate-observations
    compact_to: float = 0.5  # a compaction aims at this fraction of max_context (hysteresis)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ConfigError(f"unknown context policy {self.policy!r}: use one of {', '.join(POLICIES)}")
        if self.keep_last < 0:
            raise ConfigError(f"context keep_last must be >= 0, got {self.keep_last}")
        if not 0.0 < self.compact_to <= 1.0:
            raise ConfigError(f"context compact_to must be in (0, 1], got {self.compact_to}")


@dataclass
class _Turn:
    output: list[int]
    observation: str
    suffix: list[int]  # bridge + observation message + generation prompt
    short: list[int] | None = None  # the same with the shortened observation (built on first use)
    state: str = WHOLE


def short_observation(observation: str) -> str:
    """The marker an older observation is shortened to: its status line and ``[output omitted ...]``."""
    first = observation.split("\n", 1)[0][:120]
    short = f"{first}\n{OMITTED}" if first else OMITTED
    return short if len(short) < len(observation) else observation


class History:
    """The pieces of an episode's current input, to rebuild it from exact IDs after a compaction."""

    def __init__(self, tokenizer: PieceTokenizer, head: Sequence[int], role: str = "user") -> None:
        self.tok, self.role = tokenizer, role
        self.head = list(head)
        gen = list(tokenizer.generation_prompt_ids())
        # dropped turns are announced by a message between the task and the generation prompt
        self.can_drop = len(self.head) > len(gen) and self.head[-len(gen) :] == gen
        self._gen = gen
        self.turns: list[_Turn] = []
        self.dropped = 0  # oldest turns dropped whole
        self.compactions = 0

    def add(self, output: Sequence[int], observation: str, suffix: Sequence[int]) -> None:
        self.turns.append(_Turn([int(t) for t in output], observation, list(suffix)))

    def _short(self, t: _Turn) -> list[int]:
        if t.short is None:
            obs = short_observation(t.observation)
            t.short = (
                t.suffix
                if obs == t.observation
                else (list(self.tok.bridge_ids(t.output)) + list(self.tok.message_ids(self.role, obs)) + self._gen)
            )
        return t.short

    def _piece_len(self, t: _Turn) -> int:
        return 0 if t.state == DROPPED else len(t.output) + len(t.suffix if t.state == WHOLE else self._short(t))

    def _head_ids(self) -> list[int]:
        if not self.dropped:
            return self.head
        note = f"[{self.dropped} earlier turns were dropped to fit the context; the shell kept their effects]"
        return self.head[: -len(self._gen)] + list(self.tok.message_ids(self.role, note)) + self._gen

    def length(self) -> int:
        return len(self._head_ids()) + sum(self._piece_len(t) for t in self.turns)

    def render(self) -> list[int]:
        out = list(self._head_ids())
        for t in self.turns:
            if t.state != DROPPED:
                out += t.output
                out += t.suffix if t.state == WHOLE else self._short(t)
        return out

    def shorten(self, i: int) -> None:
        if self.turns[i].state == WHOLE:
            self.turns[i].state = SHORT

    def drop_oldest(self) -> bool:
        """Drop the oldest turn still present; False if that is impossible."""
        if not self.can_drop or self.dropped >= len(self.turns):
            return False
        t = self.turns[self.dropped]
        t.state, t.output, t.suffix, t.short = DROPPED, [], [], None  # never rendered again: free its IDs
        self.dropped += 1
        return True


class ContextPolicy(Protocol):
    name: str

    def compact(self, history: History, limit: int, target: int) -> list[int] | None:
        """A new input of at most ``limit`` tokens (aiming at ``target``) built from ``history``'s exact IDs,
        or None: the episode stops with reason ``context``."""
        ...


class StopPolicy:
    name = "stop"

    def compact(self, history: History, limit: int, target: int) -> list[int] | None:
        return None


class TruncateObservations:
    name = "truncate-observations"

    def __init__(self, keep_last: int = 8) -> None:
        self.keep_last = keep_last

    def compact(self, history: History, limit: int, target: int) -> list[int] | None:
        n = len(history.turns)
        keep = min(self.keep_last, n)
        for i in range(n - keep):
            history.shorten(i)
        while history.length() > target:  # aim low, so that the next compaction is many turns away
            if history.dropped < n - keep and history.drop_oldest():
                continue
            if keep <= 1:  # the last turn stays whole unless even the limit requires it (below)
                break
            keep -= 1
            history.shorten(n - keep - 1)
        while history.length() > limit:  # the last turns alone are too long: give them up too
            if history.dropped < n - keep and history.drop_oldest():
                continue
            if keep == 0:
                break
            keep -= 1
            history.shorten(n - keep - 1)
        if history.length() > limit:
            return None
        history.compactions += 1
        return history.render()


POLICIES: dict[str, Callable[[ContextConfig], ContextPolicy]] = {
    "truncate-observations": lambda c: TruncateObservations(c.keep_last),
    "stop": lambda c: StopPolicy(),
}


def make_policy(config: ContextConfig) -> ContextPolicy:
    try:
        factory = POLICIES[config.policy]
    except KeyError:
        raise ConfigError(f"unknown context policy {config.policy!r}: use one of {', '.join(POLICIES)}") from None
    return factory(config)
