"""The one error a user sees: `file:line: message`."""
from __future__ import annotations


class SpecError(Exception):
    """A problem with a spec, located at a file and line."""

    def __init__(self, path: str, line: int | None, message: str):
        # One line, whatever the spec held: line breaks and other unprintable characters a
        # user wrote into a name are shown escaped.
        message = "".join(c if c.isprintable() else ascii(c)[1:-1] for c in message)
        self.path = path
        self.line = line
        self.message = message
        where = f"{path}:{line}" if line else path
        super().__init__(f"{where}: {message}")
