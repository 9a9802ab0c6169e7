"""Rendering equals transformers' apply_chat_template; tool formats are detected from the template."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from serve.chat_format import ChatFormat, ChatFormatError, detect_tool_format, prepare_messages

TOOLS = [
    {"type": "function", "function": {"name": "read_file", "description": "Read a file.", "parameters": {
        "type": "object", "properties": {"path": {"type": "string", "description": "File path."},
                                         "offset": {"type": "integer", "description": "First line."}},
        "required": ["path"]}}},
    {"type": "function", "function": {"name": "shell", "description": "Run a command.", "parameters": {
        "type": "object", "properties": {"command": {"type": "string", "description": "bash."}}}}},
]

CONVERSATIONS = [
    [{"role": "user", "content": "hello"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "héllo ✓ 漢字"}],
    [{"role": "system", "content": "S"}, {"role": "user", "content": "read a.py"},
     {"role": "assistant", "content": "Reading.", "tool_calls": [
         {"id": "c1", "type": "function", "function": {"name": "read_file", "arguments": {"path": "a.py", "offset": 2}}},
         {"id": "c2", "type": "function", "function": {"name": "shell", "arguments": {"command": "ls -la"}}}]},
     {"role": "tool", "tool_call_id": "c1", "content": "     1\tx = 1"},
     {"role": "tool", "tool_call_id": "c2", "content": "total 0"},
     {"role": "assistant", "content": "Done."}, {"role": "user", "content": "thanks"}],
]


@pytest.mark.parametrize("ckpt", ["tiny_hermes", "tiny_coder"])
@pytest.mark.parametrize("conv", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("with_tools", [False, True])
def test_render_matches_apply_chat_template(request, ckpt, conv, with_tools):
    path = request.getfixturevalue(ckpt)
    fmt = ChatFormat(path)
    hf = AutoTokenizer.from_pretrained(path)
    msgs = CONVERSATIONS[conv]
    tools = TOOLS if with_tools else None
    text = fmt.render(msgs, tools)
    assert text == hf.apply_chat_template(msgs, tools=tools, add_generation_prompt=True, tokenize=False)
    ids = hf.apply_chat_template(msgs, tools=tools, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert fmt.encode(text) == list(ids)
    assert fmt.render(msgs, tools, add_generation_prompt=False) == hf.apply_chat_template(
        msgs, tools=tools, add_generation_prompt=False, tokenize=False)


def test_formats_are_detected(tiny_hermes, tiny_coder):
    assert ChatFormat(tiny_hermes).tool_format == "hermes"
    assert ChatFormat(tiny_coder).tool_format == "qwen3_coder"
    assert ChatFormat(tiny_coder, tool_format="hermes").tool_format == "hermes"
    assert detect_tool_format("{{ '<function=' }}") == "qwen3_coder"


def test_openai_style_arguments_are_parsed_before_rendering(tiny_coder):
    fmt = ChatFormat(tiny_coder)
    as_text = [{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "shell", "arguments": json.dumps({"command": "ls"})}}]}]
    rendered = fmt.render(as_text, TOOLS, add_generation_prompt=False)
    assert "<function=shell>\n<parameter=command>\nls\n</parameter>" in rendered
    assert prepare_messages(as_text)[1]["content"] == ""
    assert as_text[1]["content"] is None  # the caller's messages are untouched


def test_parsing_uses_the_checkpoint_format(tiny_hermes, tiny_coder):
    h = ChatFormat(tiny_hermes).parse('ok <tool_call>{"name": "shell", "arguments": {"command": "ls"}}</tool_call>')
    assert h.content == "ok" and h.tool_calls[0].name == "shell"
    c = ChatFormat(tiny_coder).parse("<tool_call><function=read_file><parameter=offset>3</parameter></function>"
                                     "</tool_call>", TOOLS)
    assert json.loads(c.tool_calls[0].arguments) == {"offset": 3}


def test_a_template_error_is_a_clear_error(tmp_path, tiny_hermes):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(tiny_hermes, broken)
    (broken / "chat_template.jinja").write_text("{{ raise_exception('only user turns, please') }}")
    with pytest.raises(ChatFormatError, match="only user turns"):
        ChatFormat(broken).render([{"role": "user", "content": "x"}])


def test_the_tiny_checkpoint_command_writes_a_servable_checkpoint(tmp_path, capsys):
    from serve.tiny import main

    assert main([str(tmp_path / "tiny"), "--tool-format", "qwen3_coder", "--seed", "3"]) == 0
    assert "composer-serve --model" in capsys.readouterr().out
    chat = ChatFormat(tmp_path / "tiny")
    assert chat.tool_format == "qwen3_coder" and (tmp_path / "tiny" / "model.safetensors").is_file()
