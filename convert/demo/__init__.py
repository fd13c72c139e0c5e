"""convert/demo."""
