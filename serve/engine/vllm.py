"""The vLLM backend (GPU boxes): launch `vllm serve` with flags matching the checkpoint, proxy to it.

vLLM is an optional extra, never installed in CI. The command is built from what composer-serve knows
about the checkpoint: the tool-call parser its chat template needs (hermes or qwen3_coder), the
reasoning parser when the template thinks, and the quantization the GPU can run — vLLM's MXFP8 path
needs sm_100 (Blackwell), so on Hopper `--quant mxfp8` becomes vLLM's FP8 (`--quantization fp8`).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import httpx

TOOL_PARSERS = {"hermes": "hermes", "qwen3_coder": "qwen3_coder"}


class VLLMUnavailable(RuntimeError):
    pass


def vllm_quantization(quant: str, capability: tuple[int, int] | None) -> str | None:
    if quant == "none":
        return None
    if capability is None:
        raise VLLMUnavailable("--quant mxfp8 with vLLM needs a CUDA GPU")
    return "mxfp8" if capability >= (10, 0) else "fp8"


def vllm_command(model: str, *, host: str, port: int, served_name: str, tool_format: str, reasoning: bool,
                 dtype: str = "auto", quant: str = "none", max_model_len: int | None = None,
                 capability: tuple[int, int] | None = None, executable: list[str] | None = None,
                 speculative: str = "off", num_speculative_tokens: int = 8) -> list[str]:
    cmd = list(executable or ["vllm"]) + ["serve", model, "--host", host, "--port", str(port),
                                          "--served-model-name", served_name, "--enable-auto-tool-choice",
                                          "--tool-call-parser", TOOL_PARSERS[tool_format]]
    if reasoning:
        cmd += ["--reasoning-parser", "qwen3"]
    if dtype != "auto":
        cmd += ["--dtype", dtype]
    if max_model_len:
        cmd += ["--max-model-len", str(max_model_len)]
    q = vllm_quantization(quant, capability)
    if q:
        cmd += ["--quantization", q]
    if speculative != "off":  # vLLM's own drafters of the same names (suffix needs arctic-inference there)
        cmd += ["--speculative-config", json.dumps({"method": speculative,
                                                    "num_speculative_tokens": num_speculative_tokens})]
    return cmd


def find_vllm() -> list[str]:
    if importlib.util.find_spec("vllm") is None:
        raise VLLMUnavailable("vllm is not installed; on a GPU machine: pip install 'composer[vllm]'")
    exe = shutil.which("vllm")
    return [exe] if exe else [sys.executable, "-m", "vllm.entrypoints.cli.main"]


def gpu_capability() -> tuple[int, int] | None:
    try:
        import torch
    except ImportError:
        return None
    return torch.cuda.get_device_capability() if torch.cuda.is_available() else None


def launch(cmd: list[str], base_url: str, timeout_s: float = 900.0) -> subprocess.Popen:
    """Start vLLM and wait until its /health answers (model loading can take minutes). Its process
    group is its own, so that `stop` takes its workers down with it."""
    proc = subprocess.Popen(cmd, start_new_session=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise VLLMUnavailable(f"vllm exited with code {proc.returncode} while starting")
        try:
            if httpx.get(f"{base_url}/health", timeout=2.0).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    stop(proc)
    raise VLLMUnavailable(f"vllm did not become healthy within {timeout_s:.0f} s")


def stop(proc: subprocess.Popen, grace_s: float = 15.0) -> None:
    """SIGTERM the server's process group, then SIGKILL what is left after `grace_s`."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass
