"""Chat templates from the model directory: rendering as transformers does, and the exact-ID pieces derived
from three templates (ChatML, a Qwen3-style one that re-renders history, a Llama-3-style one with its own
end-of-turn token), against ``transformers.apply_chat_template`` on the same directory."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer

from t1async.ingest.assembly import Assembler
from t1async.model.chat_template import TEMPLATE_FILE
from t1async.model.tokenizer import ChatTokenizer, assets_dir
from t1async.protocol import wire
from t1async.protocol.errors import ConfigError
from t1async.protocol.sampling import common_prefix_len

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Modelled on Qwen3's template: earlier assistant turns (before the last user query) lose their <think> block;
# consecutive tool messages share one user turn; tool calls are written with tojson.
QWEN3 = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""  # noqa: E501

# Llama 3's template: bos first, a header per message, the content trimmed, <|eot_id|> ends every turn
# (the config's eos is <|end_of_text|>, another token). Saved as chat_template.jinja, as newer transformers do.
# Written across lines: it renders right only with trim_blocks and lstrip_blocks, as in transformers.
LLAMA3 = r"""{% set loop_messages = messages %}
{% for message in loop_messages %}
    {% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' %}
    {% if loop.index0 == 0 %}
        {% set content = bos_token + content %}
    {% endif %}
{{ content }}{% endfor %}
{% if add_generation_prompt %}
{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"""  # noqa: E501
LLAMA3_SPECIAL = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")


def write_model_dir(
    d: Path,
    template: str,
    *,
    special: tuple[str, ...] = (),
    as_file: bool = False,
    **tokens: str | None,
) -> Path:
    """The shipped tokenizer.json (plus ``special`` tokens) and a tokenizer_config.json with ``template``."""
    tok = Tokenizer.from_file(str(assets_dir() / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    d.mkdir(parents=True)
    tok.save(str(d / "tokenizer.json"))
    cfg = json.loads((assets_dir() / "tokenizer_config.json").read_text())
    cfg["added_tokens_decoder"] = {
        str(i): {"content": t.content, "lstrip": False, "normalized": False, "rstrip": False, "special": True}
        for i, t in sorted(tok.get_added_tokens_decoder().items())
    }
    cfg["additional_special_tokens"] = cfg["additional_special_tokens"] + list(special)
    cfg.update(tokens)
    if as_file:
        del cfg["chat_template"]
        (d / TEMPLATE_FILE).write_text(template)
    else:
        cfg["chat_template"] = template
    (d / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
    return d


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("templates")
    return {
        "chatml": write_model_dir(root / "chatml", CHATML),
        "qwen3": write_model_dir(root / "qwen3", QWEN3),
        "llama3": write_model_dir(
            root / "llama3",
            LLAMA3,
            special=LLAMA3_SPECIAL,
            as_file=True,
            bos_token="<|begin_of_text|>",
            eos_token="<|end_of_text|>",
            pad_token=None,
        ),
    }


@pytest.fixture(scope="module")
def toks(dirs) -> dict[str, ChatTokenizer]:
    return {name: ChatTokenizer.load(d) for name, d in dirs.items()}


TEMPLATES = ("chatml", "qwen3", "llama3")
CONVOS = [
    [{"role": "user", "content": "hi"}],
    [
        {"role": "system", "content": "You are a terminal agent."},
        {"role": "user", "content": "Count the lines in /tmp/data.csv"},
        {"role": "assistant", "content": "<think>\nThe file is CSV.\n</think>\n\n```bash\nwc -l /tmp/data.csv\n```"},
        {"role": "tool", "content": "    42 /tmp/data.csv\n"},
        {"role": "tool", "content": "second result"},
        {"role": "assistant", "content": "\n\nDone: 42 lines.  "},
        {"role": "user", "content": "  And the words?\n"},
    ],
    [
        {"role": "user", "content": "list files"},
        {"role": "assistant", "content": "ok", "reasoning_content": "use ls"},
        {"role": "user", "content": "<tool_response>\nx\n</tool_response>"},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "ls", "arguments": {"d": "/"}}}]},
    ],
]


@pytest.mark.parametrize("name", TEMPLATES)
def test_render_matches_transformers_apply_chat_template(name, dirs, toks):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(dirs[name])
    tok = toks[name]
    for convo in CONVOS:
        for gen in (True, False):
            want = hf.apply_chat_template(convo, tokenize=False, add_generation_prompt=gen)
            got = tok.render_text(convo, add_generation_prompt=gen)
            assert got == want, (name, convo, gen)
            assert tok.render(convo, add_generation_prompt=gen) == hf.encode(want, add_special_tokens=False)
    if name == "qwen3":  # extra template variables pass through
        convo = CONVOS[0]
        want = hf.apply_chat_template(convo, tokenize=False, add_generation_prompt=True, enable_thinking=False)
        assert tok.render_text(convo, enable_thinking=False) == want and want.endswith("<think>\n\n</think>\n\n")


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(("user", "tool", "system")), st.text(max_size=60))
def test_chatml_pieces_are_the_old_hard_coded_ids(role, content):
    shipped = ChatTokenizer.load()
    for tok in (shipped, _chatml_from_test_dir()):
        im_start, im_end = tok.tok.token_to_id("<|im_start|>"), tok.tok.token_to_id("<|im_end|>")
        nl = tok.encode("\n")
        assert tok.end_of_turn_id == im_end and tok.eos_ids == (im_end,)
        assert tok.message_ids(role, content) == [im_start, *tok.encode(role + "\n"), *tok.encode(content), im_end, *nl]
        assert tok.generation_prompt_ids() == [im_start, *tok.encode("assistant\n")]
        out = tok.encode(content)
        assert tok.bridge_ids([*out, im_end]) == nl and tok.bridge_ids(out) == [im_end, *nl]


_CHATML_DIR: list[ChatTokenizer] = []


def _chatml_from_test_dir() -> ChatTokenizer:
    if not _CHATML_DIR:  # hypothesis forbids function-scoped fixtures; build the directory once
        import tempfile

        with tempfile.TemporaryDirectory() as d:
            _CHATML_DIR.append(ChatTokenizer.load(write_model_dir(Path(d) / "m", CHATML)))
    return _CHATML_DIR[0]


@pytest.mark.parametrize("name", TEMPLATES)
def test_exact_pieces_decode_to_the_rendered_text(name, toks):
    tok = toks[name]
    head = [{"role": "system", "content": "You are a terminal agent."}, {"role": "user", "content": "Fix it."}]
    reply = "```bash\nls -la\n```"
    obs = "  total 4\n-rw-r--r-- out.txt\n"  # leading spaces: the Llama template trims them
    out = tok.encode(reply) + [tok.end_of_turn_id]
    ids = tok.render(head) + out + tok.bridge_ids(out) + tok.message_ids("user", obs) + tok.generation_prompt_ids()
    msgs = [*head, {"role": "assistant", "content": reply}, {"role": "user", "content": obs}]
    assert tok.decode(ids) == tok.render_text(msgs)
    # a length finish (no end-of-turn token sampled): the bridge writes the whole end of turn
    cut = tok.encode(reply)
    assert tok.decode(cut + tok.bridge_ids(cut)) == tok.decode(out + tok.bridge_ids(out))
    # each piece on its own decodes to the template's text for it
    gen_text = tok.render_text(head)[len(tok.render_text(head, add_generation_prompt=False)) :]
    assert tok.decode(tok.generation_prompt_ids()) == gen_text
    for role in ("user", "tool"):
        closed = [*head, {"role": "assistant", "content": reply}]
        after = tok.render_text([*closed, {"role": role, "content": obs}], add_generation_prompt=False)
        at = after.rindex(reply) + len(reply)
        assert after[at:] == tok.decode(tok.bridge_ids(cut) + tok.message_ids(role, obs)), role


def test_end_of_turn_token_comes_from_the_template(toks):
    llama, chatml = toks["llama3"], toks["chatml"]
    eot, eos = (llama.tok.token_to_id(t) for t in ("<|eot_id|>", "<|end_of_text|>"))
    assert llama.end_of_turn_id == eot and llama.eos_ids == (eot, eos)  # both stop the sampler
    assert llama.end_of_turn_id != chatml.end_of_turn_id
    out = llama.encode("echo hi")
    assert llama.bridge_ids(out + [eot]) == [] and llama.bridge_ids(out) == [eot]
    assert llama.pad_id == eot  # no pad_token in its config
    assert llama.decode(llama.generation_prompt_ids()) == "<|start_header_id|>assistant<|end_header_id|>\n\n"
    assert llama.render([{"role": "user", "content": "x"}])[0] == llama.tok.token_to_id("<|begin_of_text|>")
    assert toks["qwen3"].end_of_turn_id == chatml.end_of_turn_id


# ------------------------------------------------------------------------------------------ re-rendered history

OBSERVATIONS = ["total 8\n-rw-r--r-- 1 a a 10 main.py\n", '  File "main.py", line 3\nNameError: mian\n', "ok\n"]
REPLIES = [
    ("Let me look around first.", "```bash\nls -la\n```"),
    ("main.py fails; run it.", " ```bash\npython main.py\n```"),
    ("A typo: mian.", "\n```bash\nsed -i 's/mian/main/' main.py\n```"),
    ("Check again.", "```bash\npython main.py\n```"),
]


def _sampled(tok: ChatTokenizer, text: str) -> list[int]:
    """A valid but not canonical tokenization, as a model samples (pieces at whitespace, encoded apart)."""
    return [i for piece in re.split(r"(\s+)", text) if piece for i in tok.encode(piece)]


def _turn(t: int, inp: list[int], out: list[int], prev: list[int] | None) -> wire.TurnRecord:
    keep = common_prefix_len(np.asarray(inp, np.int32), np.asarray(prev, np.int32)) if prev else 0
    return wire.TurnRecord(
        episode="ep",
        turn=t,
        policy_version=0,
        keep=keep,
        input_delta=np.asarray(inp[keep:], np.int32),
        input_len=len(inp),
        input_digest=wire.digest_ids(inp),
        output_ids=np.asarray(out, np.int32),
        output_logprobs=np.full(len(out), -0.5, np.float32),
        finish=wire.Finish.STOP,
        routing=None,
        reward=0.0,
        tests_passed=-1,
        t_sample_s=0.0,
        t_exec_s=0.0,
        last=t == len(REPLIES) - 1,
    )


def _episode(tok: ChatTokenizer, *, token_in: bool):
    """A thinking agent: every reply opens with a <think> block. Returns the assembler, the outputs, the last
    input, and the conversation's messages at that point."""
    asm = Assembler()
    msgs = [{"role": "system", "content": "You are a terminal agent."}, {"role": "user", "content": "Fix main.py."}]
    seq: list[int] = []
    outs: list[list[int]] = []
    inp: list[int] = []
    for t, (thought, action) in enumerate(REPLIES):
        if t == 0 or not token_in:
            inp = tok.render(msgs)  # a retokenizing agent re-renders the whole conversation every turn
        else:
            inp = seq + tok.bridge_ids(outs[-1]) + tok.message_ids("user", OBSERVATIONS[t - 1])
            inp += tok.generation_prompt_ids()
        out = tok.encode(f"<think>\n{thought}\n</think>\n\n") + _sampled(tok, action)
        if t != 1:  # turn 1 is a length finish: no end-of-turn token
            out.append(tok.end_of_turn_id)
        asm.add(_turn(t, inp, out, seq or None))
        seq = inp + out
        outs.append(out)
        if t + 1 < len(REPLIES):
            msgs += [
                {"role": "assistant", "content": tok.decode(out, skip_special_tokens=True)},
                {"role": "user", "content": OBSERVATIONS[t]},
            ]
    return asm, outs, inp, msgs


def test_a_template_that_drops_earlier_thinking_drifts_retokenizers_not_exact_ids(toks):
    qwen = toks["qwen3"]
    asm, outs, last_input, msgs = _episode(qwen, token_in=True)
    # the input built from exact IDs is not what the template renders: earlier <think> blocks are gone there
    rendered = qwen.render_text(msgs)
    assert qwen.decode(last_input) != rendered and "Let me look around first." not in rendered
    assert "Let me look around first." in qwen.decode(last_input)
    # ... yet the learner sees every boundary CLEAN and trains exactly the sampled IDs in their context
    (seg,) = asm.end(wire.EndRecord("ep", len(REPLIES), wire.EndReason.SOLVED, 1, 1, True))
    exact = asm.stats()
    assert exact.boundaries == len(REPLIES) - 1 == exact.clean, exact.as_dict()
    assert exact.realign == exact.fork == exact.tokens_dropped == exact.tokens_recontextualised == 0
    assert seg.tokens[seg.loss_mask].tolist() == [t for o in outs for t in o]
    assert seg.tokens[: len(last_input)].tolist() == last_input
    # a retokenizing agent on the same template drifts at every boundary: the re-rendered turn lacks its
    # <think> block, so all of every earlier turn's sampled output leaves the loss, and the drift report says so
    text_asm, text_outs, _, _ = _episode(qwen, token_in=False)
    drift = text_asm.stats()
    assert drift.boundaries == len(REPLIES) - 1 == drift.realign, drift.as_dict()
    assert drift.tokens_dropped == sum(len(o) for o in text_outs[:-1]) and len(drift.first_diff) == drift.realign
    # with ChatML (history rendered as it was) the exact IDs and the re-rendered text agree
    chatml = toks["chatml"]
    _, _, chat_input, chat_msgs = _episode(chatml, token_in=True)
    assert chatml.decode(chat_input) == chatml.render_text(chat_msgs)


# ------------------------------------------------------------------------------------------ bad templates


def test_templates_without_derivable_pieces_get_a_one_line_error(tmp_path):
    unstable = (  # a user message's end depends on what follows it
        "{% for m in messages %}{% if m.role == 'user' %}<u>{{ m.content }}"
        "{% if loop.last %}</u>{% else %}</u2>{% endif %}"
        "{% else %}<a>{{ m.content }}</a>{% endif %}{% endfor %}{% if add_generation_prompt %}<a>{% endif %}"
    )
    with pytest.raises(ConfigError, match=r"user message is not prefix-stable.*'</u>'.*'</u2>") as e:
        ChatTokenizer.load(write_model_dir(tmp_path / "unstable", unstable))
    assert "\n" not in str(e.value)
    open_ended = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    with pytest.raises(ConfigError, match="nothing follows an assistant reply"):
        ChatTokenizer.load(write_model_dir(tmp_path / "open", open_ended))
    no_prompt = CHATML.replace("{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}", "")
    with pytest.raises(ConfigError, match="add_generation_prompt does not append"):
        ChatTokenizer.load(write_model_dir(tmp_path / "noprompt", no_prompt))
    with pytest.raises(ConfigError, match="does not compile"):
        ChatTokenizer.load(write_model_dir(tmp_path / "syntax", "{% for m in messages %}"))
    refuses = "{{ raise_exception('Conversation roles must alternate user/assistant') }}"
    with pytest.raises(ConfigError, match="roles must alternate"):
        ChatTokenizer.load(write_model_dir(tmp_path / "refuses", refuses))
    no_eot = CHATML.replace("<|im_end|>", "<end>")
    with pytest.raises(ConfigError, match="no end-of-turn token"):
        ChatTokenizer.load(write_model_dir(tmp_path / "noeot", no_eot, eos_token=None))
    d = write_model_dir(tmp_path / "none", CHATML)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="no chat template"):
        ChatTokenizer.load(d)
    (d / "tokenizer_config.json").unlink()
    with pytest.raises(ConfigError, match="no tokenizer_config.json"):
        ChatTokenizer.load(d)


def test_chat_template_jinja_wins_and_save_keeps_the_template(tmp_path, toks):
    d = write_model_dir(tmp_path / "both", CHATML)
    (d / TEMPLATE_FILE).write_text(QWEN3)
    tok = ChatTokenizer.load(d)
    msgs = CONVOS[1]
    assert tok.render_text(msgs) == toks["qwen3"].render_text(msgs) != toks["chatml"].render_text(msgs)
    tok.save(tmp_path / "saved", model_max_length=128)
    again = ChatTokenizer.load(tmp_path / "saved")
    assert again.render_text(msgs) == tok.render_text(msgs) and again.end_of_turn_id == tok.end_of_turn_id
    assert json.loads((tmp_path / "saved" / "tokenizer_config.json").read_text())["model_max_length"] == 128
