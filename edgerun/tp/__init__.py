"""Tensor-parallel master and node engines (HALO)."""
