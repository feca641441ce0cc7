"""The chat tokenizer: shipped files, template, exact-ID pieces vs text-level rendering (real drift)."""

from __future__ import annotations

import json

import jinja2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from t1async.model import train_tokenizer
from t1async.model.tokenizer import CHAT_TEMPLATE, ChatTokenizer, assets_dir
from t1async.protocol.errors import ConfigError

TOK = ChatTokenizer.load()
IM_START_ID = TOK.tok.token_to_id("<|im_start|>")

CONVO = [
    {"role": "system", "content": "You are a terminal agent."},
    {"role": "user", "content": "Count the lines in /tmp/data.csv"},
    {"role": "assistant", "content": "```bash\nwc -l /tmp/data.csv\n```"},
    {"role": "tool", "content": "42 /tmp/data.csv"},
]


def test_shipped_files_load_with_tokenizers_and_carry_the_hf_config():
    raw = Tokenizer.from_file(str(assets_dir() / "tokenizer.json"))
    cfg = json.loads((assets_dir() / "tokenizer_config.json").read_text())
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert cfg["chat_template"] == CHAT_TEMPLATE
    assert cfg["eos_token"] == "<|im_end|>" and cfg["pad_token"] == "<|endoftext|>"
    assert "bos_token" in cfg and cfg["model_max_length"] > 0
    for tid, spec in cfg["added_tokens_decoder"].items():
        assert raw.token_to_id(spec["content"]) == int(tid) and spec["special"]
    assert TOK.vocab_size == raw.get_vocab_size() == 4096
    assert TOK.eos_ids == (TOK.end_of_turn_id,) and TOK.pad_id != TOK.end_of_turn_id != IM_START_ID


def test_render_text_equals_the_jinja_template():
    for gen in (True, False):
        jinja = jinja2.Environment().from_string(CHAT_TEMPLATE).render(messages=CONVO, add_generation_prompt=gen)
        assert TOK.render_text(CONVO, add_generation_prompt=gen) == jinja


def test_pieces_decode_to_exactly_the_rendered_text():
    pieces = [i for m in CONVO for i in TOK.message_ids(m["role"], m["content"])] + TOK.generation_prompt_ids()
    assert TOK.decode(pieces) == TOK.decode(TOK.render(CONVO)) == TOK.render_text(CONVO)
    assert TOK.render(CONVO) == pieces  # this conversation has no merge across piece boundaries
    assert TOK.generation_prompt_ids()[0] == IM_START_ID
    assert TOK.decode(TOK.generation_prompt_ids()) == "<|im_start|>assistant\n"


def test_text_level_rendering_drifts_from_exact_pieces():
    """Content starting with spaces: "\\n" + "  x" merges to "\\n " + " x" when the whole string is encoded."""
    msgs = [{"role": "tool", "content": "    total 4\n-rw-r--r-- 1 a a 0 out.txt"}]
    pieces = TOK.message_ids("tool", msgs[0]["content"]) + TOK.generation_prompt_ids()
    rendered = TOK.render(msgs)
    assert TOK.decode(rendered) == TOK.decode(pieces)
    assert rendered != pieces
    # a sampled output that is not the canonical encoding of its text drifts when re-encoded
    sampled = [t for ch in "ls -la" for t in TOK.encode(ch)] + [TOK.end_of_turn_id]
    reencoded = TOK.encode(TOK.decode(sampled))
    assert TOK.decode(reencoded) == TOK.decode(sampled) and reencoded != sampled


def test_bridge_ids_close_a_turn_once():
    out = TOK.encode("echo hi") + [TOK.end_of_turn_id]
    assert TOK.bridge_ids(out) == TOK.encode("\n")
    assert TOK.bridge_ids(out[:-1]) == [TOK.end_of_turn_id] + TOK.encode("\n")
    assert TOK.bridge_ids([]) == [TOK.end_of_turn_id] + TOK.encode("\n")


def test_message_ids_layout():
    ids = TOK.message_ids("user", "hello")
    assert ids == [IM_START_ID, *TOK.encode("user\n"), *TOK.encode("hello"), TOK.end_of_turn_id, *TOK.encode("\n")]
    assert TOK.decode(ids, skip_special_tokens=True) == "user\nhello\n"


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=80))
def test_encode_decode_roundtrip(text):
    if any(s in text for s in ("<|im_start|>", "<|im_end|>", "<|endoftext|>")):
        return
    assert TOK.decode(TOK.encode(text)) == text


def test_bad_inputs_name_the_problem(tmp_path):
    with pytest.raises(ConfigError, match="no tokenizer"):
        ChatTokenizer.load(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(ConfigError, match="cannot read tokenizer"):
        ChatTokenizer.load(tmp_path)
    with pytest.raises(ValueError, match="message 0"):
        TOK.render([{"role": "user"}])


def test_train_script_writes_loadable_files(tmp_path):
    train_tokenizer.main(["--vocab-size", "400", "--docs", "400", "--out", str(tmp_path)])
    tok = ChatTokenizer.load(tmp_path)
    assert tok.vocab_size == 400
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert cfg["added_tokens_decoder"][str(tok.end_of_turn_id)]["content"] == "<|im_end|>"
    text = tok.render_text(CONVO)
    assert text == TOK.render_text(CONVO) and tok.decode(tok.render(CONVO)) == text
