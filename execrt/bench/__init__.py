"""Benchmarks run by ``execrt bench``: each reports its physical limit and its peers."""
