"""Built-in reward plugins."""
