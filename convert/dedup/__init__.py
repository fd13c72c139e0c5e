"""convert/dedup."""
