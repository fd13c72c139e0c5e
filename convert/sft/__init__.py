"""convert/sft."""
