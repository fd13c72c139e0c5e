"""Numbers read from environment variables, with one rule for all of them.

`env_number(name, default, kind)`: unset or empty gives `default`; otherwise the value must read as
`kind` (int: a whole number, float: any number) and be positive (`zero_ok`: 0 or more). Anything
else is `EnvNumberError`, one line naming the variable, what it holds and what it must be. It is a
ValueError: each caller raises it as its own layer's error (storage's settings as `StorageError`,
llm's as `ConfigError`), so the exit code stays the caller's and the line is the same everywhere.
"""

from __future__ import annotations

import os


class EnvNumberError(ValueError):
    """An environment variable that should hold a number does not hold an acceptable one."""


def env_number(name: str, default, kind: type = float, *, zero_ok: bool = False):
    """The number `name` holds (`kind`), or `default` when it is unset or empty."""
    raw = os.environ.get(name)
    if raw in (None, ""):
        return default
    try:
        value = kind(raw)
    except ValueError:
        value = None
    if value is None or value < 0 or (value == 0 and not zero_ok):
        noun = "whole number" if kind is int else "number"
        wanted = f"a {noun} of 0 or more" if zero_ok else f"a positive {noun}"
        if default is None:
            unset = "no limit"
        else:
            unset = f"default {default:g}" if kind is float else f"default {default}"
        raise EnvNumberError(f"{name}={raw!r} is not {wanted}; give one, or unset it ({unset})")
    return value
