"""Chat templates from the model directory, and the exact-ID pieces TITO derives from them (design §5).

A model directory holds its template as HF does: ``chat_template`` in ``tokenizer_config.json``, or
``chat_template.jinja`` beside it (newer transformers write that file; it wins, as in transformers).
``ChatTemplate`` renders it the way ``transformers.apply_chat_template(..., tokenize=False)`` does: an immutable
sandboxed Jinja environment with ``trim_blocks``/``lstrip_blocks``, the ``raise_exception``, ``strftime_now``
and ``tojson`` helpers, ``messages``, ``add_generation_prompt``, ``tools``/``documents`` (None) and the named
special tokens (``bos_token``, ``eos_token``, ...) as variables. transformers itself is not needed.

``TemplatePieces`` derives, by rendering probe conversations, the text pieces a token-in actor appends
after a turn (``ChatTokenizer`` encodes each on its own):

- ``end_of_turn``: what follows an assistant reply's text, from ``[user, assistant(A)]``; it must also
  follow ``A`` when a message comes next (the assistant's end is stable);
- ``generation_prompt``: the text ``add_generation_prompt`` appends after ``[user, assistant, user]``;
- a message's piece per role: what follows ``A + end_of_turn`` in ``[user, assistant(A), message]``, as
  ``prefix + content + suffix``; the message must render the same when the assistant's next reply follows.
  A template that writes the content verbatim is split once; one that alters it (``| trim``) is rendered
  per message.

Earlier turns may re-render differently (a Qwen3-style template drops ``<think>`` content from assistant
turns before the last user message): the pieces only describe what is appended, so a token-in actor keeps
the sampled IDs while a retokenizing agent drifts, and the learner's boundary check counts that drift.
A template that cannot be cut into such pieces gets a ``ConfigError`` saying which renders differ.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, NoReturn

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from t1async.protocol.errors import ConfigError

TEMPLATE_FILE = "chat_template.jinja"
CONFIG_FILE = "tokenizer_config.json"
# transformers passes these (when set) to every template: tokenizer.special_tokens_map
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")

# probe texts: plain words no template rewrites and no conversation contains
_USER0 = "t1probe user zero"
_REPLY0 = "t1probe reply zero"
_USER1 = "t1probe user one"
_REPLY1 = "t1probe reply one"
_CONTENT = "t1probe content"
_SPACED = "  t1probe\n spaced content \n\n"  # tells a verbatim template from one that strips or rewrites


def token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken dict with ``content``."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _short(text: str, n: int = 60) -> str:
    return repr(text if len(text) <= n else text[:n] + "...")


def read_template_config(directory: Path) -> tuple[dict, str]:
    """``tokenizer_config.json`` of a model directory and its chat template source."""
    f = directory / CONFIG_FILE
    if not f.is_file():
        raise ConfigError(f"no {CONFIG_FILE} in {directory}: a model directory needs it beside tokenizer.json")
    try:
        cfg = json.loads(f.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {f}: {exc}") from exc
    if not isinstance(cfg, dict):
        raise ConfigError(f"{f} must hold a JSON object, got {type(cfg).__name__}")
    jinja_file = directory / TEMPLATE_FILE
    if jinja_file.is_file():
        return cfg, jinja_file.read_text()
    source = cfg.get("chat_template")
    if isinstance(source, list):  # several named templates: transformers uses "default"
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, Mapping)}
        source = named.get("default")
    if not isinstance(source, str) or not source:
        raise ConfigError(f"no chat template in {directory}: {CONFIG_FILE} has no chat_template and no {TEMPLATE_FILE}")
    return cfg, source


def template_variables(cfg: Mapping[str, Any]) -> dict[str, str]:
    """The special-token variables transformers gives a template (the named tokens that are set)."""
    out = {}
    for name in SPECIAL_TOKEN_NAMES:
        text = token_text(cfg.get(name))
        if text is not None:
            out[name] = text
    return out


# ------------------------------------------------------------------------------------------ rendering


class _Generation(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (transformers' assistant-mask tag): renders its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _message(i: int, m: Any) -> dict:
    """A message as transformers hands it to the template: None values dropped, reasoning aliased."""
    if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
        raise ValueError(f"message {i} must be a dict with 'role' and 'content', got {m!r}")
    role, content = m["role"], m["content"]
    if not isinstance(role, str) or not isinstance(content, str):
        raise ValueError(f"message {i}: role and content must be strings, got {type(role)}, {type(content)}")
    out = {k: v for k, v in m.items() if v is not None}
    reasoning = next((out[k] for k in _REASONING_FIELDS if k in out), None)
    if reasoning is not None:
        out = {"thinking": reasoning, **out, "reasoning_content": reasoning}
    return out


class ChatTemplate:
    """One Jinja chat template, rendered as ``transformers.apply_chat_template(..., tokenize=False)`` does."""

    def __init__(self, source: str, variables: Mapping[str, str] | None = None, origin: str = "chat template") -> None:
        self.source = source
        self.variables = dict(variables or {})
        self.origin = origin
        try:
            self._compiled = _environment().from_string(source)
        except jinja2.TemplateError as exc:
            raise ConfigError(f"{origin}: the chat template does not compile: {exc}") from exc

    def render(self, messages: Sequence[Mapping], add_generation_prompt: bool = False, **kwargs: Any) -> str:
        """The conversation as text. Bad messages and a template's ``raise_exception`` raise ValueError."""
        chat = [_message(i, m) for i, m in enumerate(messages)]
        try:
            return str(
                self._compiled.render(
                    messages=chat,
                    tools=None,
                    documents=None,
                    add_generation_prompt=add_generation_prompt,
                    **{**self.variables, **kwargs},
                )
            )
        except jinja2.TemplateError as exc:
            raise ValueError(f"{self.origin}: the chat template refused the messages: {exc}") from exc


# ------------------------------------------------------------------------------------------ pieces


@dataclass(frozen=True)
class RolePiece:
    """How a message of one role renders after a closed assistant turn: ``prefix + content + suffix``."""

    prefix: str
    suffix: str
    verbatim: bool  # the content is written unchanged; False: rendered per message (the template alters it)


class TemplatePieces:
    """The text pieces of one template, derived by rendering probe conversations (see the module doc)."""

    def __init__(self, template: ChatTemplate) -> None:
        self.template = template
        head = [{"role": "user", "content": _USER0}, {"role": "assistant", "content": _REPLY0}]
        self._head = head
        closed = self._render(head, False, "a user message and an assistant reply")
        at = closed.rfind(_REPLY0)
        if at < 0:
            self._fail(f"an assistant reply's text does not appear in its render {_short(closed)}")
        self.end_of_turn: str = closed[at + len(_REPLY0) :]
        if not self.end_of_turn:
            self._fail("nothing follows an assistant reply's text: no end-of-turn text to derive")
        nxt = [*head, {"role": "user", "content": _USER1}]
        text = self._render(nxt, False, "a user message after an assistant reply")
        self._anchor = _REPLY0 + self.end_of_turn
        at = text.find(_REPLY0)
        if at < 0 or not text.startswith(self.end_of_turn, at + len(_REPLY0)):
            after = text[at + len(_REPLY0) :] if at >= 0 else text
            self._fail(
                f"an assistant turn ends with {_short(self.end_of_turn)} when last but with {_short(after)} "
                "when a user message follows"
            )
        prompted = self._render(nxt, True, "a generation prompt")
        if not prompted.startswith(text) or len(prompted) == len(text):
            self._fail(
                f"add_generation_prompt does not append to the conversation: {_short(text[-40:])} became "
                f"{_short(prompted[-60:])}"
            )
        self.generation_prompt: str = prompted[len(text) :]
        self._roles: dict[str, RolePiece] = {}

    def _fail(self, what: str) -> NoReturn:
        raise ConfigError(f"{self.template.origin}: cannot derive the exact-ID pieces of its chat template: {what}")

    def _render(self, messages: list[dict], gen: bool, what: str) -> str:
        try:
            return self.template.render(messages, add_generation_prompt=gen)
        except ValueError as exc:
            raise ConfigError(
                f"{self.template.origin}: cannot derive the exact-ID pieces of its chat template: rendering {what} "
                f"failed: {exc.__cause__ or exc}"
            ) from exc

    def _after_turn(self, role: str, content: str) -> tuple[str, int]:
        """The render with a message after a closed assistant turn, and where the message's text starts."""
        text = self._render([*self._head, {"role": role, "content": content}], False, f"a {role} message")
        at = text.find(self._anchor)
        if at < 0:
            self._fail(f"the assistant turn before a {role} message no longer ends with {_short(self.end_of_turn)}")
        return text, at + len(self._anchor)

    def role(self, role: str) -> RolePiece:
        """The piece of ``role`` (derived on first use, then cached)."""
        piece = self._roles.get(role)
        if piece is not None:
            return piece
        alone, start = self._after_turn(role, _CONTENT)
        tail = alone[start:]
        if tail.count(_CONTENT) != 1:
            self._fail(f"a {role} message's content does not appear once in its render {_short(tail)}")
        prefix, suffix = tail.split(_CONTENT)
        if not prefix and not suffix:
            self._fail(f"a {role} message renders as its bare content: nothing marks where it starts or ends")
        followed = self._render(
            [*self._head, {"role": role, "content": _CONTENT}, {"role": "assistant", "content": _REPLY1}],
            False,
            f"a {role} message and an assistant reply",
        )
        if not followed.startswith(alone):
            at = len(alone) - len(suffix)
            self._fail(
                f"a {role} message is not prefix-stable: it ends with {_short(alone[at:])} when last but "
                f"{_short(followed[at : at + len(suffix) + 20])} when an assistant reply follows"
            )
        spaced, start = self._after_turn(role, _SPACED)
        verbatim = spaced[start:] == prefix + _SPACED + suffix
        piece = RolePiece(prefix, suffix, verbatim)
        self._roles[role] = piece
        return piece

    def message(self, role: str, content: str) -> tuple[str, str, str]:
        """(prefix, content as rendered, suffix) of one message appended after a closed assistant turn."""
        piece = self.role(role)
        if piece.verbatim:
            return piece.prefix, content, piece.suffix
        text, start = self._after_turn(role, content)
        tail = text[start:]
        end = len(tail) - len(piece.suffix)
        if not tail.startswith(piece.prefix) or not tail.endswith(piece.suffix) or end < len(piece.prefix):
            self._fail(f"a {role} message renders as {_short(tail)}, not between {piece.prefix!r} and {piece.suffix!r}")
        return piece.prefix, tail[len(piece.prefix) : end], piece.suffix
