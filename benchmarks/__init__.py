"""Benchmark scripts (not timed tests): run each with `python -m benchmarks.<name>`; see README.md."""
