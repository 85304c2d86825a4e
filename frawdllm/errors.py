"""User-facing errors.

A `FrawdError` is a problem with the user's input (a missing file, a bad config, a corrupt
model directory). The CLI prints its message as one line on stderr and exits non-zero;
any other exception is a bug and keeps its traceback.
"""


class FrawdError(Exception):
    """Bad input: shown to the user as one line, never as a traceback."""


class ConfigError(FrawdError, ValueError):
    """An invalid configuration value; a ValueError so library users can catch it as one."""
