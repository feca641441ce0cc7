"""The chat tokenizer of the embedded model: byte-level BPE (HF ``tokenizers``) with a ChatML template.

Files (``t1async/model/assets/``, also written into every saved model directory)::

    tokenizer.json          the BPE model; loads with ``tokenizers.Tokenizer.from_file``
    tokenizer_config.json   chat_template (Jinja, ChatML), eos/pad tokens, added_tokens_decoder, so that
                            ``transformers.AutoTokenizer.from_pretrained(model_dir)`` works too

Special tokens: ``<|endoftext|>`` (pad), ``<|im_start|>``, ``<|im_end|>`` (end of turn, and eos).

Template, per message: ``<|im_start|>{role}\\n{content}<|im_end|>\\n``; generation prompt:
``<|im_start|>assistant\\n``.

Two ways to build a prompt, on purpose:

- ``render(messages)``: text level, like HF ``apply_chat_template(tokenize=True)``: the whole conversation
  becomes one string, encoded at once. BPE may merge across piece boundaries (``"\\n" + "  x"`` encodes
  as ``"\\n "`` ``" x"``, not ``"\\n"`` ``" "`` ``" x"``), and re-encoding a sampled output rarely gives the
  sampled IDs back. This is what a retokenizing agent does; it drifts.
- ``message_ids`` / ``generation_prompt_ids`` / ``bridge_ids``: exact IDs, each piece encoded on its own and
  appended. Concatenated, they decode to exactly the text ``render`` encodes. A token-in actor builds each
  turn's input as ``previous sequence + bridge_ids(output) + message_ids(...) + generation_prompt_ids()``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from importlib import resources
from pathlib import Path

from tokenizers import Tokenizer

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
    def __init__(self, tok: Tokenizer, path: Path | None = None) -> None:
        self.tok = tok
        self.path = path
        ids = {}
        for content in SPECIAL_TOKENS:
            tid = tok.token_to_id(content)
            if tid is None:
                raise ConfigError(f"tokenizer at {path} lacks the special token {content!r}")
            ids[content] = tid
        self.vocab_size: int = tok.get_vocab_size(with_added_tokens=True)
        self.im_start_id: int = ids[IM_START]
        self.im_end_id: int = ids[IM_END]
        self.pad_id: int = ids[ENDOFTEXT]
        self.eos_ids: tuple[int, ...] = (self.im_end_id,)
        self.special_ids: frozenset[int] = frozenset(ids.values())
        self._newline = self.encode("\n")
        self._gen_prompt = [self.im_start_id, *self.encode("assistant\n")]

    @classmethod
    def load(cls, path: str | Path | None = None) -> ChatTokenizer:
        """Load from a model directory or a tokenizer.json file; None -> the shipped asset."""
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
        return cls(tok, f)

    def save(self, directory: str | Path, model_max_length: int = 32768) -> None:
        """Write tokenizer.json and tokenizer_config.json into ``directory``."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        self.tok.save(str(d / "tokenizer.json"))
        cfg = tokenizer_config(self.tok, model_max_length)
        (d / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")

    # -- text <-> ids ------------------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """Encode text; special-token strings in it are recognised, nothing is added."""
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    # -- chat --------------------------------------------------------------------------------------------

    @staticmethod
    def render_text(messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
        """The chat template applied as text (same output as the Jinja ``CHAT_TEMPLATE``)."""
        parts = []
        for i, m in enumerate(messages):
            try:
                role, content = m["role"], m["content"]
            except (KeyError, TypeError) as exc:
                raise ValueError(f"message {i} must be a dict with 'role' and 'content', got {m!r}") from exc
            if not isinstance(role, str) or not isinstance(content, str):
                raise ValueError(f"message {i}: role and content must be strings, got {type(role)}, {type(content)}")
            parts.append(f"{IM_START}{role}\n{content}{IM_END}\n")
        if add_generation_prompt:
            parts.append(f"{IM_START}assistant\n")
        return "".join(parts)

    def render(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> list[int]:
        """Template to one string, then encode the whole string (text level; may drift, see module doc)."""
        return self.encode(self.render_text(messages, add_generation_prompt))

    def message_ids(self, role: str, content: str) -> list[int]:
        """Exact IDs of one message: [im_start] + encode(role + "\\n") + encode(content) + [im_end] + encode("\\n")."""
        return [self.im_start_id, *self.encode(role + "\n"), *self.encode(content), self.im_end_id, *self._newline]

    def generation_prompt_ids(self) -> list[int]:
        """[im_start] + encode("assistant\\n")."""
        return list(self._gen_prompt)

    def bridge_ids(self, output_ids: Sequence[int]) -> list[int]:
        """IDs that close an assistant turn: ([im_end] unless output ends with it) + encode("\\n")."""
        ends = len(output_ids) > 0 and int(output_ids[-1]) == self.im_end_id
        return ([] if ends else [self.im_end_id]) + list(self._newline)
