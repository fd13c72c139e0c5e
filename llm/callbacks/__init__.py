"""Composer callbacks of this project (one small module each); the logger destinations (metrics.jsonl,
the progress line, the trackers) are in `llm/loggers/`."""
