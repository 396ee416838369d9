"""A request the service refuses, as the use case raises it: the status LibreTranslate's clients
expect, a stable machine-readable type and a human message. ``app.http.errors`` turns it into
the JSON answer (and says which status each refusal gets)."""

from __future__ import annotations

BAD_REQUEST = 400  # LibreTranslate's status for every invalid request (app.http.errors)
UNSUPPORTED_LANGUAGE = 422  # only a detected source language no model takes


class ApiError(Exception):
    """An error with its HTTP status, a stable machine-readable type and a human message."""

    def __init__(self, status: int, error_type: str, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.error_type, self.message, self.headers = status, error_type, message, headers
