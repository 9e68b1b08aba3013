"""Errors that speak to the user: what was wrong, what was expected, what to do.

The CLI prints a `UserError` as one line and exits non-zero, without a traceback.
"""


class UserError(Exception):
    """A problem with the user's input, files or environment (not a bug in moetier)."""


class CheckpointError(UserError):
    """A model file is missing, truncated, or not what its config says."""


class ContextOverflow(UserError):
    """The prompt (plus the tokens asked for) does not fit the context."""

    def __init__(self, message: str, prompt_tokens: int = 0, max_context: int = 0):
        super().__init__(message)
        self.prompt_tokens = prompt_tokens
        self.max_context = max_context
