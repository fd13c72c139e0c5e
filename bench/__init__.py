"""Benchmarks: figures and ratios, never timed tests."""
