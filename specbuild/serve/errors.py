"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` with the HTTP status as code (as vLLM)."""

from __future__ import annotations

import json

from starlette.responses import JSONResponse

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "unavailable_error",
}


class APIError(Exception):
    """A request the server refuses or cannot serve: a status, a one-line message and the parameter at fault."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    def body(self) -> dict:
        kind = ERROR_TYPES.get(self.status, "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.status}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)

    def sse(self) -> str:
        """The error as a server-sent event (an error after the stream began)."""
        return f"data: {json.dumps(self.body())}\n\n"


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)
