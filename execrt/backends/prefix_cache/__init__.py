"""Prefix caches: radix (a radix tree over token ids, LRU eviction of unlocked leaves)."""
