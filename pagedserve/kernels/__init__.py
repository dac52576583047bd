"""Compute kernels, by device: cpu/ native C++ called through ctypes, triton/ Triton kernels for CUDA."""
