"""Errors a caller can fix, shared by the layers that validate requests."""


class RequestError(ValueError):
    """A request the user can fix (empty message, too long, bad setting, unknown mode...): the
    message names the problem and what to do; it is reported without a traceback."""
