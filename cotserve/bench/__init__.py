"""Benchmarks (`cotserve bench ...`): JSON results, never timed tests."""
