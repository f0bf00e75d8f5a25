"""C++ kernels for the CPU worker: build.py compiles them on first use, one wrapper module per kernel file."""
