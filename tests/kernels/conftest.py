"""Kernel tests run the Triton kernels for real: on a GPU when there is one, else on the CPU through the
Triton interpreter.

triton reads TRITON_INTERPRET when a @triton.jit function is defined, i.e. when kernels/*_triton.py is
first imported, so the variable is set here, while pytest collects this folder and before any test module
imports those files. It stays set for the rest of the session (flipping it later would leave the kernels
already defined in the other mode); kernels/backend.py's "auto" rule then also routes CPU tensors to the
interpreter in later tests of the same run, which is correct, only slower.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    if "triton.language" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        # triton's own library functions (tl.max, ...) were defined compiled, and every interpreted kernel
        # would fail with "Cannot call @triton.jit'd outside of the scope of a kernel": say who to fix instead
        raise pytest.UsageError(
            "triton was imported before tests/kernels/conftest.py could set TRITON_INTERPRET=1: a test module "
            "collected earlier imports it at module level (often through transformers, sentence_transformers or "
            "torchao); import those inside the tests that use them, or run with TRITON_INTERPRET=1")
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture
def device() -> torch.device:
    return DEVICE
