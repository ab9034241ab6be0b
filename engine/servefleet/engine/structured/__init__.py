"""Constrained decoding: structured outputs (JSON, regex, choice, grammar) and tool calls."""
