"""Exception types shared by every package.

They live in the lowest package so that ``runtime`` and ``passes`` can raise them without
importing from above; ``autopar.errors`` re-exports them for users.
"""


class AutoparError(Exception):
    """Base class of every error autopar raises on purpose."""


class ConfigError(AutoparError, ValueError):
    """A user-supplied file, field or argument is invalid; the message says where and why."""
