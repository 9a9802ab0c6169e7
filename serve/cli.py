"""`composer-serve`: an OpenAI-compatible server for a Hugging Face checkpoint. Flags live here only.

    composer-serve [--model PATH] [--engine hf|vllm] [--port 8000] ...

Without --model it serves the small built-in model that ships in the package (serve/builtin/composer-tiny).

Binds to loopback unless --host says otherwise. Prints one line when ready:
`composer-serve: serving NAME at http://HOST:PORT/v1 (...)`.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
from pathlib import Path

from serve.engine.drafter import DEFAULT_CACHE_TOKENS as SPEC_CACHE
from serve.engine.drafter import DEFAULT_TOKENS as SPEC_TOKENS
from serve.engine.drafter import METHODS as SPEC_METHODS
from serve.engine.drafter import SpecConfig, cache_size

BUILTIN_NAME = "composer-tiny"
# COMPOSER_BUILTIN_MODEL overrides the folder (tests, packagers); composer-agent reads the same variable.
BUILTIN_DIR = Path(__file__).parent / "builtin" / BUILTIN_NAME
DTYPES = ("bfloat16", "float16", "float32", "float64")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="composer-serve", description="OpenAI-compatible server for MoE checkpoints.")
    p.add_argument("--model", help="checkpoint folder (Hugging Face layout; default: the small built-in model, "
                   f"{BUILTIN_NAME})")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000, help="port (0 picks a free one)")
    p.add_argument("--engine", choices=["native", "hf", "vllm"], default="native",
                   help="native: our MoE engine (default); hf: transformers reference, one request at a time; "
                        "vllm: launch vLLM (GPU boxes) and proxy to it")
    p.add_argument("--dtype", choices=["auto", *DTYPES], default="auto",
                   help="weights and activations (auto: the checkpoint's serve_dtype in composer_policy.json if "
                        "it names one, else bfloat16 on GPU, float32 on CPU; float64: greedy output the same on "
                        "every CPU, for small models such as the built-in one, which asks for it)")
    p.add_argument("--quant", choices=["auto", "none", "mxfp8"], default="auto",
                   help="expert weights (auto: mxfp8 on GPU, none on CPU; checkpoints stored in MXFP8 load as is)")
    p.add_argument("--quant-dense", choices=["none", "fp8"], default="none",
                   help="attention projections and LM head: none (default) or fp8 (block FP8 e4m3 weights, "
                        "128x128 scales, a W8A16 kernel on a GPU; a CPU serves the FP8-rounded values)")
    p.add_argument("--served-model-name", help="name clients use (default: --model as given)")
    p.add_argument("--api-key", action="append", help="require this Bearer key on /v1 requests (and, off loopback, "
                   "allow POST /v1/load_weights at all); /health, /metrics and /openapi.json stay open. Repeat it "
                   "for several users: each key's requests draft speculative tokens only from that key's")
    p.add_argument("--metrics-need-key", action="store_true", help="with --api-key, /metrics needs the key too")
    p.add_argument("--max-body-mb", type=float, default=16.0,
                   help="largest request body accepted, in MiB (default 16; larger ones get a 413 unread)")
    p.add_argument("--max-model-len", type=int, help="context length (default: the checkpoint's)")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"], default="info",
                   help="info (default): an access line per request and a throughput line while busy")
    p.add_argument("--log-interval", type=float, default=10.0,
                   help="seconds between throughput lines while busy (default 10; 0: none)")
    p.add_argument("--stream-interval", type=int, default=1,
                   help="tokens per streamed chunk after the first (default 1: every token as it comes); more "
                        "cuts the server's and the client's per-chunk work at high concurrency, as vLLM's and "
                        "SGLang's --stream-interval")
    p.add_argument("--tool-call-parser", choices=["hermes", "qwen3_coder"],
                   help="tool-call text format (default: detected from the chat template)")
    n = p.add_argument_group("native engine")
    n.add_argument("--max-num-seqs", type=int, default=64, help="sequences decoded together (default 64)")
    n.add_argument("--max-batched-tokens", type=int, default=2048, help="tokens per step; long prompts are "
                   "prefilled in chunks of this size (default 2048)")
    n.add_argument("--kv-cache-tokens", type=int, help="KV-cache capacity (default: 90%% of free GPU memory, "
                   "or on CPU 8 x max-model-len within a quarter of available memory)")
    n.add_argument("--no-prefix-caching", action="store_true", help="do not reuse cached prompt prefixes")
    n.add_argument("--enforce-eager", action="store_true",
                   help="run decode steps eagerly instead of replaying CUDA graphs (GPU)")
    n.add_argument("--batch-invariant", action="store_true",
                   help="a sequence's logits do not depend on the rest of the batch, on chunked prefill or on the "
                        "prefill/decode split: its log-probs are a function of its token ids, which composer-train "
                        "reproduces bit for bit (slower: fixed-order Triton kernels on a GPU, float64 sums on a CPU)")
    n.add_argument("--speculative", choices=list(SPEC_METHODS), default="off",
                   help="speculative decoding from text the server already has, no draft model: suffix (the "
                        "request's prompt and output and recent requests' outputs, frequency-weighted), ngram "
                        "(prompt lookup) or off (default); greedy output is unchanged, sampling keeps its "
                        "distribution; the vllm engine passes it on, the hf engine refuses it")
    n.add_argument("--num-speculative-tokens", type=int, default=SPEC_TOKENS,
                   help=f"most draft tokens a sequence verifies in one step (default {SPEC_TOKENS}; fewer are "
                        "drafted where verifying would cost more than it saves)")
    n.add_argument("--speculative-cache-tokens", type=int, default=SPEC_CACHE,
                   help=f"tokens of recent outputs kept for suffix drafts, over all API keys (default {SPEC_CACHE}, "
                        f"{cache_size(SPEC_CACHE)}; 0: none)")
    n.add_argument("--load-format", choices=["auto", "dummy"], default="auto",
                   help="auto: the checkpoint's weights (default); dummy: random weights made on the device from "
                        "config.json alone, for measuring speed at a model's shape (the folder still needs its "
                        "tokenizer and chat template)")
    return p


def main(argv: list[str] | None = None) -> int:
    # Before torch loads libgomp (it reads this once): OpenMP threads that finish a parallel region early
    # sleep instead of spinning ~300k times for the next. A CPU server's cores are shared, with its own HTTP
    # loop and often with other processes: a spinning thread holds the core that the thread it waits for
    # needs. Measured on a loaded 2-core VM (bench/serve.py, BENCHMARKS.md): 11-18 tok/s at concurrency 8
    # spinning, 78-320 passive. OMP_WAIT_POLICY=active in the environment keeps the spinning.
    os.environ.setdefault("OMP_WAIT_POLICY", "passive")
    from serve.quiet import hush

    hush()
    try:
        return _main(argv)
    except ModuleNotFoundError as e:  # installed without the extra: say which, not a traceback
        if (e.name or "").split(".")[0] in ("serve", "agent", "train", "index", "kernels"):
            raise
        print(f"composer-serve: error: {e.name} is not installed; install the `serve` extra: "
              "pip install -e '.[serve]'", file=sys.stderr)
        return 2


def _main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.max_body_mb <= 0:
        parser.error("--max-body-mb must be positive")
    if args.metrics_need_key and not args.api_key:
        parser.error("--metrics-need-key needs --api-key")
    args.api_key = tuple(args.api_key) if args.api_key else None
    try:
        spec = SpecConfig(args.speculative, args.num_speculative_tokens, args.speculative_cache_tokens)
    except ValueError as e:
        parser.error(str(e).replace("num_speculative_tokens", "--num-speculative-tokens"))
    if spec.on and args.engine == "hf":
        parser.error("--speculative needs the native engine (or vllm); the hf engine is the plain reference")
    if args.quant_dense != "none" and args.engine != "native":
        parser.error("--quant-dense needs the native engine (vLLM reads FP8 checkpoints by itself)")
    if args.model is None:
        args.model = os.environ.get("COMPOSER_BUILTIN_MODEL") or str(BUILTIN_DIR)
        args.served_model_name = args.served_model_name or BUILTIN_NAME
        if not (Path(args.model) / "config.json").is_file():
            print(f"composer-serve: error: the built-in model is not installed at {args.model}; "
                  "give --model PATH", file=sys.stderr)
            return 2
    if args.log_interval < 0:
        parser.error("--log-interval must be >= 0")
    if args.stream_interval < 1:
        parser.error("--stream-interval must be >= 1")
    if args.load_format == "dummy" and args.engine != "native":  # the others would load the real weights
        parser.error("--load-format dummy needs --engine native")
    if args.batch_invariant and args.engine != "native":
        parser.error("--batch-invariant needs --engine native")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    model_dir = Path(args.model)
    if not (model_dir / "config.json").is_file():
        print(f"composer-serve: error: {args.model} is not a checkpoint folder (no config.json)", file=sys.stderr)
        return 2
    if args.dtype == "auto":
        from serve.engine.weights import read_serve_dtype

        args.dtype = read_serve_dtype(model_dir, DTYPES) or "auto"
    served = args.served_model_name or args.model
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))
    except OSError as e:
        print(f"composer-serve: error: cannot bind {args.host}:{args.port}: {e.strerror}", file=sys.stderr)
        return 2
    port = sock.getsockname()[1]
    if os.environ.get("COMPOSER_SERVE_STDIN_WATCHDOG"):
        _exit_when_stdin_closes()

    import uvicorn

    from serve.chat_format import ChatFormat, ChatFormatError

    try:
        chat = ChatFormat(model_dir, tool_format=args.tool_call_parser)
    except (ChatFormatError, OSError, ValueError) as e:
        print(f"composer-serve: error: {e}", file=sys.stderr)
        return 2
    child = None  # the vLLM server we launched, stopped when we stop
    if args.engine == "vllm":
        app, note, child = _vllm_app(args, chat, served)
        if app is None:
            print(f"composer-serve: error: {note}", file=sys.stderr)
            return 2
    else:
        from serve.api import ServerState, create_app

        try:
            engine, note = _local_engine(args, model_dir)
        except (ValueError, OSError) as e:
            print(f"composer-serve: error: {e}", file=sys.stderr)
            return 2
        state = ServerState(engine, chat, served, engine.max_model_len, args.api_key, str(model_dir), args.host,
                            max_body_bytes=int(args.max_body_mb * 2**20), metrics_need_key=args.metrics_need_key,
                            log_interval=args.log_interval, stream_interval=args.stream_interval)
        app = create_app(state)
        note += f"; policy version {engine.policy_version}"
    print(f"composer-serve: serving {served} at http://{args.host}:{port}/v1 ({note})", flush=True)
    # uvicorn's own access log stays off: serve/access_log.py writes one with tokens and timings.
    config = uvicorn.Config(app, log_level="debug" if args.log_level == "debug" else "warning", access_log=False,
                            timeout_graceful_shutdown=2)
    try:
        uvicorn.Server(config).run(sockets=[sock])
    except KeyboardInterrupt:
        # Ctrl-C: uvicorn has already shut down gracefully, then re-raised SIGINT, which asyncio turns
        # into KeyboardInterrupt chained to a CancelledError. A stop asked for is not a crash (uvicorn's
        # own CLI exits 0 here too).
        print("composer-serve: stopped (Ctrl-C)", file=sys.stderr, flush=True)
    finally:
        if child is not None:
            from serve.engine.vllm import stop

            stop(child)
    return 0


def _exit_when_stdin_closes() -> None:
    """composer-agent's child: stdin is a pipe only the parent holds open, so end-of-file means the
    parent is gone (killed, crashed); shut down as on SIGTERM (where PR_SET_PDEATHSIG is unavailable)."""
    import signal
    import threading

    def watch() -> None:
        # os.read, not sys.stdin: a daemon thread blocked in a buffered read holds its lock, and the
        # interpreter's shutdown would then abort on it.
        try:
            while os.read(0, 4096):
                pass
        except OSError:
            return
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="stdin-watchdog", daemon=True).start()


def _local_engine(args, model_dir: Path):
    if args.engine == "hf":
        if args.quant == "mxfp8":
            raise ValueError("--quant mxfp8 needs the native engine (or vllm)")
        from serve.engine.hf import HFEngine

        engine = HFEngine(str(model_dir), dtype=args.dtype, max_model_len=args.max_model_len)
        return engine, f"engine hf, {engine.device}, weights {engine.weight_bytes() / 2**20:.1f} MiB"
    from serve.engine.native import EngineConfig, NativeEngine

    config = EngineConfig(dtype=args.dtype, quant=args.quant, quant_dense=args.quant_dense,
                          max_model_len=args.max_model_len,
                          max_num_seqs=args.max_num_seqs, max_batched_tokens=args.max_batched_tokens,
                          kv_cache_tokens=args.kv_cache_tokens, prefix_caching=not args.no_prefix_caching,
                          enforce_eager=args.enforce_eager, load_format=args.load_format,
                          batch_invariant=args.batch_invariant, speculative=args.speculative,
                          num_speculative_tokens=args.num_speculative_tokens,
                          speculative_cache_tokens=args.speculative_cache_tokens)
    engine = NativeEngine(str(model_dir), config)
    return engine, engine.describe()


def _vllm_app(args, chat, served: str):
    from serve.engine.vllm import VLLMUnavailable, find_vllm, gpu_capability, launch, vllm_command
    from serve.proxy import create_proxy_app

    try:
        exe = find_vllm()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            inner = s.getsockname()[1]
        cmd = vllm_command(args.model, host="127.0.0.1", port=inner, served_name=served,
                           tool_format=chat.tool_format, reasoning=chat.reasoning, dtype=args.dtype,
                           quant=args.quant, max_model_len=args.max_model_len, capability=gpu_capability(),
                           executable=exe, speculative=args.speculative,
                           num_speculative_tokens=args.num_speculative_tokens)
        proc = launch(cmd, f"http://127.0.0.1:{inner}")
    except VLLMUnavailable as e:
        return None, str(e), None
    return create_proxy_app(f"http://127.0.0.1:{inner}", args.api_key), f"engine vllm on port {inner}", proc


if __name__ == "__main__":
    sys.exit(main())
