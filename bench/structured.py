"""Structured decoding on CPU: xgrammar against llguidance, for choosing the library (issue 15, part 2).

For each tokenizer size (byte-level BPEs trained on the standard library, like the tiny test checkpoints;
151,936 is Qwen3's vocabulary size) and each library, measures
- compile: the grammar of one forced Hermes tool call (`<tool_call>` JSON with a name and arguments
  valid against a tool's JSON schema), from nothing to a matcher ready for its first mask, median of 5;
- mask: the time to fill the allowed-token masks of 8 sequences in one batch step, apply them to a
  [8, vocab] logits tensor and advance each matcher by one token, walking a valid call token by token
  (what the engine pays per decode step at batch 8; for llguidance, serve/structured.py's own mask_rows).

- with --engine: the native engine's decode step at batch 8 on a tiny checkpoint, all sequences under a
  JSON-schema grammar against none, alternating (the grammar's cost per step inside the engine).

    flock /tmp/composer-bench.lock nice -n 5 python bench/structured.py [--vocab 1024 32768 151936] [--engine]
                                                                         [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import sysconfig
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TOOL = {
    "type": "object",
    "properties": {
        "path": {"type": "string", "description": "file to edit"},
        "start_line": {"type": "integer", "minimum": 1},
        "end_line": {"type": "integer", "minimum": 1},
        "mode": {"type": "string", "enum": ["replace", "insert", "delete"]},
        "text": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
    },
    "required": ["path", "start_line", "mode"],
    "additionalProperties": False,
}
ARGS = {
    "path": "serve/engine/sampling.py",
    "start_line": 12,
    "end_line": 40,
    "mode": "replace",
    "text": "def sample(logits, params):\n    return int(logits.argmax())\n",
    "tags": ["fix", "speed"],
}
CALL = '<tool_call>\n{"name": "edit_file", "arguments": ' + json.dumps(ARGS) + "}\n</tool_call>"
BATCH = 8


def tokenizer(vocab: int):
    """A byte-level BPE of this size with the tiny checkpoints' special and added tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    from serve.tiny import SPECIAL_TOKENS, TEXT_TOKENS

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts, total = [], 0
    for path in sorted(stdlib.rglob("*.py")):
        texts.append(path.read_text(errors="replace"))
        total += len(texts[-1])
        if total > max(400_000, vocab * 400):
            break
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab - len(TEXT_TOKENS),
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TEXT_TOKENS])
    return tok


def lark_grammar() -> str:
    # <tool_call> is an added token: llguidance names such tokens in angle brackets (their text is not bytes)
    return (
        'start: <tool_call> "\\n{\\"name\\": \\"edit_file\\", \\"arguments\\": " args "}\\n" </tool_call>\n'
        f"args: %json {json.dumps(TOOL)}\n"
    )


def bench_llguidance(tok, ids: list[int]) -> dict:
    import llguidance
    import llguidance.torch as llt

    from serve.structured import mask_rows

    t0 = time.perf_counter()
    lltok = llguidance.LLTokenizer(tok.to_str(), eos_token=tok.token_to_id("<|im_end|>"))
    tokenizer_s = time.perf_counter() - t0
    compiles = []
    for _ in range(5):
        t0 = time.perf_counter()
        m = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_lark(lark_grammar()))
        mask = llt.allocate_token_bitmask(1, lltok.vocab_size)
        llt.fill_next_token_bitmask(m, mask, 0)
        compiles.append(time.perf_counter() - t0)
        assert not m.is_error(), m.get_error()
    matchers = [
        llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_lark(lark_grammar()))
        for _ in range(BATCH)
    ]
    logits = torch.zeros(BATCH, lltok.vocab_size)
    steps = []
    for t in ids:
        t0 = time.perf_counter()
        mask_rows(
            logits, matchers
        )  # what the engine runs per step (serve/structured.py): fill, unpack, apply
        for m in matchers:
            assert m.consume_token(t), m.get_error()
        steps.append(time.perf_counter() - t0)
    assert all(m.is_accepting() for m in matchers)
    return {
        "tokenizer_s": tokenizer_s,
        "compile_ms": 1e3 * statistics.median(compiles),
        "mask_step_ms": 1e3 * statistics.mean(steps),
        "mask_step_p99_ms": 1e3 * sorted(steps)[int(0.99 * len(steps))],
    }


def bench_xgrammar(tok, ids: list[int]) -> dict:
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast

    t0 = time.perf_counter()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>")
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=tok.get_vocab_size())
    tokenizer_s = time.perf_counter() - t0
    compiles = []
    for _ in range(5):
        compiler = xgr.GrammarCompiler(info, cache_enabled=False)  # a fresh compile each time
        t0 = time.perf_counter()
        grammar = xgr.Grammar.concat(
            xgr.Grammar.from_ebnf('root ::= "<tool_call>\\n{\\"name\\": \\"edit_file\\", \\"arguments\\": "'),
            xgr.Grammar.from_json_schema(json.dumps(TOOL), any_whitespace=False),
            xgr.Grammar.from_ebnf('root ::= "}\\n</tool_call>"'),
        )
        compiled = compiler.compile_grammar(grammar)
        m = xgr.GrammarMatcher(compiled)
        mask = xgr.allocate_token_bitmask(1, info.vocab_size)
        m.fill_next_token_bitmask(mask, 0)
        compiles.append(time.perf_counter() - t0)
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(BATCH)]
    batch = xgr.BatchGrammarMatcher()
    mask = xgr.allocate_token_bitmask(BATCH, info.vocab_size)
    logits = torch.zeros(BATCH, info.vocab_size)
    steps = []
    for t in ids:
        t0 = time.perf_counter()
        batch.batch_fill_next_token_bitmask(matchers, mask)
        xgr.apply_token_bitmask_inplace(logits, mask)
        for m in matchers:
            assert m.accept_token(t), t
        steps.append(time.perf_counter() - t0)
    return {
        "tokenizer_s": tokenizer_s,
        "compile_ms": 1e3 * statistics.median(compiles),
        "mask_step_ms": 1e3 * statistics.mean(steps),
        "mask_step_p99_ms": 1e3 * sorted(steps)[int(0.99 * len(steps))],
    }


def bench_engine(rounds: int = 3, tokens: int = 48) -> dict:
    """The native engine on a tiny checkpoint: 8 sequences decoding together, all under a JSON-schema grammar
    (a free string, so none ends early) against none, alternating; the difference per decode step is the
    grammar's cost inside the engine (masks filled, applied, matchers advanced)."""
    import asyncio
    import tempfile

    from serve.chat_format import ChatFormat
    from serve.engine.base import SamplingParams
    from serve.engine.native import EngineConfig, NativeEngine
    from serve.structured import Grammars
    from serve.tiny import build_tiny_checkpoint

    ckpt = build_tiny_checkpoint(Path(tempfile.mkdtemp()) / "tiny")
    chat = ChatFormat(ckpt)
    grammar = Grammars(ckpt, chat.stop_token_ids, chat.tool_format).json(
        {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
    )
    prompt = chat.render_ids([{"role": "user", "content": "Write some JSON."}])

    async def run(engine, constrained: bool) -> tuple[float, int]:
        async def one(i: int) -> int:
            params = SamplingParams(max_tokens=tokens, seed=i, grammar=grammar if constrained else None)
            return len([t async for t in engine.generate(prompt, params)])

        start = time.perf_counter()
        counts = await asyncio.gather(*(one(i) for i in range(BATCH)))
        return time.perf_counter() - start, min(counts)

    async def main() -> dict:
        engine = NativeEngine(str(ckpt), EngineConfig(dtype="float32"))
        await run(engine, True)  # warm-up
        times: dict[bool, list[float]] = {True: [], False: []}
        steps = tokens
        for _ in range(rounds):
            for constrained in (False, True):
                dt, n = await run(engine, constrained)
                times[constrained].append(dt)
                steps = min(steps, n)
        await engine.stop()
        free, held = statistics.median(times[False]), statistics.median(times[True])
        return {"free_ms_per_step": 1e3 * free / tokens, "grammar_ms_per_step": 1e3 * held / tokens,
                "grammar_cost_ms_per_step": 1e3 * (held - free) / tokens, "min_tokens": steps}  # fmt: skip

    return asyncio.run(main())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--vocab", type=int, nargs="*", default=[1024, 32768, 151936], help="tokenizer sizes (none: skip)"
    )
    p.add_argument("--engine", action="store_true", help="also time the grammar inside the native engine")
    p.add_argument("--json", help="write the figures here too")
    args = p.parse_args()
    rows = []
    if args.engine:
        r = bench_engine()
        rows.append({"engine": "native", "batch": BATCH} | r)
        print(
            f"native engine, tiny checkpoint, batch {BATCH}: {r['free_ms_per_step']:.2f} ms/step free, "
            f"{r['grammar_ms_per_step']:.2f} ms/step under a JSON-schema grammar "
            f"(+{r['grammar_cost_ms_per_step']:.2f} ms per step)",
            flush=True,
        )
    for vocab in args.vocab:
        tok = tokenizer(vocab)
        ids = tok.encode(CALL, add_special_tokens=False).ids
        assert tok.decode(ids, skip_special_tokens=False) == CALL
        for name, fn in (("llguidance", bench_llguidance), ("xgrammar", bench_xgrammar)):
            r = {"library": name, "vocab": tok.get_vocab_size(), "tokens": len(ids)} | fn(tok, ids)
            rows.append(r)
            print(
                f"{name:10s} vocab {r['vocab']:6d}: tokenizer {r['tokenizer_s']:.2f} s, compile {r['compile_ms']:7.1f} ms, "
                f"mask+advance at batch {BATCH} {r['mask_step_ms']:.3f} ms/step (p99 {r['mask_step_p99_ms']:.3f}) "
                f"over {len(ids)} tokens",
                flush=True,
            )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
