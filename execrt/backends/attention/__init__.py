"""Attention backends: torch_native (reference), triton, flashinfer."""
