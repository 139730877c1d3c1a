"""Pieces of the OpenAPI documents both services serve at /v1/openapi.json."""

from __future__ import annotations

from typing import Any

ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["code", "message"],
            "properties": {"code": {"type": "string"}, "message": {"type": "string"}},
        }
    },
}


def error(description: str) -> dict[str, Any]:
    return {
        "description": description,
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
    }


def ok(
    description: str, schema: dict[str, Any] | None = None, status: str = "200"
) -> dict[str, Any]:
    body: dict[str, Any] = {"description": description}
    body["content"] = {"application/json": {"schema": schema or {"type": "object"}}}
    return {status: body}


AUTH_ERRORS = {"401": error("missing or unknown token"), "403": error("token lacks the scope")}
UNAVAILABLE = {"503": error("blob store or index unavailable; retry after Retry-After seconds")}

HEALTH_PATHS = {
    "/healthz": {"get": {"summary": "The process is up", "security": [], "responses": ok("up")}},
    "/readyz": {
        "get": {
            "summary": "Blob store and index reachable",
            "security": [],
            "responses": {**ok("ready"), "503": error("not ready")},
        }
    },
    "/metrics": {
        "get": {
            "summary": "Prometheus metrics (no tenant labels)",
            "security": [],
            "responses": {
                "200": {
                    "description": "exposition text",
                    "content": {"text/plain": {"schema": {"type": "string"}}},
                }
            },
        }
    },
    "/v1/openapi.json": {
        "get": {"summary": "This document", "security": [], "responses": ok("OpenAPI 3.1")}
    },
}


def document(
    title: str, paths: dict[str, Any], schemas: dict[str, Any] | None = None
) -> dict[str, Any]:
    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": "1"},
        "paths": {**HEALTH_PATHS, **paths},
        "security": [{"bearer": []}],
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "schemas": {"Error": ERROR, **(schemas or {})},
        },
    }
