"""Benchmarks behind `edgerun bench`."""
