"""convert/tokens."""
