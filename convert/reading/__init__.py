"""convert/reading."""
