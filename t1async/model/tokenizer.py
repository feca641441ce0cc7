"""The chat tokenizer of a model directory: HF ``tokenizers`` BPE plus the directory's chat template.

Files (a model directory; the shipped ones are ``t1async/model/assets/``, also written into every saved model)::

    tokenizer.json          the BPE model; loads with ``tokenizers.Tokenizer.from_file``
    tokenizer_config.json   chat_template (Jinja), eos/pad tokens, added_tokens_decoder, so that
                            ``transformers.AutoTokenizer.from_pretrained(model_dir)`` works too
    chat_template.jinja     optional; the template as newer transformers save it (wins over the config's)

The shipped tokenizer is byte-level BPE with ChatML: ``<|endoftext|>`` (pad), ``<|im_start|>``, ``<|im_end|>``
(end of turn, and eos); per message ``<|im_start|>{role}\\n{content}<|im_end|>\\n``. Any other template
works the same way: ``t1async.model.chat_template`` renders it as transformers does and derives its pieces.

Two ways to build a prompt, on purpose:

- ``render(messages)``: text level, like HF ``apply_chat_template(tokenize=True)``: the whole conversation
  becomes one string, encoded at once. BPE may merge across piece boundaries (``"\\n" + "  x"`` encodes
  as ``"\\n "`` ``" x"``, not ``"\\n"`` ``" "`` ``" x"``), re-encoding a sampled output rarely gives the
  sampled IDs back, and a template may re-render history (drop earlier ``<think>`` content). This is what a
  retokenizing agent does; it drifts.
- ``message_ids`` / ``generation_prompt_ids`` / ``bridge_ids``: exact IDs of the template's pieces (derived
  from the template, design §5), each piece encoded on its own and appended. A token-in actor builds each
  turn's input as ``previous sequence + bridge_ids(output) + message_ids(...) + generation_prompt_ids()``;
  decoded, a piece is exactly the text the template writes for it.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from t1async.model.chat_template import (
    CONFIG_FILE,
    ChatTemplate,
    TemplatePieces,
    read_template_config,
    template_variables,
    token_text,
)
from t1async.protocol.errors import ConfigError

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
ENDOFTEXT = "<|endoftext|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
ROLES = ("system", "user", "assistant", "tool")

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@functools.cache
def _chatml() -> ChatTemplate:
    return ChatTemplate(CHAT_TEMPLATE, origin="ChatML")


def chatml_text(messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
    """``messages`` in the shipped ChatML template (the tokenizer trainer's corpus)."""
    return _chatml().render(messages, add_generation_prompt)


def assets_dir() -> Path:
    """The package's shipped assets (tokenizer files, default model config)."""
    return Path(str(resources.files("t1async.model") / "assets"))


def tokenizer_config(tok: Tokenizer, model_max_length: int) -> dict:
    """The HF ``tokenizer_config.json`` matching ``tok``."""
    added = {}
    for content in SPECIAL_TOKENS:
        tid = tok.token_to_id(content)
        if tid is None:
            raise ConfigError(f"tokenizer lacks the special token {content!r}; retrain it with train_tokenizer")
        added[str(tid)] = {
            "content": content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
    return {
        "add_bos_token": False,
        "add_eos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": [IM_START, IM_END],
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": IM_END,
        "errors": "replace",
        "model_max_length": model_max_length,
        "pad_token": ENDOFTEXT,
        "split_special_tokens": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }


class ChatTokenizer:
    """A tokenizer with its chat template. ``config`` is the HF ``tokenizer_config.json`` (None: the ChatML one
    ``tokenizer_config`` writes); ``chat_template`` overrides its template source (``chat_template.jinja``)."""

    def __init__(
        self, tok: Tokenizer, path: Path | None = None, config: dict | None = None, chat_template: str | None = None
    ) -> None:
        self.tok = tok
        self.path = path
        where = str(path) if path is not None else "the tokenizer"
        self.config: dict = tokenizer_config(tok, 32768) if config is None else dict(config)
        source = chat_template if chat_template is not None else self.config.get("chat_template")
        if not isinstance(source, str) or not source:
            raise ConfigError(f"{where} has no chat template: set chat_template in {CONFIG_FILE}")
        self.vocab_size: int = tok.get_vocab_size(with_added_tokens=True)
        self.special_ids: frozenset[int] = frozenset(
            i for i, t in tok.get_added_tokens_decoder().items() if t.special
        ) | frozenset(self._config_special_ids())
        self.template = ChatTemplate(source, template_variables(self.config), origin=where)
        self.pieces = TemplatePieces(self.template)
        self.pieces.role("user")  # the observation role of the agent: fail at load, not mid-episode
        self._eot_ids = self.encode(self.pieces.end_of_turn)
        eos = self._token_id("eos_token")
        eot = next((i for i in self._eot_ids if i in self.special_ids), eos)
        if eot is None:
            raise ConfigError(
                f"{where}: no end-of-turn token: the text after an assistant reply, "
                f"{self.pieces.end_of_turn!r}, holds no special token and {CONFIG_FILE} sets no eos_token"
            )
        self.end_of_turn_id: int = eot
        self._closed_ids = self._eot_ids[self._eot_ids.index(eot) + 1 :] if eot in self._eot_ids else self._eot_ids
        self.eos_ids: tuple[int, ...] = (eot,) if eos is None or eos == eot else (eot, eos)
        pad = self._token_id("pad_token")
        self.pad_id: int = eot if pad is None else pad
        self._gen_prompt = self.encode(self.pieces.generation_prompt)

    def _config_special_ids(self) -> list[int]:
        decoder = self.config.get("added_tokens_decoder") or {}
        return [int(k) for k, v in decoder.items() if isinstance(v, dict) and v.get("special")]

    def _token_id(self, name: str) -> int | None:
        text = token_text(self.config.get(name))
        if text is None:
            return None
        tid = self.tok.token_to_id(text)
        if tid is None:
            raise ConfigError(f"{CONFIG_FILE} names {name} {text!r}, which is not in the tokenizer's vocabulary")
        return int(tid)

    @classmethod
    def load(cls, path: str | Path | None = None) -> ChatTokenizer:
        """Load from a model directory (or its tokenizer.json); None -> the shipped asset. The chat template
        and special tokens come from the directory's tokenizer_config.json / chat_template.jinja."""
        p = assets_dir() if path is None else Path(path)
        f = p / "tokenizer.json" if p.is_dir() else p
        if not f.is_file():
            raise ConfigError(
                f"no tokenizer at {f}: expected tokenizer.json (run python -m t1async.model.train_tokenizer)"
            )
        try:
            tok = Tokenizer.from_file(str(f))
        except Exception as exc:  # tokenizers raises a bare Exception on a bad file
            raise ConfigError(f"cannot read tokenizer {f}: {exc}") from exc
        config, source = read_template_config(f.parent)
        return cls(tok, f, config, source)

    def save(self, directory: str | Path, model_max_length: int = 32768) -> None:
        """Write tokenizer.json and tokenizer_config.json (with the chat template) into ``directory``."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        self.tok.save(str(d / "tokenizer.json"))
        cfg = {**self.config, "chat_template": self.template.source, "model_max_length": model_max_length}
        (d / CONFIG_FILE).write_text(json.dumps(cfg, indent=2) + "\n")

    # -- text <-> ids ------------------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """Encode text; special-token strings in it are recognised, nothing is added."""
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    # -- chat --------------------------------------------------------------------------------------------

    def render_text(self, messages: Sequence[dict], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """The chat template applied as text, as ``apply_chat_template(..., tokenize=False)``; ``kwargs`` are
        extra template variables (``enable_thinking=False``, ...)."""
        return self.template.render(messages, add_generation_prompt, **kwargs)

    def render(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> list[int]:
        """Template to one string, then encode the whole string (text level; may drift, see module doc)."""
        return self.encode(self.render_text(messages, add_generation_prompt))

    def message_ids(self, role: str, content: str) -> list[int]:
        """Exact IDs of one message after a closed assistant turn: the template's prefix for ``role``, the
        content and the suffix, each encoded on its own (ChatML: ``<|im_start|>role\\n``, content,
        ``<|im_end|>\\n``)."""
        prefix, body, suffix = self.pieces.message(role, content)
        return [*self.encode(prefix), *self.encode(body), *self.encode(suffix)]

    def generation_prompt_ids(self) -> list[int]:
        """What ``add_generation_prompt`` appends (ChatML: ``<|im_start|>assistant\\n``)."""
        return list(self._gen_prompt)

    def bridge_ids(self, output_ids: Sequence[int]) -> list[int]:
        """IDs that close an assistant turn: the template's end-of-turn text after a reply, less its
        end-of-turn token when the output already ends with it (ChatML: ``<|im_end|>\\n`` or ``\\n``)."""
        ends = len(output_ids) > 0 and int(output_ids[-1]) == self.end_of_turn_id
        return list(self._closed_ids if ends else self._eot_ids)
