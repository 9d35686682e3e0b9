"""Exceptions that mean "the user asked for something that cannot work", not "tfbig has a bug".

Console scripts (tfbig.commands.cli) print these as one line `tfbig-<name>: error: ...` and exit 2.
Raise them (or a ValueError / FileNotFoundError from tfbig's own checks) with a message that
names the flag or file, the value seen and what would be valid.
"""


class UsageError(ValueError):
    """A flag, file or combination the user chose that tfbig cannot run."""


class DamagedCheckpointError(UsageError):
    """Every checkpoint in a run directory failed its integrity check."""
