"""Tiny random checkpoints in Hugging Face layout, for tests and CPU benchmarks.

No weights can be downloaded here, so tests build their own: a byte-level BPE trained with
`tokenizers` on local text (the Python standard library), a Qwen-style ChatML chat template with
Hermes or Qwen3-Coder tool calls, and a randomly initialised `Qwen3MoeForCausalLM` saved with
`save_pretrained` (per-expert tensors, exactly the layout of real Qwen3-MoE checkpoints).
transformers is then the reference the engines must match.
"""

from __future__ import annotations

import json
import sys
import sysconfig
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Added tokens that stay visible in decoded text (the tool-call parser needs to see them).
TEXT_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]
# The tool-call tags that are single added tokens in both formats' real tokenizers (Qwen3, Qwen3-Coder: not
# special there; Qwen3-Coder's <function=...>/<parameter=...> are plain text, no added tokens). Some
# checkpoints mark them special, so decoding with skip_special_tokens drops them: `special_tool_tags` builds
# such a tokenizer (same ids), for testing that tool calls still parse.
TOOL_TAGS = ["<tool_call>", "</tool_call>"]
TEMPLATES = {"hermes": "chatml_hermes.jinja", "qwen3_coder": "chatml_qwen3_coder.jinja"}


@dataclass
class TinySpec:
    vocab_size: int = 1024
    hidden_size: int = 64
    intermediate_size: int = 128
    moe_intermediate_size: int = 32
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    num_experts: int = 8
    num_experts_per_tok: int = 2
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    norm_topk_prob: bool = True
    max_position_embeddings: int = 16384
    tie_word_embeddings: bool = False
    rope_theta: float = 1_000_000.0


def template_text(name: str) -> str:
    return resources.files("serve").joinpath("templates", TEMPLATES[name]).read_text()


def train_tokenizer(vocab_size: int, max_bytes: int = 400_000, special_tool_tags: bool = False):
    """A byte-level BPE trained on stdlib sources (deterministic for a given stdlib); with
    `special_tool_tags` the TOOL_TAGS are special added tokens (the same ids either way)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts, total = [], 0
    for path in sorted(stdlib.glob("*.py")):
        text = path.read_text(errors="replace")
        texts.append(text)
        total += len(text)
        if total > max_bytes:
            break
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(TEXT_TOKENS), special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    tok.add_tokens([AddedToken(t, special=special_tool_tags and t in TOOL_TAGS, normalized=False)
                    for t in TEXT_TOKENS])
    return tok


def build_tiny_checkpoint(path: str | Path, *, template: str = "hermes", spec: TinySpec | None = None,
                          seed: int = 0, dtype: str = "float32", tokenizer_from: str | Path | None = None,
                          rope: dict | None = None, max_shard_size: str | None = None,
                          special_tool_tags: bool = False) -> Path:
    """Write a random Qwen3-MoE checkpoint + tokenizer + chat template to `path`; return it.

    `tokenizer_from` copies the tokenizer files of another tiny checkpoint instead of training one
    (fast variants with the same vocabulary); `rope` overrides the rope parameters (e.g. YaRN);
    `max_shard_size` (e.g. "200KB") writes a sharded checkpoint with an index; `special_tool_tags` marks
    `<tool_call>` and `</tool_call>` special in the tokenizer it trains (ignored with `tokenizer_from`).
    """
    import shutil

    import torch
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast, Qwen3MoeConfig, Qwen3MoeForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    spec = spec or TinySpec()
    if tokenizer_from is not None:
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            shutil.copy(Path(tokenizer_from) / name, path / name)
        tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    else:
        tok = train_tokenizer(spec.vocab_size, special_tool_tags=special_tool_tags)
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                       model_max_length=spec.max_position_embeddings)
        fast.chat_template = template_text(template)
        fast.save_pretrained(path)
    eos = [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]
    fields = asdict(spec)
    rope_theta = fields.pop("rope_theta")
    rope_parameters = {"rope_type": "default", "rope_theta": rope_theta, **(rope or {})}
    config = Qwen3MoeConfig(**fields, rope_parameters=rope_parameters,
                            bos_token_id=None, eos_token_id=eos[0], pad_token_id=eos[1], dtype=dtype)
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(config).to(getattr(torch, dtype))
    with torch.no_grad():  # the default init is tiny; make routing and logits non-degenerate
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
    model.save_pretrained(path, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    gen = {"eos_token_id": eos, "pad_token_id": eos[1], "temperature": 0.7, "top_p": 0.8, "top_k": 20}
    (path / "generation_config.json").write_text(json.dumps(gen, indent=2))
    return path


def main(argv: list[str] | None = None) -> int:
    """`python -m serve.tiny DIR`: a tiny random checkpoint to try composer-serve without downloading
    anything (its answers are gibberish; the whole stack runs)."""
    import argparse

    from serve.quiet import hush

    hush()
    p = argparse.ArgumentParser(prog="python -m serve.tiny", description=main.__doc__)
    p.add_argument("path", help="folder to write (created)")
    p.add_argument("--tool-format", choices=["hermes", "qwen3_coder"], default="hermes",
                   help="tool-call format of the chat template (default hermes)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # "Writing model shards" for a 1-shard toy checkpoint
        out = build_tiny_checkpoint(args.path, template=args.tool_format, seed=args.seed)
    except ModuleNotFoundError as e:  # installed without the extra: say which, not a traceback
        if (e.name or "").split(".")[0] == "serve":
            raise
        print(f"python -m serve.tiny: error: {e.name} is not installed; install the `serve` extra: "
              "pip install -e '.[serve]'", file=sys.stderr)
        return 2
    print(f"wrote a tiny random Qwen3-MoE checkpoint to {out}; serve it with: composer-serve --model {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
