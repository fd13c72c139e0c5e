"""Composer callbacks and logger destinations of this project (one small module each)."""
