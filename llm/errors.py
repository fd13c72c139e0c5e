"""Errors a user can cause and fix: the command line prints them as one line, no traceback."""


class ConfigError(ValueError):
    """A recipe, override or data set that cannot be used as given; the message names the fix."""


class SpikeStop(Exception):
    """The guard stopped the run (llm/callbacks/guard.py): too many rollbacks, or a spike before any
    checkpoint to roll back to. Its message is the one line to print; `train.py` exits with
    `EXIT_CODE`, and the newest checkpoint is the last good state (nothing was saved after it)."""

    EXIT_CODE = 3


class NonFiniteStop(SpikeStop):
    """With the guard off, a step whose loss or resulting weights are not finite: the run stops
    before anything of it is saved (same exit code as the guard's limit: a person looks first)."""
