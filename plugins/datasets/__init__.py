"""Built-in datasets: synthetic arithmetic, JSONL files and anything `datasets` can load."""
