"""Errors a user can cause, kept apart from bugs so every entry point can answer them cleanly."""


class InvalidRequestError(ValueError):
    """A request (prompt or sampling parameters) that can never be served as given.

    `param` names the offending field (OpenAI's error body carries it); the message says what to change.
    """

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class ConfigError(ValueError):
    """An engine configuration that cannot work; the message says which flag to change."""
