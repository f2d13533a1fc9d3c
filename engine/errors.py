"""User-facing errors: one line that says what to change, exit code 2, no traceback."""

from __future__ import annotations


class UserError(Exception):
    """Bad input from the user (a flag, a file, a request). The CLI prints the
    message alone and exits with code 2."""

    exit_code = 2

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param  # the request field to change, when one is to blame (the server's 400 names it)


class BudgetError(UserError):
    """The memory budget does not fit; the message carries the numbers."""


class ReplicaError(UserError):
    """A tensor-parallel rank died or failed, so its replica stopped; the message names
    the rank, how it ended and its last startup phase."""

    exit_code = 1
