"""A character-level GPT trained on the Python standard library's own source text."""
