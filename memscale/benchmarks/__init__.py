"""Benchmark suite and measurement helpers for memscale."""
