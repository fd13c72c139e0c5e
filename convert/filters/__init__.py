"""convert/filters."""
