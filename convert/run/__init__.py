"""convert/run."""
