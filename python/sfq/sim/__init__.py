"""Discrete-event simulator of an LLM-serving fleet (placeholder; filled below)."""
