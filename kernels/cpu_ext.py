"""Our C++ CPU kernels (kernels/csrc/), built once per machine into one extension module.

    paged_decode_attention(q_BHC, k_cache_SGC, v_cache_SGC, tables_BN, lens_B, block_size, scale)
        decode attention reading the paged KV cache in place (see kernels/cpu_attention.py)
    few_query_attention(q_QHC, k_cache_SGC, v_cache_SGC, slots_L, scale) -> o_QHC
        one sequence's last Q queries (a batch-1 decode, a draft verified) over its paged keys, float64
        throughout: the built-in model as served, which the float32 kernels below cannot take
    attention_prologue(qkv_TN, q_norm_C, k_norm_C, eps, cos_TC, sin_TC, k_cache, v_cache, slots_T, H) -> q_THC
        q/k RMSNorm, rotary embedding and the KV-cache write of one attention layer, one pass per token
    moe_experts(x_TD, ids_TK, weights_TK, w13t_EDN, w2t_EID) -> out_TD
        a MoE layer's routed experts, router output in, layer output out (see kernels/moe.py)
    moe_experts_f64(x_TD, ids_TK, weights_TK, w13_ENK, w2_EDI) -> out_TD
        the same for a few float64 rows on the checkpoint's plain weights, float64 throughout (the built-in
        model's batch-1 decodes and verified drafts)
    linear_f64(x_RD, w_ND) -> out_RN
        x·wᵀ for a few float64 rows (the built-in model's projections and LM head as served)
    decode_layers(x_BD, per-layer weights and caches, step metadata, ...) -> x_BD
        every decoder layer of a decode step in one call, bit for bit the Python forward (see
        serve/model/qwen3_moe.py's decode_plan)
    moe_float32_gemm() -> "onednn" | "mm"
        the GEMM moe_experts gives float32 experts with over 256 rows (a long prefill): oneDNN's where torch has it

Why kernels: a CPU decode step is bound by moving bytes, and the torch paths moved more than needed
(pages gathered into a padded copy before attention; experts' few-row matmuls streaming their weights
well below memory bandwidth, at two library calls per expert) or spent more on dispatching small ops
than on their arithmetic (the ~25 between q/k/v projection and attention). Each file says how it does
better.

Built with torch's C++ extension tooling (a C++ compiler and ninja; flags for this CPU's vector
extensions) into ~/.cache/composer/kernels/ (or $COMPOSER_KERNEL_CACHE), keyed by the sources, torch,
Python and the CPU's capability, so a changed machine never runs a binary built for another. A build
takes ~30-60 s once. `load()` never compiles in the calling process: an engine that finds no build
starts one in a background process and runs the torch paths for its own lifetime, and the next start
uses the kernels; `python -m kernels.cpu_ext` builds them now. Where no compiler is available the torch
paths simply stay (and stay the references the tests compare against). COMPOSER_KERNEL_BUILD=0: no
background build.
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = [CSRC / "bindings.cpp", CSRC / "paged_attention_cpu.cpp", CSRC / "few_query_attention_cpu.cpp",
           CSRC / "attention_prologue_cpu.cpp",
           CSRC / "moe_cpu.cpp", CSRC / "moe_f64_cpu.cpp", CSRC / "linear_f64_cpu.cpp", CSRC / "decode_layers_cpu.cpp"]
HEADERS = [CSRC / "kernels.h", CSRC / "onednn_linear.h", CSRC / "vec_f64.h"]
_ARCH_FLAGS = {"AVX2": ["-mavx2", "-mfma", "-mf16c"],
               "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx2", "-mfma", "-mf16c"]}
_lock = threading.Lock()
_module: ModuleType | None = None
_background: subprocess.Popen | None = None


def _capability() -> str:
    try:
        return torch.backends.cpu.get_cpu_capability()
    except (AttributeError, RuntimeError):
        return "DEFAULT"


def build_dir() -> Path:
    """Where this source, torch, Python and CPU capability's build lives."""
    key = hashlib.sha256(b"".join(src.read_bytes() for src in SOURCES + HEADERS))
    key.update(f"{torch.__version__} {sys.version_info[:2]} {_capability()}".encode())
    root = Path(os.environ.get("COMPOSER_KERNEL_CACHE") or Path.home() / ".cache" / "composer" / "kernels")
    return root / f"cpu_kernels-{key.hexdigest()[:16]}"


def _name(folder: Path) -> str:
    return "composer_" + folder.name.replace("-", "_")


def build(verbose: bool = False) -> ModuleType:
    """Compile (if not built yet) and import the kernels; raises if this machine cannot build them."""
    global _module
    from torch.utils import cpp_extension

    with _lock:
        if _module is None:
            # the `ninja` wheel puts its binary next to this Python, which need not be on PATH (a venv used
            # without activating it); torch looks for ninja on PATH
            bin_dir = str(Path(sys.executable).parent)
            if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
                os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
            folder = build_dir()
            folder.mkdir(parents=True, exist_ok=True)
            _module = cpp_extension.load(
                name=_name(folder), sources=[str(src) for src in SOURCES], build_directory=str(folder), verbose=verbose,
                extra_cflags=["-O3", "-fopenmp", *_ARCH_FLAGS.get(_capability(), [])],
                # libgomp.so.1 is the soname torch's own OpenMP runtime is loaded under: one thread pool
                extra_ldflags=["-fopenmp"])
        return _module


def load(build_in_background: bool = True) -> ModuleType | None:
    """The kernels if already built for this machine (importing them takes milliseconds), else None;
    then, unless told not to, a build starts in a background process (once per process) for next time."""
    global _background
    if _module is not None:
        return _module
    folder = build_dir()
    if (folder / f"{_name(folder)}.so").exists():
        try:
            return build()
        except Exception as e:  # a stale or broken build: rebuild it in the background
            log.warning("the CPU kernels in %s did not load (%s); using torch's paths", folder, e)
    if build_in_background and _background is None and os.environ.get("COMPOSER_KERNEL_BUILD", "1") != "0":
        log.info("building the CPU kernels in the background (once per machine, ~30-60 s): "
                 "this server uses torch's paths, the next start uses the kernels")
        _background = subprocess.Popen([sys.executable, "-m", "kernels.cpu_ext", "--quiet"],
                                       cwd=str(Path(__file__).resolve().parents[1]), stdin=subprocess.DEVNULL,
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    return None


if __name__ == "__main__":
    quiet = "--quiet" in sys.argv
    try:
        build(verbose=not quiet)
    except Exception as e:
        if not quiet:
            print(f"could not build the CPU kernels: {e}", file=sys.stderr)
        sys.exit(1)
    if not quiet:
        print(f"built: {build_dir()}")
