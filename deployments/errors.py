"""The one error type of every answer (``ApiError``), its OpenAI error type by status, and the
exceptions a client's body can cause while it is read or its prompt made (``CLIENT_ERRORS``):
what both the ingress and an engine replica use, outside the API modules."""

from __future__ import annotations

# what a value of the wrong shape raises in a validator, a conversion or a prompt's making:
# the client's 400 wherever it is met
CLIENT_ERRORS = (ValueError, TypeError, AttributeError, KeyError, IndexError, RecursionError)


class ApiError(ValueError):
    """Every error answer, wherever it is met: raised by a validator, a conversion or a check of
    the ingress, returned as a value by an engine replica across Ray (it pickles whole), and
    rendered once, in the endpoint's own error shape, by the ingress's handler. A 429 or 503
    tells the client when to retry."""

    def __init__(self, status: int, message: str, param: str | None = None, headers: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.headers = headers if headers is not None else ({"Retry-After": "1"} if status in (429, 503) else None)

    def __reduce__(self) -> tuple:
        return (type(self), (self.status, self.message, self.param, self.headers))

    @property
    def type(self) -> str:
        return error_type(self.status)


ERROR_TYPES = {  # OpenAI's error type of each status we answer with
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    431: "invalid_request_error",
    500: "server_error",
    501: "not_supported_error",
    503: "server_error",
    504: "timeout_error",
}


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status, "server_error")
