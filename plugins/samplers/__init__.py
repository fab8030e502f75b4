"""Built-in samplers: ``completion`` (single turn) and ``environment`` (multi-turn, tools)."""
