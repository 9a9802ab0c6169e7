"""The one place where messages + tools become token ids, and generated text becomes content + tool calls.

Rendering uses the checkpoint's own chat template (`chat_template.jinja`, or `chat_template` in
`tokenizer_config.json`) in a Jinja environment set up as transformers sets it up (sandboxed,
trim_blocks/lstrip_blocks, loopcontrols, its `tojson`, `raise_exception`, `strftime_now`), then the
text is tokenized with the checkpoint's `tokenizer.json` without adding special tokens — so the ids
equal `tokenizer.apply_chat_template(..., tokenize=True)` without importing transformers. As vLLM
does, tool-call arguments that arrive as JSON text are parsed into objects before rendering, since
templates iterate over them.

Parsing delegates to agent.toolcall_text (the same parser the agent uses as its fallback); the format
(hermes | qwen3_coder) comes from the template unless given, and `<think>` is split out as reasoning
when the template uses it. Generated text is decoded with special tokens skipped, except the parser's
own tags where a checkpoint made them special tokens (`kept_special_ids`): those reach the parser, and
client-visible content loses only what the parser consumed. Training renders conversations with this
same class.
"""

from __future__ import annotations

import copy
import json
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

from agent.toolcall_text import StreamParser, parse

REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class ChatFormatError(ValueError):
    """A conversation the template refuses (raise_exception) or that cannot be rendered."""


def detect_tool_format(template: str) -> str:
    return "qwen3_coder" if "<function=" in template else "hermes"


class ChatFormat:
    def __init__(self, model_dir: str | Path, tool_format: str | None = None):
        from tokenizers import Tokenizer

        self.dir = Path(model_dir)
        tok = self.dir / "tokenizer.json"
        if not tok.is_file():  # tokenizers raises a bare Exception("No such file or directory") here
            raise ChatFormatError(f"{self.dir} has no tokenizer.json (a Hugging Face fast tokenizer is needed)")
        try:
            self.tokenizer = Tokenizer.from_file(str(tok))
        except Exception as e:  # the Rust side raises plain Exception for unreadable files
            raise ChatFormatError(f"cannot read {tok}: {e}") from e
        self.config = _read_json(self.dir / "tokenizer_config.json")
        self.template = self._load_template()
        self.tool_format = tool_format or detect_tool_format(self.template)
        self.reasoning = "<think>" in self.template
        self.special_tokens = {k: _token_text(v) for k, v in self.config.items()
                               if k.endswith("_token") and v is not None}
        gen = _read_json(self.dir / "generation_config.json")
        eos = gen.get("eos_token_id", self.config.get("eos_token_id"))
        ids = eos if isinstance(eos, list) else [eos] if eos is not None else []
        if self.special_tokens.get("eos_token"):
            ids.append(self.tokenizer.token_to_id(self.special_tokens["eos_token"]))
        self.stop_token_ids = sorted({i for i in ids if i is not None})
        self.generation_defaults = {k: gen[k] for k in ("temperature", "top_p", "top_k") if k in gen}
        # What render() passes itself: chat_template_kwargs may not set these.
        self.reserved_kwargs = {"messages", "tools", "add_generation_prompt", *self.special_tokens}

    @cached_property
    def longest_token(self) -> int:
        """The most characters one token can stand for (the vocabulary's longest entry: in byte-level BPE
        one character per byte), so a text has at least len(text) / longest_token tokens."""
        return max(map(len, self.tokenizer.get_vocab(with_added_tokens=True)), default=1)

    def _load_template(self) -> str:
        path = self.dir / "chat_template.jinja"
        if path.exists():
            return path.read_text()
        tpl = self.config.get("chat_template")
        if isinstance(tpl, list):  # named templates: prefer "tool_use"-capable default
            named = {t["name"]: t["template"] for t in tpl}
            tpl = named.get("default") or next(iter(named.values()))
        if not tpl:
            raise ChatFormatError(f"{self.dir} has no chat template")
        return tpl

    @cached_property
    def _compiled(self):
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str):
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            return env.from_string(self.template)
        except jinja2.TemplateSyntaxError as e:
            raise ChatFormatError(f"the chat template does not compile: {e}") from None

    # -- rendering ------------------------------------------------------------------------------------

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
               add_generation_prompt: bool = True, **template_kwargs: Any) -> str:
        import jinja2

        msgs = prepare_messages(messages)
        try:
            return self._compiled.render(messages=msgs, tools=copy.deepcopy(tools) if tools else None,
                                         add_generation_prompt=add_generation_prompt,
                                         **self.special_tokens, **template_kwargs)
        except jinja2.TemplateError as e:
            raise ChatFormatError(f"the chat template rejected the conversation: {e}") from None
        except (TypeError, ValueError, LookupError, AttributeError) as e:  # e.g. a template kwarg of the wrong type
            raise ChatFormatError(f"the chat template cannot render this conversation: {type(e).__name__}: {e}") \
                from None

    def encode(self, text: str) -> list[int]:
        # encode_batch releases the GIL (encode does not): the server tokenises on worker threads while its
        # event loop goes on answering.
        return self.tokenizer.encode_batch([text], add_special_tokens=False)[0].ids

    def render_ids(self, messages, tools=None, add_generation_prompt: bool = True, **kw: Any) -> list[int]:
        return self.encode(self.render(messages, tools, add_generation_prompt, **kw))

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    # -- parsing --------------------------------------------------------------------------------------

    def stream_parser(self, tools: list[dict[str, Any]] | None, *, parse_tools: bool = True,
                      prompt_text: str = "") -> StreamParser:
        """A parser for one response; tool-call tags are left as text when `parse_tools` is False."""
        starts_thinking = self.reasoning and prompt_text.rstrip().endswith("<think>")
        p = StreamParser(self.tool_format, tools, reasoning=self.reasoning, starts_in_reasoning=starts_thinking)
        if not parse_tools:
            p.opens = [t for t in p.opens if t == "<think>"]
        return p

    @cached_property
    def _special_ids(self) -> dict[str, int]:
        """Special added tokens by their text (what decoding with skip_special_tokens drops)."""
        return {t.content: i for i, t in self.tokenizer.get_added_tokens_decoder().items() if t.special}

    def kept_special_ids(self, parser: StreamParser) -> frozenset[int]:
        """The special tokens a response must decode as text for `parser`: its tags, where this checkpoint
        made them special tokens (some mark `<tool_call>` special; dropped, calls came back as content)."""
        return frozenset(self._special_ids[t] for t in parser.tags if t in self._special_ids)

    def parse(self, text: str, tools: list[dict[str, Any]] | None = None):
        return parse(text, self.tool_format, tools, reasoning=self.reasoning)

    def forced_call_prefix(self, name: str | None) -> str:
        """Text that opens a tool call (for tool_choice "required" or a named function): generation
        continues from it, so the model can only answer with a call."""
        if self.tool_format == "qwen3_coder":
            return "<tool_call>\n" + (f"<function={name}>\n" if name else "<function=")
        return "<tool_call>\n" + (f'{{"name": "{name}", "arguments": ' if name else '{"name": "')


def prepare_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What templates expect: content as text, tool-call arguments as objects, reasoning aliased."""
    out = []
    for m in copy.deepcopy(messages):
        content = m.get("content")
        if isinstance(content, list):  # OpenAI content parts: keep the text ones
            m["content"] = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        elif content is None:
            m["content"] = ""
        for tc in m.get("tool_calls") or []:
            fn = tc.get("function") or {}
            if isinstance(fn.get("arguments"), str):
                try:
                    fn["arguments"] = json.loads(fn["arguments"]) if fn["arguments"].strip() else {}
                except json.JSONDecodeError:
                    pass  # leave it as text: templates that print strings still work
        reasoning = next((m[k] for k in REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def _token_text(v: Any) -> Any:
    return v.get("content") if isinstance(v, dict) else v
