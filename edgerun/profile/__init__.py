"""Measuring a device: compute, memory, network."""
