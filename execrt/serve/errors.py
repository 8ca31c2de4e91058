"""The error a request gets: an HTTP status and OpenAI's error fields."""

from __future__ import annotations

from typing import Any


class APIError(Exception):
    """A request the server refuses: the HTTP status and OpenAI's error fields."""

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        status: int = 400,
        type: str = "invalid_request_error",
        code: str | None = None,
    ) -> None:
        message = _bounded(message)
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.type = type
        self.code = code

    def body(self) -> dict[str, Any]:
        error = {"message": self.message, "type": self.type, "param": self.param}
        return {"error": error | {"code": self.code}}


#: The longest error message sent back: messages quote the offending value, which a client
#: may make as large as its request (100,000 stop strings gave a 989 KB error body).
MAX_MESSAGE_CHARS = 2000


def _bounded(message: str) -> str:
    """``message``, its middle cut where it is longer than ``MAX_MESSAGE_CHARS`` (the field
    it names comes first, what is accepted last)."""
    if len(message) <= MAX_MESSAGE_CHARS:
        return message
    keep = MAX_MESSAGE_CHARS // 2
    cut = len(message) - 2 * keep
    return f"{message[:keep]} ... ({cut} characters cut) ... {message[-keep:]}"
