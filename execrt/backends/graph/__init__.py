"""Graph execution backends."""
