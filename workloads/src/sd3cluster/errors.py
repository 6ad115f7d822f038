"""Errors a user can act on: the CLI prints their message (no traceback) and exits non-zero."""


class UserError(Exception):
    """A problem in the user's input or environment; the message says what and what to do."""


class DataError(UserError):
    """The dataset is missing, incomplete or does not fit the model."""


class CheckpointError(UserError):
    """A checkpoint cannot be found, is incomplete or cannot be read."""
