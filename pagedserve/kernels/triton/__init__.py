"""Triton kernels (CUDA; run under the Triton interpreter in CPU tests)."""
