"""Errors fedsub raises on bad input: each message names what was wrong and what was expected."""


class FedsubError(Exception):
    """Base of every error fedsub documents; the CLI prints its message without a traceback."""


class ConfigError(FedsubError):
    """A configuration key, type or value is not allowed."""


class DataError(FedsubError):
    """A dataset is missing, malformed, or inconsistent."""


class ArgumentError(ConfigError, TypeError, ValueError):
    """A public function's argument has the wrong type or value. Its message names the
    argument as the caller wrote it; it is also a ``TypeError`` and a ``ValueError``, so a
    caller's ``except ValueError`` (or ``TypeError``) catches it too."""
