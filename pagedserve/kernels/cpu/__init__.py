"""Native CPU kernels: C++ sources built on first use (build.py) and their ctypes bindings."""
