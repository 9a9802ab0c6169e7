"""MXFP8 formats and Triton kernels, with their torch references."""

from kernels.mxfp8 import MXFP8Tensor, dequantize_mxfp8, quantize_mxfp8

__all__ = ["MXFP8Tensor", "dequantize_mxfp8", "quantize_mxfp8"]
