"""Exceptions that mean "the user asked for something that cannot work", not "tfbig has a bug".

Console scripts (tfbig.commands.cli) print these as one line `tfbig-<name>: error: ...` and exit 2
(tfbig-launch does not restart a job after exit code 2: the same input fails the same way).
Raise them (or a ValueError / FileNotFoundError from tfbig's own checks) with a message that
names the flag or file, the value seen and what would be valid.
"""

USER_ERROR_EXIT_CODE = 2  # a console script's exit code for a user mistake (never restarted)


class UsageError(ValueError):
    """A flag, file or combination the user chose that tfbig cannot run."""


class DamagedCheckpointError(UsageError):
    """Every checkpoint in a run directory failed its integrity check."""


class TrainingStoppedError(RuntimeError):
    """Training cannot go on, and resuming from the last checkpoint would stop the same way
    (e.g. a non-finite loss in fp32). Printed as one line, exit code 2, like a UsageError."""
