"""Text-level machinery with no I/O: stop strings and incremental UTF-8, reasoning splits, tool-call formats,
tools in the prompt, and the grammars behind constrained decoding (llguidance)."""
