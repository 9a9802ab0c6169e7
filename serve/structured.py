"""Structured output that holds: grammars for forced tool calls and `response_format`, enforced per token.

The library is xgrammar (chosen over llguidance by measurement: bench/structured.py, figures in
BENCHMARKS.md). A request's grammar is compiled once on a prepare thread (cached per tools/schema),
each sequence gets its own matcher, and at every step the engine masks that sequence's logits row to
the tokens its grammar allows (`mask_rows`): constrained and free sequences share one batch. Grammars
are xgrammar structural tags (a JSON tree of sequences, alternatives, literals and JSON schemas):

- tool_choice "required" or a named function: the prompt already ends with the opening of a call
  (`ChatFormat.forced_call_prefix`); the grammar continues it in the checkpoint's own format, so the
  chat-format parser reads it back as `tool_calls`: the name one of the offered tools (or the named
  one), the arguments valid against that tool's JSON schema (Hermes: JSON; Qwen3-Coder: one
  `<parameter=...>` block per property, xgrammar's `qwen_xml` style), the call closed; with
  parallel_tool_calls, more whole calls may follow, one per line.
- response_format json_object (a JSON object) or json_schema (valid against the schema); with tools
  offered and tool_choice "auto", either that JSON or tool calls.

JSON whitespace is limited to one character per gap, so a model cannot loop on blanks. After the
grammar completes, only the checkpoint's stop tokens are allowed.
"""

from __future__ import annotations

import json
import threading
from functools import cached_property
from pathlib import Path
from typing import Any

MAX_BLANKS = 1  # whitespace characters allowed between JSON tokens


class GrammarError(ValueError):
    """A schema the grammar library cannot take: an OpenAI-style 400 for the request's `param`."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


class Constraint:
    """A compiled grammar; each sequence that follows it gets its own matcher."""

    def __init__(self, compiled: Any, what: str):
        self.compiled, self.what = compiled, what

    def matcher(self):
        import xgrammar as xgr

        return xgr.GrammarMatcher(self.compiled)

    def __repr__(self) -> str:
        return f"Constraint({self.what})"


class Grammars:
    """Per server: the vocabulary as xgrammar sees it (built on first use) and a caching compiler."""

    def __init__(self, model_dir: str | Path, stop_token_ids: list[int], tool_format: str):
        self.dir, self.stop_token_ids, self.tool_format = Path(model_dir), list(stop_token_ids), tool_format
        self._lock = threading.Lock()

    @cached_property
    def compiler(self):
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast

        with self._lock:
            tok = PreTrainedTokenizerFast(tokenizer_file=str(self.dir / "tokenizer.json"))
            vocab = _model_vocab_size(self.dir) or len(tok)
            info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab, stop_token_ids=self.stop_token_ids)
            # One compile thread: the engine thread wants the cores.
            return xgr.GrammarCompiler(info, max_threads=1)

    def compile(self, fmt: dict[str, Any], what: str, param: str) -> Constraint:
        tag = json.dumps({"type": "structural_tag", "format": fmt}, ensure_ascii=False)
        try:
            return Constraint(self.compiler.compile_structural_tag(tag), what)
        except (RuntimeError, ValueError) as e:
            raise GrammarError(f"{param}: cannot build a grammar for it: {_short(e)}", param) from None

    # -- what requests ask for ------------------------------------------------------------------------

    def json(self, schema: dict[str, Any] | None) -> Constraint:
        """response_format: any JSON object (schema None: json_object) or a value valid against `schema`."""
        return self.compile(json_format(schema), "json_object" if schema is None else "json_schema",
                            "response_format")

    def forced_call(self, tools: list[dict[str, Any]], name: str | None, parallel: bool) -> Constraint:
        """The rest of a call whose opening (`forced_call_prefix(name)`) ends the prompt, then, when
        `parallel`, any number of further calls."""
        fns = [t.get("function", t) for t in tools]
        first = self._rest(next(f for f in fns if f["name"] == name)) if name else \
            {"type": "or", "elements": [self._rest(f, with_name=True) for f in fns]}
        if parallel:
            more = {"type": "sequence", "elements": [_const("\n"), self._any_call(
                [f for f in fns if f["name"] == name] if name else fns)]}
            first = {"type": "sequence", "elements": [first, {"type": "star", "content": more}]}
        return self.compile(first, "tool_call", "tools")

    def calls_or_json(self, tools: list[dict[str, Any]], schema: dict[str, Any] | None, parallel: bool) -> Constraint:
        """tool_choice auto with response_format: tool calls, or the JSON answer."""
        fns = [t.get("function", t) for t in tools]
        calls = {"type": "tags_with_separator", "tags": [self._tag(f) for f in fns], "separator": "\n",
                 "at_least_one": True, "stop_after_first": not parallel}
        return self.compile({"type": "or", "elements": [calls, json_format(schema)]}, "tool_call or json",
                            "response_format")

    # -- the checkpoint's tool-call format ------------------------------------------------------------

    def _args(self, fn: dict[str, Any]) -> dict[str, Any]:
        schema = fn.get("parameters") or {"type": "object"}
        if self.tool_format != "qwen3_coder":
            return {"type": "json_schema", "json_schema": bounded_strings(schema), "max_whitespace_cnt": MAX_BLANKS}
        # One block per property, in the schema's order, each value alone on its lines as the template writes
        # it (xgrammar's own qwen_xml style lets any blank stand for those newlines, which the parser keeps).
        required = set(schema.get("required") or [])
        blocks = []
        for key, prop in (schema.get("properties") or {}).items():
            block = {"type": "tag", "begin": f"<parameter={key}>\n", "content": _xml_value(prop or {}),
                     "end": "\n</parameter>\n"}
            blocks.append(block if key in required else {"type": "optional", "content": block})
        return {"type": "sequence", "elements": blocks} if blocks else _const("")

    def _tag(self, fn: dict[str, Any]) -> dict[str, Any]:
        name = fn["name"]
        if self.tool_format == "qwen3_coder":
            return {"type": "tag", "begin": f"<tool_call>\n<function={name}>\n", "content": self._args(fn),
                    "end": "</function>\n</tool_call>"}
        return {"type": "tag", "begin": '<tool_call>\n{"name": ' + json.dumps(name, ensure_ascii=False)
                + ', "arguments": ', "content": self._args(fn), "end": "}\n</tool_call>"}

    def _any_call(self, fns: list[dict[str, Any]]) -> dict[str, Any]:
        tags = [self._tag(f) for f in fns]
        return tags[0] if len(tags) == 1 else {"type": "or", "elements": tags}

    def _rest(self, fn: dict[str, Any], with_name: bool = False) -> dict[str, Any]:
        """What follows forced_call_prefix: (the name and its closing,) the arguments, the call's end."""
        name = fn["name"]
        coder = self.tool_format == "qwen3_coder"
        parts = []
        if with_name:
            parts.append(_const(f"{name}>\n" if coder else json.dumps(name, ensure_ascii=False)[1:]
                                + ', "arguments": '))
        parts += [self._args(fn), _const("</function>\n</tool_call>" if coder else "}\n</tool_call>")]
        return {"type": "sequence", "elements": parts}


def json_format(schema: dict[str, Any] | None) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"type": "object"} if schema is None else bounded_strings(schema),
            "max_whitespace_cnt": MAX_BLANKS}


def bounded_strings(schema: Any) -> Any:
    """xgrammar 0.2.8 writes a string with minLength/maxLength as any characters but quote, backslash and
    newline, raw control characters included, which no JSON parser takes: such strings become the same
    length bounds as a pattern over characters JSON allows unescaped (so they cannot hold escapes)."""
    if isinstance(schema, list):
        return [bounded_strings(x) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: bounded_strings(v) for k, v in schema.items()}
    if (out.get("type") == "string" and ("minLength" in out or "maxLength" in out)
            and not {"pattern", "format", "enum", "const"} & out.keys()):
        low, high = out.pop("minLength", 0), out.pop("maxLength", "")
        out["pattern"] = f'^[^"\\\\\\u0000-\\u001f]{{{low},{high}}}$'
    return out


def _xml_value(prop: dict[str, Any]) -> dict[str, Any]:
    """A Qwen3-Coder parameter value: strings raw (the parser keeps them as text), anything else JSON."""
    choices = prop.get("enum", [prop["const"]] if "const" in prop else None)
    if choices and all(isinstance(v, str) for v in choices):
        return {"type": "or", "elements": [_const(v) for v in choices]} if len(choices) > 1 else _const(choices[0])
    if prop.get("type") == "string" and not choices:
        return {"type": "any_text"}
    return {"type": "json_schema", "json_schema": prop, "max_whitespace_cnt": MAX_BLANKS}


def mask_rows(logits_BV, matchers: list) -> None:
    """Set to -inf, in place, every token a row's grammar forbids now (rows whose matcher is None are free)."""
    import xgrammar as xgr

    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return
    bitmask = xgr.allocate_token_bitmask(logits_BV.shape[0], logits_BV.shape[1])
    for i in rows:
        matchers[i].fill_next_token_bitmask(bitmask, i)
    xgr.apply_token_bitmask_inplace(logits_BV, bitmask, indices=rows)


def _const(text: str) -> dict[str, Any]:
    return {"type": "const_string", "value": text}


def _model_vocab_size(model_dir: Path) -> int | None:
    """The logits' width: the model's vocabulary, which may be padded past the tokenizer's."""
    try:
        cfg = json.loads((model_dir / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size")


def _short(e: Exception) -> str:
    """xgrammar's C++ errors start with a timestamp and a source path: keep the message."""
    text = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
    return text.split(": ", 1)[1] if text.startswith("[") and ": " in text else text
