"""Errors a user can cause and fix: the command line prints them as one line, no traceback."""


class ConfigError(ValueError):
    """A recipe, override or data set that cannot be used as given; the message names the fix."""
