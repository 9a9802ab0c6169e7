"""Paged decode attention on a CPU, reading keys and values where they lie in the paged cache.

    paged_decode_attention(q_BHC, k_cache_SGC, v_cache_SGC, tables_BN, lens_B, block_size) -> o_BHC

    B decode sequences, H query heads, G key/value heads (H % G == 0), C head dim, S cache slots
    (slot = block * block_size + offset), N blocks in the longest table (padded). lens_B counts the
    tokens each sequence attends to, the new one included. Scale 1/sqrt(C), as SDPA's default.

Why a kernel: on a CPU a decode step's attention was mostly copying. The torch path gathers every
sequence's cached K/V out of the pages into one padded batch, per layer and step (`index_select`), and
then SDPA reads that copy; at batch 32 with 190-token contexts that is ~2x the cache's bytes moved
before any arithmetic, and the copy grows with the context. The kernel (csrc/paged_attention_cpu.cpp)
splits the work over (sequence, kv head) pairs, reads each pair's keys once for all the query heads that
share them, takes an exact softmax, then reads its values once, accumulating in float32.

Built with torch's C++ extension tooling (a C++ compiler and ninja; flags for this CPU's vector
extensions) into ~/.cache/composer/kernels/ (or $COMPOSER_KERNEL_CACHE), keyed by the source, torch,
Python and the CPU's capability, so a changed machine never runs a binary built for another. A build
takes ~30-60 s once. `load()` never compiles in the calling process: an engine that finds no build
starts one in a background process and runs the torch path for its own lifetime, and the next start
uses the kernel; `python -m kernels.cpu_attention` builds it now. Where no compiler is available the
torch path simply stays (`reference` below, which is also what the tests compare against).
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
import torch.nn.functional as F

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "paged_attention_cpu.cpp"
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
    key = hashlib.sha256(SOURCE.read_bytes())
    key.update(f"{torch.__version__} {sys.version_info[:2]} {_capability()}".encode())
    root = Path(os.environ.get("COMPOSER_KERNEL_CACHE") or Path.home() / ".cache" / "composer" / "kernels")
    return root / f"paged_attention_cpu-{key.hexdigest()[:16]}"


def _name(folder: Path) -> str:
    return "composer_" + folder.name.replace("-", "_")


def build(verbose: bool = False) -> ModuleType:
    """Compile (if not built yet) and import the kernel; raises if this machine cannot build it."""
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
                name=_name(folder), sources=[str(SOURCE)], build_directory=str(folder), verbose=verbose,
                extra_cflags=["-O3", "-fopenmp", *_ARCH_FLAGS.get(_capability(), [])],
                # libgomp.so.1 is the soname torch's own OpenMP runtime is loaded under: one thread pool
                extra_ldflags=["-fopenmp"])
        return _module


def load(build_in_background: bool = True) -> ModuleType | None:
    """The kernel if it is already built for this machine (importing it takes milliseconds), else None;
    then, unless told not to, a build starts in a background process (once per process) for next time."""
    global _background
    if _module is not None:
        return _module
    folder = build_dir()
    if (folder / f"{_name(folder)}.so").exists():
        try:
            return build()
        except Exception as e:  # a stale or broken build: rebuild it in the background
            log.warning("the CPU attention kernel in %s did not load (%s); using torch's path", folder, e)
    if build_in_background and _background is None and os.environ.get("COMPOSER_KERNEL_BUILD", "1") != "0":
        log.info("building the CPU attention kernel in the background (once per machine, ~30-60 s): "
                 "this server uses torch's path, the next start uses the kernel")
        _background = subprocess.Popen([sys.executable, "-m", "kernels.cpu_attention", "--quiet"],
                                       cwd=str(Path(__file__).resolve().parents[1]), stdin=subprocess.DEVNULL,
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    return None


def paged_decode_attention(q_BHC: torch.Tensor, k_cache_SGC: torch.Tensor, v_cache_SGC: torch.Tensor,
                           tables_BN: torch.Tensor, lens_B: torch.Tensor, block_size: int,
                           module: ModuleType | None = None) -> torch.Tensor:
    """The kernel (`module`, or the built one) on CPU tensors; shapes and ranges are checked there."""
    module = module or build()
    return module.paged_decode_attention(q_BHC, k_cache_SGC, v_cache_SGC, tables_BN, lens_B, block_size,
                                         q_BHC.shape[-1] ** -0.5)


def reference(q_BHC: torch.Tensor, k_cache_SGC: torch.Tensor, v_cache_SGC: torch.Tensor,
              tables_BN: torch.Tensor, lens_B: torch.Tensor, block_size: int) -> torch.Tensor:
    """The same attention by gathering each sequence's pages into a padded batch and running SDPA."""
    B, N = tables_BN.shape
    G = k_cache_SGC.shape[1]
    offsets = torch.arange(block_size, device=tables_BN.device)
    slots_BL = (tables_BN[:, :, None] * block_size + offsets).reshape(B, N * block_size)
    k_BGLC = k_cache_SGC.index_select(0, slots_BL.reshape(-1)).view(B, N * block_size, G, -1).transpose(1, 2)
    v_BGLC = v_cache_SGC.index_select(0, slots_BL.reshape(-1)).view(B, N * block_size, G, -1).transpose(1, 2)
    mask_B11L = (torch.arange(N * block_size, device=lens_B.device)[None, :] < lens_B[:, None])[:, None, None, :]
    o = F.scaled_dot_product_attention(q_BHC.unsqueeze(2), k_BGLC, v_BGLC, attn_mask=mask_B11L,
                                       enable_gqa=q_BHC.shape[1] != G)
    return o.squeeze(2)


if __name__ == "__main__":
    quiet = "--quiet" in sys.argv
    try:
        build(verbose=not quiet)
    except Exception as e:
        if not quiet:
            print(f"could not build the CPU attention kernel: {e}", file=sys.stderr)
        sys.exit(1)
    if not quiet:
        print(f"built: {build_dir()}")
