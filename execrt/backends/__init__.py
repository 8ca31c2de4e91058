"""Built-in backend implementations; each imports only execrt.core's public names."""
