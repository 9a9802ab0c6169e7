"""`composer-serve`: an OpenAI-compatible server for a Hugging Face checkpoint. Flags live here only.

    composer-serve --model PATH [--engine hf|vllm] [--port 8000] ...

Binds to loopback unless --host says otherwise. Prints one line when ready:
`composer-serve: serving NAME at http://HOST:PORT/v1 (...)`.
"""

from __future__ import annotations

import argparse
import socket
import sys
from pathlib import Path


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="composer-serve", description="OpenAI-compatible server for MoE checkpoints.")
    p.add_argument("--model", required=True, help="checkpoint folder (Hugging Face layout)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000, help="port (0 picks a free one)")
    p.add_argument("--engine", choices=["hf", "vllm"], default="hf",
                   help="hf: transformers reference; vllm: launch vLLM (GPU boxes) and proxy to it")
    p.add_argument("--dtype", choices=["auto", "bfloat16", "float32"], default="auto",
                   help="weights and activations (auto: bfloat16 on GPU, float32 on CPU)")
    p.add_argument("--quant", choices=["none", "mxfp8"], default="none", help="expert weight format")
    p.add_argument("--served-model-name", help="name clients use (default: --model as given)")
    p.add_argument("--api-key", help="require this Bearer key on /v1 requests")
    p.add_argument("--max-model-len", type=int, help="context length (default: the checkpoint's)")
    p.add_argument("--tool-call-parser", choices=["hermes", "qwen3_coder"],
                   help="tool-call text format (default: detected from the chat template)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    model_dir = Path(args.model)
    if not (model_dir / "config.json").is_file():
        print(f"composer-serve: error: {args.model} is not a checkpoint folder (no config.json)", file=sys.stderr)
        return 2
    served = args.served_model_name or args.model
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))
    except OSError as e:
        print(f"composer-serve: error: cannot bind {args.host}:{args.port}: {e.strerror}", file=sys.stderr)
        return 2
    port = sock.getsockname()[1]

    import uvicorn

    from serve.chat_format import ChatFormat, ChatFormatError

    try:
        chat = ChatFormat(model_dir, tool_format=args.tool_call_parser)
    except (ChatFormatError, OSError, ValueError) as e:
        print(f"composer-serve: error: {e}", file=sys.stderr)
        return 2
    if args.engine == "vllm":
        app, note = _vllm_app(args, chat, served)
        if app is None:
            print(f"composer-serve: error: {note}", file=sys.stderr)
            return 2
    else:
        if args.quant != "none":
            print("composer-serve: error: --quant mxfp8 needs the native engine", file=sys.stderr)
            return 2
        from serve.api import ServerState, create_app
        from serve.engine.hf import HFEngine

        engine = HFEngine(str(model_dir), dtype=args.dtype, max_model_len=args.max_model_len)
        state = ServerState(engine, chat, served, engine.max_model_len, args.api_key, str(model_dir))
        app = create_app(state)
        note = f"engine hf, {engine.device}, weights {engine.weight_bytes() / 2**20:.1f} MiB"
    print(f"composer-serve: serving {served} at http://{args.host}:{port}/v1 ({note})", flush=True)
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2)
    uvicorn.Server(config).run(sockets=[sock])
    return 0


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
                           executable=exe)
        launch(cmd, f"http://127.0.0.1:{inner}")
    except VLLMUnavailable as e:
        return None, str(e)
    return create_proxy_app(f"http://127.0.0.1:{inner}", args.api_key), f"engine vllm on port {inner}"


if __name__ == "__main__":
    sys.exit(main())
