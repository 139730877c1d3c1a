"""The alert routes of the query service's OpenAPI document (docs/alerts.md)."""

from __future__ import annotations

from services.common.openapi import AUTH_ERRORS, UNAVAILABLE, error, ok
from services.query.openapi_parts import get_op, limit_param, query_param, string_schema

RULE_PROPS = {
    "name": string_schema(256),
    "url": {"type": "string", "maxLength": 2048, "description": "http(s) webhook"},
    "format": {
        "type": "string",
        "enum": ["json", "slack"],
        "default": "json",
        "description": "json: signed with X-Hindsight-Signature; slack: a Slack message",
    },
    "cluster": {"type": ["string", "null"], "maxLength": 256},
    "job": {
        "type": ["string", "null"],
        "maxLength": 1024,
        "description": "run name; a trailing * matches a prefix",
    },
    "on_slower": {"type": "boolean", "default": True},
    "min_change": {"type": "number", "minimum": 0, "default": 0.2},
    "on_failures": {"type": "boolean", "default": False},
}
RULE = {"type": "object", "properties": {"id": {"type": "integer"}, **RULE_PROPS}}

ALERT_PATHS = {
    "/v1/alerts/rules": {
        **get_op(
            "The tenant's alert rules",
            [],
            {"type": "object", "properties": {"rules": {"type": "array", "items": RULE}}},
        ),
        "post": {
            "summary": "Make an alert rule (scope admin); the answer's secret is shown once",
            "requestBody": {
                "required": True,
                "content": {
                    "application/json": {
                        "schema": {
                            "type": "object",
                            "required": ["name", "url"],
                            "properties": RULE_PROPS,
                            "additionalProperties": False,
                        }
                    }
                },
            },
            "responses": {
                **ok("the rule, with its signing secret", RULE, status="201"),
                "400": error("invalid rule"),
                **AUTH_ERRORS,
                **UNAVAILABLE,
            },
        },
    },
    "/v1/alerts/rules/{rule_id}": {
        "delete": {
            "summary": "Remove an alert rule and its deliveries (scope admin)",
            "parameters": [
                {"name": "rule_id", "in": "path", "required": True, "schema": {"type": "integer"}}
            ],
            "responses": {
                **ok("deleted", {"type": "object"}),
                "404": error("no such rule for this tenant"),
                **AUTH_ERRORS,
                **UNAVAILABLE,
            },
        }
    },
    "/v1/alerts/deliveries": get_op(
        "Alerts posted or being retried, newest first",
        [
            query_param("rule", {"type": "string", "maxLength": 20}, "a rule id"),
            query_param("run", string_schema(64), "a run id"),
            query_param("status", {"type": "string", "enum": ["pending", "delivered", "failed"]}),
            limit_param(100, 1000),
        ],
        {"type": "object", "properties": {"deliveries": {"type": "array"}}},
    ),
}
