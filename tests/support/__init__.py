"""Helpers that start real servers for tests and benchmarks."""
