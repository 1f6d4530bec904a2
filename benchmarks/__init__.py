"""Benchmarks: `python -m benchmarks.<name> [--quick]`; figures go to benchmarks/results/."""
