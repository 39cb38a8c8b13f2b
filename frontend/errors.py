"""The OpenAI-style error a request gets: a status, a message naming the field and its limit, and the
``param`` it is about."""

from __future__ import annotations

from typing import Any


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 type_: str = "invalid_request_error", code: str | None = None, retry_after: int | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type_, code
        self.retry_after = retry_after  # seconds, sent as Retry-After (503 at capacity)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(param: str, message: str) -> APIError:
    return APIError(400, message, param=param)
