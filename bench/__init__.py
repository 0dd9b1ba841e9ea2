"""Benchmarks (`make bench`): each `bench_*.py` module has `run(results_dir) -> dict`."""
