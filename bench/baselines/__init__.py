"""Kernels the benchmarks measure hy3c's against; no part of the product (nothing in `hy3c` imports them)."""
