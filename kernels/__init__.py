"""MXFP8 formats and Triton kernels, with their torch references."""
