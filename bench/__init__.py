"""Benchmarks: print tables for docs/benchmarks.md, never assert timings."""
