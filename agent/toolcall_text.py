"""Tool calls written as text: the Hermes and Qwen3-Coder formats, parsed incrementally.

One pure-Python parser for both sides of the wire: `serve/chat_format.py` turns a model's generated
text into content + tool calls with it, and the agent falls back on it when a server leaves tool calls
inside `content`. Formats:

  hermes       <tool_call>{"name": "f", "arguments": {...}}</tool_call>          (Qwen2.5, Qwen3)
  qwen3_coder  <tool_call><function=f><parameter=p>value</parameter></function></tool_call>
               (the <tool_call> wrapper is optional)

and `<think>…</think>` reasoning, split out when asked. `StreamParser.feed()` takes text deltas and
returns items as soon as they are certain: content is emitted at once except for a suffix that could
still open a tag; a tool call is emitted when its closing tag arrives. Anything malformed (bad JSON,
an unclosed call at the end) falls back to plain content: the parser never raises on model output.

With `tools` given, a call whose name none of them declares is not a call: its block stays text (a
server must not return `tool_calls` for a tool the request never offered).

Limits: text that merely mentions `<tool_call>` is taken as a call attempt; nested tags are not
supported (neither format has them).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

FORMATS = ("auto", "hermes", "qwen3_coder")
_FUNC = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|\Z)", re.S)
_PARAM = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)", re.S)


@dataclass
class ParsedToolCall:
    name: str
    arguments: str  # a JSON object, as text


@dataclass
class Item:
    kind: str  # "content" | "reasoning" | "tool_call"
    text: str = ""
    call: ParsedToolCall | None = None


@dataclass
class ParsedText:
    content: str
    reasoning: str = ""
    tool_calls: list[ParsedToolCall] = field(default_factory=list)


def param_types_from_tools(tools: list[dict[str, Any]] | None) -> dict[str, dict[str, str]]:
    """{tool name: {parameter: JSON type}} from OpenAI-style tool specs (for Qwen3-Coder values)."""
    out: dict[str, dict[str, str]] = {}
    for t in tools or []:
        fn = t.get("function", t)
        props = (fn.get("parameters") or {}).get("properties") or {}
        out[fn.get("name", "")] = {k: (v or {}).get("type", "string") for k, v in props.items()}
    return out


class StreamParser:
    def __init__(self, fmt: str = "auto", tools: list[dict[str, Any]] | None = None,
                 reasoning: bool = False, starts_in_reasoning: bool = False):
        if fmt not in FORMATS:
            raise ValueError(f"unknown tool-call format {fmt!r}; expected one of {FORMATS}")
        self.fmt = fmt
        self.types = param_types_from_tools(tools)
        # with tools given, a call of a name they do not declare is not a call: it stays text
        self.declared = None if tools is None else set(self.types)
        self.reasoning = reasoning
        self.state = "think" if (reasoning and starts_in_reasoning) else "text"
        self.buf = ""
        self.bare = False  # inside a <function=...> without a <tool_call> wrapper
        self.opens = ["<tool_call>"]
        if fmt in ("auto", "qwen3_coder"):
            self.opens.append("<function=")
        if reasoning:
            self.opens.append("<think>")

    @property
    def tags(self) -> list[str]:
        """Every tag this parser reads: a server whose tokenizer makes one of them a special token must
        decode that token as text for it (decoding with skip_special_tokens would drop it)."""
        out = list(self.opens)
        if "<tool_call>" in self.opens:
            out.append("</tool_call>")
        if "<function=" in self.opens:
            out += ["</function>", "<parameter=", "</parameter>"]
        if "<think>" in self.opens:
            out.append("</think>")
        return out

    def feed(self, delta: str) -> list[Item]:
        self.buf += delta
        out: list[Item] = []
        while True:
            before = (self.state, len(self.buf))
            if self.state == "text":
                self._step_text(out)
            elif self.state == "think":
                self._step_think(out)
            else:
                self._step_call(out)
            if (self.state, len(self.buf)) == before:
                return out

    def close(self) -> list[Item]:
        out: list[Item] = []
        if self.state == "text" and self.buf:
            out.append(Item("content", self.buf))
        elif self.state == "think" and self.buf:
            out.append(Item("reasoning", self.buf))
        elif self.state == "call":
            body = self.buf.removesuffix("</tool_call>")
            calls = self._declared(self._parse_body(body))
            if calls:
                out += [Item("tool_call", call=c) for c in calls]
            else:
                out.append(Item("content", ("" if self.bare else "<tool_call>") + self.buf))
        self.buf = ""
        self.state = "text"
        return out

    # -- states ---------------------------------------------------------------------------------

    def _step_text(self, out: list[Item]) -> None:
        hits = [(self.buf.find(tag), tag) for tag in self.opens]
        hits = [(i, tag) for i, tag in hits if i >= 0]
        if not hits:
            keep = _partial_suffix(self.buf, self.opens)
            if len(self.buf) > keep:
                out.append(Item("content", self.buf[: len(self.buf) - keep]))
                self.buf = self.buf[len(self.buf) - keep :]
            return
        i, tag = min(hits)
        if i:
            out.append(Item("content", self.buf[:i]))
        if tag == "<think>":
            self.state, self.buf = "think", self.buf[i + len(tag) :]
        elif tag == "<function=":
            self.state, self.bare, self.buf = "call", True, self.buf[i:]
        else:
            self.state, self.bare, self.buf = "call", False, self.buf[i + len(tag) :]

    def _step_think(self, out: list[Item]) -> None:
        i = self.buf.find("</think>")
        if i < 0:
            keep = _partial_suffix(self.buf, ["</think>"])
            if len(self.buf) > keep:
                out.append(Item("reasoning", self.buf[: len(self.buf) - keep]))
                self.buf = self.buf[len(self.buf) - keep :]
            return
        if i:
            out.append(Item("reasoning", self.buf[:i]))
        self.state, self.buf = "text", self.buf[i + len("</think>") :]

    def _step_call(self, out: list[Item]) -> None:
        close = "</function>" if self.bare else "</tool_call>"
        i = self.buf.find(close)
        if i < 0:
            return
        body = self.buf[: i + len(close)] if self.bare else self.buf[:i]
        rest = self.buf[i + len(close) :]
        calls = self._declared(self._parse_body(body))
        if calls:
            out += [Item("tool_call", call=c) for c in calls]
        else:
            raw = body if self.bare else f"<tool_call>{body}</tool_call>"
            out.append(Item("content", raw))
        self.state, self.buf = "text", rest

    # -- bodies -----------------------------------------------------------------------------------

    def _declared(self, calls: list[ParsedToolCall]) -> list[ParsedToolCall]:
        """The block's calls, or none when one of them names a tool the request did not declare."""
        if self.declared is not None and any(c.name not in self.declared for c in calls):
            return []
        return calls

    def _parse_body(self, body: str) -> list[ParsedToolCall]:
        text = body.strip()
        if self.fmt in ("auto", "qwen3_coder") and "<function=" in text:
            return self._parse_xml(text)
        if self.fmt in ("auto", "hermes") and text.startswith("{"):
            call = _parse_hermes(text)
            return [call] if call else []
        return []

    def _parse_xml(self, text: str) -> list[ParsedToolCall]:
        calls = []
        for m in _FUNC.finditer(text):
            name = m.group(1).strip()
            types = self.types.get(name, {})
            args: dict[str, Any] = {}
            for p in _PARAM.finditer(m.group(2)):
                pname = p.group(1).strip()
                args[pname] = _convert(_strip_one_newline(p.group(2)), types.get(pname))
            calls.append(ParsedToolCall(name, json.dumps(args, ensure_ascii=False)))
        return calls


# A tool call written as text that no parser turned into a call: an opening tag (with what opens its call),
# a bare Qwen3-Coder function tag, or a bare Hermes JSON call ({"name": ..., "arguments": ...}).
_ATTEMPT = re.compile(r'<tool_call>\s*(?:<function=[^>\n]*>|\{\s*"name"\s*:\s*"[^"\n]*"\s*,\s*"arguments"\s*:)?'
                      r'|<function=[^>\n]*>'
                      r'|\{\s*"name"\s*:\s*"[^"\n]*"\s*,\s*"arguments"\s*:')


def unparsed_calls(text: str | None) -> list[str]:
    """The tool-call attempts left in text (content or reasoning after parsing): each the start of one
    call. A model that writes one meant to call a tool and nothing ran; the agent loop tells it so, and
    train/rewards.py counts them as malformed calls. Text that only names a tool is not one."""
    return [m.group(0) for m in _ATTEMPT.finditer(text or "")]


def parse(text: str, fmt: str = "auto", tools: list[dict[str, Any]] | None = None,
          reasoning: bool = False, starts_in_reasoning: bool = False) -> ParsedText:
    """Parse a whole generated text at once."""
    p = StreamParser(fmt, tools, reasoning, starts_in_reasoning)
    items = p.feed(text) + p.close()
    calls = [it.call for it in items if it.kind == "tool_call" and it.call]
    content = "".join(it.text for it in items if it.kind == "content")
    if calls:
        content = content.strip()
    return ParsedText(content, "".join(it.text for it in items if it.kind == "reasoning"), calls)


def _parse_hermes(text: str) -> ParsedToolCall | None:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _strip_one_newline(value: str) -> str:
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value


def _convert(value: str, json_type: str | None) -> Any:
    """Qwen3-Coder parameter values are raw text; the tool's schema says what they mean."""
    if json_type in (None, "string"):
        return value
    s = value.strip()
    if json_type == "integer" and re.fullmatch(r"[-+]?\d+", s):
        return int(s)
    if json_type == "number":
        try:
            return float(s) if not re.fullmatch(r"[-+]?\d+", s) else int(s)
        except ValueError:
            return value
    if json_type == "boolean" and s.lower() in ("true", "false"):
        return s.lower() == "true"
    if json_type in ("object", "array", "null"):
        try:
            return json.loads(s)
        except json.JSONDecodeError:
            return value
    return value


def _partial_suffix(buf: str, tags: list[str]) -> int:
    """Length of the longest suffix of `buf` that is a proper prefix of one of `tags`."""
    best = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(buf)), best, -1):
            if buf.endswith(tag[:n]):
                best = n
                break
    return best
