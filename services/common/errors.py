"""One error body everywhere: ``{"error": {"code", "message"}}`` with the right status."""

from __future__ import annotations

from typing import Any

from flask import current_app, jsonify


class ApiError(Exception):
    """An error answered as ``{"error": {"code", "message"}}`` with ``status``."""

    def __init__(
        self, status: int, code: str, message: str, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.headers = headers or {}


def error_response(
    status: int, code: str, message: str, headers: dict[str, str] | None = None
) -> Any:
    resp = jsonify({"error": {"code": code, "message": message}})
    resp.status_code = status
    for k, v in (headers or {}).items():
        resp.headers[k] = v
    return resp


def unavailable(message: str) -> ApiError:
    """503 with Retry-After: the caller should come back later."""
    retry = str(current_app.config["SETTINGS"].retry_after)
    return ApiError(503, "unavailable", message, {"Retry-After": retry})


__all__ = ["ApiError", "error_response", "unavailable"]
