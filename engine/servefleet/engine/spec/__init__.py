"""Speculative decoding: n-gram or draft-model proposals, verified in the target's own
forward pass."""
