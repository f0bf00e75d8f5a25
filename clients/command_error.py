"""The one error a CLI command reports: a line on stderr and an exit status."""

from __future__ import annotations


class CommandError(Exception):
    """A failure to report as one line on stderr with exit status 2 (bad input) or 1 (anything else)."""

    def __init__(self, message: str, status: int = 1) -> None:
        super().__init__(message)
        self.status = status
