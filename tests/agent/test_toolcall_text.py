"""The text-format tool-call parser: both formats, streaming at any split, reasoning, malformed input."""

from __future__ import annotations

import json
import random

import pytest

from agent.toolcall_text import StreamParser, parse

TOOLS = [{"type": "function", "function": {"name": "read_file", "parameters": {"type": "object", "properties": {
    "path": {"type": "string"}, "offset": {"type": "integer"}, "all": {"type": "boolean"},
    "paths": {"type": "array"}}}}}]

HERMES = ('Let me read it.\n<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py", "offset": 3}}\n'
          '</tool_call>\n<tool_call>\n{"name": "read_file", "arguments": {"path": "b.py"}}\n</tool_call>')
QWEN = ("Reading.\n<tool_call>\n<function=read_file>\n<parameter=path>\nsrc/a b.py\n</parameter>\n"
        "<parameter=offset>\n12\n</parameter>\n<parameter=all>\ntrue\n</parameter>\n"
        "<parameter=paths>\n[\"x\", \"y\"]\n</parameter>\n</function>\n</tool_call>")


def streamed(text: str, seed: int, **kw):
    """Feed `text` in random-sized pieces; return (content, reasoning, calls)."""
    rng = random.Random(seed)
    p = StreamParser(**kw)
    items, i = [], 0
    while i < len(text):
        n = rng.randint(1, 7)
        items += p.feed(text[i : i + n])
        i += n
    items += p.close()
    content = "".join(it.text for it in items if it.kind == "content")
    reasoning = "".join(it.text for it in items if it.kind == "reasoning")
    return content, reasoning, [it.call for it in items if it.kind == "tool_call"]


def test_hermes_whole_and_streamed():
    r = parse(HERMES)
    assert r.content == "Let me read it."
    assert [(c.name, json.loads(c.arguments)) for c in r.tool_calls] == [
        ("read_file", {"path": "a.py", "offset": 3}), ("read_file", {"path": "b.py"})]
    for seed in range(20):
        content, _, calls = streamed(HERMES, seed)
        assert content.strip() == "Let me read it." and len(calls) == 2


def test_qwen3_coder_with_schema_types():
    r = parse(QWEN, tools=TOOLS)
    assert r.content == "Reading."
    (call,) = r.tool_calls
    assert call.name == "read_file"
    assert json.loads(call.arguments) == {"path": "src/a b.py", "offset": 12, "all": True, "paths": ["x", "y"]}
    for seed in range(20):
        _, _, calls = streamed(QWEN, seed, tools=TOOLS)
        assert [json.loads(c.arguments) for c in calls] == [json.loads(call.arguments)]


def test_qwen3_coder_without_schema_keeps_strings_and_multiline_values():
    text = "<function=write_file>\n<parameter=path>\nx.py\n</parameter>\n<parameter=content>\ndef f():\n    return 1\n\n</parameter>\n</function>"
    (call,) = parse(text).tool_calls
    assert json.loads(call.arguments) == {"path": "x.py", "content": "def f():\n    return 1\n"}


def test_content_is_emitted_before_the_call_completes():
    p = StreamParser()
    assert [it.text for it in p.feed("Hello wor")] == ["Hello wor"]
    assert [it.text for it in p.feed("ld <tool")] == ["ld "]  # "<tool" could open a tag: held back
    assert p.feed('_call>{"name": "f", "arguments": {}}') == []
    items = p.feed("</tool_call> bye")
    assert items[0].kind == "tool_call" and items[0].call.name == "f" and items[1].text == " bye"


def test_a_lone_angle_bracket_is_not_swallowed():
    r = parse("if a < b and c <tool_x> d")
    assert r.content == "if a < b and c <tool_x> d" and not r.tool_calls


def test_reasoning_is_split_when_asked():
    text = "<think>\nplan: read a\n</think>\n\nAnswer."
    r = parse(text, reasoning=True)
    assert r.reasoning == "\nplan: read a\n" and r.content == "\n\nAnswer."
    assert parse(text).content == text  # not asked: left alone
    for seed in range(10):
        content, reasoning, _ = streamed("still thinking</think>done", seed, reasoning=True, starts_in_reasoning=True)
        assert (content, reasoning) == ("done", "still thinking")


@pytest.mark.parametrize("bad", [
    "<tool_call>{not json}</tool_call>",
    '<tool_call>{"arguments": {}}</tool_call>',
    '<tool_call>["list"]</tool_call>',
    "<tool_call>plain words</tool_call>",
])
def test_malformed_calls_fall_back_to_content(bad):
    r = parse("before " + bad)
    assert not r.tool_calls and r.content == "before " + bad


def test_unclosed_call_at_the_end():
    r = parse('x <tool_call>{"name": "f", "arguments": {"a": 1}}')
    assert [c.name for c in r.tool_calls] == ["f"]  # a stop token ate the closing tag
    r = parse("x <tool_call>{broken")
    assert not r.tool_calls and r.content == "x <tool_call>{broken"


def test_format_restriction():
    assert not parse(QWEN, fmt="hermes").tool_calls
    assert not parse(HERMES, fmt="qwen3_coder").tool_calls
    with pytest.raises(ValueError):
        StreamParser("xml")


def test_a_call_of_an_undeclared_tool_stays_text():
    """With the request's tools known, a block naming another tool is not returned as a call."""
    from agent.toolcall_text import parse

    tools = [{"type": "function", "function": {"name": "read_file", "parameters": {"type": "object"}}}]
    text = 'ok <tool_call>\n{"name": "rm_everything", "arguments": {}}\n</tool_call> and ' \
           '<tool_call>\n{"name": "read_file", "arguments": {"path": "a"}}\n</tool_call>'
    got = parse(text, "hermes", tools)
    assert [c.name for c in got.tool_calls] == ["read_file"] and "rm_everything" in got.content
    coder = parse("<tool_call>\n<function=shell>\n<parameter=cmd>\nls\n</parameter>\n</function>\n</tool_call>",
                  "qwen3_coder", tools)
    assert coder.tool_calls == [] and "<function=shell>" in coder.content
    assert [c.name for c in parse(text, "hermes").tool_calls] == ["rm_everything", "read_file"]  # no tools: all


def test_tags_name_what_the_parser_reads():
    """A server keeps these as text where its tokenizer made them special tokens (serve/chat_format.py)."""
    assert StreamParser("hermes").tags == ["<tool_call>", "</tool_call>"]
    assert sorted(StreamParser("qwen3_coder", reasoning=True).tags) == sorted([
        "<tool_call>", "</tool_call>", "<function=", "</function>", "<parameter=", "</parameter>", "<think>",
        "</think>"])
    for tag in StreamParser("auto", reasoning=True).tags:  # each one changes what the text parses as
        assert parse(f"a {tag} b", reasoning=True) != parse("a  b", reasoning=True), tag


def test_fallback_on_content_whose_special_tags_a_server_dropped():
    """The agent's fallback, unchanged (issue 53, item 1): a server that decodes with skip_special_tokens and
    leaves calls in content loses the <tool_call> tags some checkpoints make special. Qwen3-Coder calls still
    parse (the wrapper is optional); a bare Hermes call is not told from text: it stays content, and counts as
    a call attempt that never ran, which the loop tells the model."""
    from agent.toolcall_text import unparsed_calls

    coder = (QWEN + "\n" + QWEN).replace("<tool_call>", "").replace("</tool_call>", "")
    assert [c.name for c in parse(coder).tool_calls] == ["read_file", "read_file"]
    hermes = parse(HERMES.replace("<tool_call>", "").replace("</tool_call>", ""))
    assert not hermes.tool_calls and len(unparsed_calls(hermes.content)) == 2
