"""Speculative decoding: n-gram proposals verified in the target's own forward pass."""
