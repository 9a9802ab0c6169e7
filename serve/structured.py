"""Structured output that holds: grammars for forced tool calls and `response_format`, enforced per token.

The library is llguidance, chosen over xgrammar by measurement (bench/structured.py, figures in
BENCHMARKS.md): at Qwen3's 151,936-token vocabulary it compiles a tool's grammar and computes masks many
times faster. A request's grammar (Lark with embedded JSON schemas) is compiled once on a prepare thread
into a template matcher; each sequence gets a copy, and at every step the engine masks that sequence's
logits row to the tokens its grammar allows (`mask_rows`): constrained and free sequences share one
batch. What the grammars say:

- tool_choice "required" or a named function: the prompt already ends with the opening of a call
  (`ChatFormat.forced_call_prefix`); the grammar continues it in the checkpoint's own format, so the
  chat-format parser reads it back as `tool_calls`: the name one of the offered tools (or the named
  one), the arguments valid against that tool's JSON schema (Hermes: compact JSON; Qwen3-Coder: one
  `<parameter=...>` block per property in the schema's order, required ones always there, string
  values raw, other values JSON), the call closed; with parallel_tool_calls, more whole calls may
  follow, one per line.
- response_format json_object (a JSON object) or json_schema (valid against the schema); with tools
  offered and tool_choice "auto", either that JSON or tool calls.

JSON is written as `json.dumps` writes it (", " and ": ", no other whitespace): a model cannot loop on
blanks. Tool arguments are constrained by `tool_arguments(schema)`: integers and numbers the schema leaves
unbounded are bounded to what every JSON client reads exactly (±2**53 - 1), and objects that do not say
otherwise take no undeclared properties, so a call cannot run past max_tokens on an extra key. Tags that are single added tokens (`<tool_call>`) are matched as those tokens, as the tokenizer
would produce them. After the grammar completes, only the checkpoint's stop tokens are allowed.
"""

from __future__ import annotations

import json
import threading
import warnings
from collections import OrderedDict
from functools import cache, cached_property
from pathlib import Path
from typing import Any

COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CACHE_SIZE = 64  # compiled grammars kept (agents send the same tools on every turn)


class GrammarError(ValueError):
    """A schema the grammar library cannot take: an OpenAI-style 400 for the request's `param`."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


class Constraint:
    """A compiled grammar; each sequence that follows it gets its own matcher (a cheap copy)."""

    def __init__(self, template: Any, what: str):
        self.template, self.what = template, what

    def matcher(self):
        return self.template.deep_copy()

    def __repr__(self) -> str:
        return f"Constraint({self.what})"


class Grammars:
    """Per server: the vocabulary as llguidance sees it (built on first use) and compiled grammars, cached."""

    def __init__(self, model_dir: str | Path, stop_token_ids: list[int], tool_format: str):
        self.dir, self.stop_token_ids, self.tool_format = Path(model_dir), list(stop_token_ids), tool_format
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, Constraint] = OrderedDict()

    @cached_property
    def tokenizer(self):
        import llguidance

        text = (self.dir / "tokenizer.json").read_text()
        return llguidance.LLTokenizer(
            text, n_vocab=_model_vocab_size(self.dir), eos_token=self.stop_token_ids
        )

    @cached_property
    def added_tokens(self) -> dict[str, int]:
        """Added tokens' texts (`<tool_call>`, ...): llguidance matches them as tokens, not as their text."""
        spec = json.loads((self.dir / "tokenizer.json").read_text())
        return {t["content"]: t["id"] for t in spec.get("added_tokens", []) if len(t["content"]) > 1}

    def compile(self, lark: str, what: str, param: str) -> Constraint:
        import llguidance

        with self._lock:
            if (hit := self._cache.get(lark)) is not None:
                self._cache.move_to_end(lark)
                return hit
        matcher = llguidance.LLMatcher(self.tokenizer, lark, log_level=0)
        if matcher.is_error():
            raise GrammarError(
                f"{param}: cannot build a grammar for it: {_short(matcher.get_error())}", param
            )
        c = Constraint(matcher, what)
        with self._lock:
            self._cache[lark] = c
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return c

    # -- what requests ask for ------------------------------------------------------------------------

    def json(self, schema: dict[str, Any] | None) -> Constraint:
        """response_format: any JSON object (schema None: json_object) or a value valid against `schema`."""
        what = "json_object" if schema is None else "json_schema"
        return self.compile(f"start: {_json(schema)}\n", what, "response_format")

    def forced_call(self, tools: list[dict[str, Any]], name: str | None, parallel: bool) -> Constraint:
        """The rest of a call whose opening (`forced_call_prefix(name)`) ends the prompt, then, when
        `parallel`, any number of further calls (of the named function, if one is named)."""
        fns = [t.get("function", t) for t in tools]
        if name:
            fns = [f for f in fns if f["name"] == name]
        rules = [self._args_rule(i, f) for i, f in enumerate(fns)]
        rules += [self._call_rule(i, f) for i, f in enumerate(fns)]
        end = self._lit(
            "</function>\n</tool_call>" if self.tool_format == "qwen3_coder" else "}\n</tool_call>"
        )
        if name:
            first = f"a0 {end}"
        else:
            first = " | ".join(
                f"{self._lit(self._name_rest(f['name']))} a{i} {end}" for i, f in enumerate(fns)
            )
        calls = " | ".join(f"c{i}" for i in range(len(fns)))
        start = (
            f"start: first{' more' if parallel else ''}\nfirst: {first}\nmore: ({self._lit(chr(10))} call)*\n"
        )
        return self.compile(start + f"call: {calls}\n" + "".join(rules), "tool_call", "tools")

    def calls_or_json(
        self, tools: list[dict[str, Any]], schema: dict[str, Any] | None, parallel: bool
    ) -> Constraint:
        """tool_choice auto with response_format: tool calls, or the JSON answer."""
        fns = [t.get("function", t) for t in tools]
        rules = [self._args_rule(i, f) for i, f in enumerate(fns)] + [
            self._call_rule(i, f) for i, f in enumerate(fns)
        ]
        calls = " | ".join(f"c{i}" for i in range(len(fns)))
        more = f" ({self._lit(chr(10))} call)*" if parallel else ""
        lark = f"start: call{more} | answer\ncall: {calls}\nanswer: {_json(schema)}\n" + "".join(rules)
        return self.compile(lark, "tool_call or json", "response_format")

    # -- the checkpoint's tool-call format ------------------------------------------------------------

    def _name_rest(self, name: str) -> str:
        """What follows the required-call prefix up to the arguments: the name and its closing."""
        return (
            f"{name}>\n"
            if self.tool_format == "qwen3_coder"
            else json.dumps(name, ensure_ascii=False)[1:] + ', "arguments": '
        )

    def _call_rule(self, i: int, fn: dict[str, Any]) -> str:
        name = fn["name"]
        if self.tool_format == "qwen3_coder":
            head, end = f"<tool_call>\n<function={name}>\n", "</function>\n</tool_call>"
        else:
            head = '<tool_call>\n{"name": ' + json.dumps(name, ensure_ascii=False) + ', "arguments": '
            end = "}\n</tool_call>"
        return f"c{i}: {self._lit(head)} a{i} {self._lit(end)}\n"

    def _args_rule(self, i: int, fn: dict[str, Any]) -> str:
        schema = tool_arguments(fn.get("parameters") or {"type": "object"})
        if self.tool_format != "qwen3_coder":
            return f"a{i}: {_json(schema)}\n"
        # One block per property, in the schema's order, as the template writes them; a string value ends at
        # the first </parameter> (where the parser ends it), any other value is JSON.
        required = set(schema.get("required") or [])
        blocks, rules = [], []
        for k, (key, prop) in enumerate((schema.get("properties") or {}).items()):
            prop = prop or {}
            rule = f"p{i}_{k}"
            choices = prop.get("enum", [prop["const"]] if "const" in prop else None)
            close = self._lit("\n</parameter>\n")
            if choices and all(isinstance(v, str) for v in choices):
                value = "(" + " | ".join(self._lit(v) for v in choices) + f") {close}"
            elif (
                prop.get("type") == "string" and not choices and ("maxLength" in prop or "minLength" in prop)
            ):
                # Bounded: one line without "<" (the parser strips a newline at either end, which would shorten it).
                low, high = int(prop.get("minLength", 0)), prop.get("maxLength", "")
                value = f"/[^<\\n]{{{low},{high}}}/ {close}"
            elif prop.get("type") == "string" and not choices:  # pattern/format are not enforced on raw text
                rules.append(f"t{i}_{k}[lazy]: /(?s:.*)<\\/parameter>/\n")
                value = f"t{i}_{k} {self._lit(chr(10))}"
            else:
                value = f"{_json(prop)} {close}"
            opening = self._lit(f"<parameter={key}>\n")
            rules.append(f"{rule}: {opening} {value}\n")
            blocks.append(rule if key in required else f"{rule}?")
        return f"a{i}: {' '.join(blocks) or self._lit('')}\n" + "".join(rules)

    def _lit(self, text: str) -> str:
        """A Lark literal for `text`, with added tokens (`<tool_call>`) as token references."""
        parts, rest = [], text
        while rest:
            at = min(((rest.find(t), t) for t in self.added_tokens if t in rest), default=None)
            if at is None:
                parts.append(json.dumps(rest, ensure_ascii=False))
                break
            pos, tok = at
            if pos:
                parts.append(json.dumps(rest[:pos], ensure_ascii=False))
            parts.append(f"<[{self.added_tokens[tok]}]>")
            rest = rest[pos + len(tok) :]
        return " ".join(parts) or '""'


SAFE_INTEGER = 2**53 - 1  # the largest integer every JSON client reads exactly (JavaScript's Number.MAX_SAFE_INTEGER)


def tool_arguments(schema: dict[str, Any]) -> dict[str, Any]:
    """A tool's parameter schema as its calls are constrained: integers (and numbers) without bounds are
    bounded to ±SAFE_INTEGER (a sampled 49-digit integer parses as nothing a client can use), and objects
    that do not say otherwise take no properties beyond their declared ones (JSON Schema allows any by
    default, and a sampled extra key, with whatever value follows it, can run a call past max_tokens, so
    that it never closes and is not a call). A copy; the request's schema is not changed."""
    if isinstance(schema, list):
        return [tool_arguments(s) for s in schema]  # type: ignore[return-value]
    if not isinstance(schema, dict):
        return schema
    out = {k: (tool_arguments(v) if k in _SUBSCHEMAS else v) for k, v in schema.items()}
    for k in ("properties", "$defs", "definitions", "patternProperties"):
        if isinstance(out.get(k), dict):
            out[k] = {name: tool_arguments(sub) for name, sub in out[k].items()}
    types = out.get("type") if isinstance(out.get("type"), list) else [out.get("type")]
    if ("integer" in types or "number" in types) and not any(
            b in out for b in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "enum", "const")):
        out["minimum"], out["maximum"] = -SAFE_INTEGER, SAFE_INTEGER
    if "object" in types and "additionalProperties" not in out and "patternProperties" not in out:
        out["additionalProperties"] = False
    return out


_SUBSCHEMAS = ("items", "prefixItems", "anyOf", "oneOf", "allOf", "not", "additionalProperties", "contains",
               "if", "then", "else")


def _json(schema: dict[str, Any] | None) -> str:
    schema = {"type": "object"} if schema is None else schema
    return "%json " + json.dumps({**schema, "x-guidance": COMPACT}, ensure_ascii=False)


def mask_rows(logits_BV, matchers: list) -> None:
    """Set to -inf, in place, every token a row's grammar forbids now (rows whose matcher is None are free)."""
    import torch

    allocate_token_bitmask, fill_next_token_bitmask = _bitmask_functions()
    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return
    V = logits_BV.shape[1]
    bitmask = allocate_token_bitmask(len(rows), V)
    for j, i in enumerate(rows):
        # On the engine thread, one mask after another: llguidance's parallel executor would add a second
        # thread pool next to torch's, the pattern that costs every op a futex wake on a small CPU.
        fill_next_token_bitmask(matchers[i], bitmask, j)
        if matchers[i].is_error():
            raise RuntimeError(f"the request's grammar failed: {_short(matchers[i].get_error())}")
    allowed = (
        bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)
    ) & 1  # [R, W, 32]: bit b of word w allows token 32 w + b
    allowed = allowed.reshape(len(rows), -1)[:, :V].bool().to(logits_BV.device)
    for j, i in enumerate(rows):  # in place, row by row (an indexed put copies the rows twice)
        logits_BV[i].masked_fill_(~allowed[j], float("-inf"))


@cache  # once: a filter added at every step would invalidate every module's warning registry each time
def _bitmask_functions():
    """llguidance.torch's two mask functions. Importing it runs its @torch.compile, which loads torch's
    inductor, which imports torch.utils.mkldnn, whose classes still use torch.jit.script_method: 14
    DeprecationWarnings about torch's own code, which nobody here can act on. That one message is
    ignored (a process-wide filter, not catch_warnings: this runs on the engine thread, and swapping the
    filter list under other threads is not safe)."""
    warnings.filterwarnings("ignore", message=r"`torch\.jit\.script_method` is deprecated",
                            category=DeprecationWarning)
    from llguidance.torch import allocate_token_bitmask, fill_next_token_bitmask

    return allocate_token_bitmask, fill_next_token_bitmask


def _model_vocab_size(model_dir: Path) -> int | None:
    """The logits' width: the model's vocabulary, which may be padded past the tokenizer's."""
    try:
        cfg = json.loads((model_dir / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size")


def _short(error: str) -> str:
    """llguidance's errors carry the whole grammar after the message: keep the message."""
    return (error or "unknown error").strip().splitlines()[0][:500]
