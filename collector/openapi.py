"""The collector's OpenAPI document."""

from __future__ import annotations

import msgspec

from hindsight.schema import Batch
from services.common.openapi import AUTH_ERRORS, UNAVAILABLE, document, error, ok

_, _components = msgspec.json.schema_components([Batch], ref_template="#/components/schemas/{name}")

PATHS = {
    "/v1/batches": {
        "post": {
            "summary": "Store one batch of sub-events (protocol v1)",
            "description": "Acknowledged only after the raw batch is durable in the blob store. "
            "A batch identity (cluster, session, agent, seq) is stored and counted once.",
            "parameters": [
                {
                    "name": "Content-Encoding",
                    "in": "header",
                    "schema": {"type": "string", "enum": ["zstd", "gzip", "identity"]},
                }
            ],
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Batch"}}},
            },
            "responses": {
                **ok(
                    "stored (or already stored: duplicate is true)",
                    {
                        "type": "object",
                        "required": ["batch_id", "accepted", "duplicate"],
                        "properties": {
                            "batch_id": {"type": "string"},
                            "accepted": {"type": "integer"},
                            "duplicate": {"type": "boolean"},
                        },
                    },
                    status="202",
                ),
                "400": error("malformed batch; the message names the field; never retry"),
                **AUTH_ERRORS,
                "408": error(
                    "the body stopped arriving, or ended before its Content-Length; "
                    "nothing stored: send it again"
                ),
                "413": error("larger than the cap after decompression"),
                "415": error("unknown Content-Type or Content-Encoding"),
                "429": error("tenant over its rate limit; retry after Retry-After seconds"),
                **UNAVAILABLE,
            },
        }
    },
    "/v1/ray/events": {
        "post": {
            "summary": "Store one body of Ray's event exporter (docs/ray.md)",
            "description": "Ray's aggregator agent POSTs a JSON array of events as they are. "
            "Acknowledged only after the body is stored (named by its content: a retried body "
            "is stored and counted once). Events of types Hindsight does not index are stored "
            "and counted as skipped, never refused: Ray retries a refused body forever.",
            "parameters": [
                {
                    "name": "cluster",
                    "in": "query",
                    "schema": {"type": "string", "maxLength": 128},
                    "description": "the cluster name runs are filed under (default ray)",
                },
                {
                    "name": "token",
                    "in": "query",
                    "schema": {"type": "string"},
                    "description": "a token created with `hindsight tokens create --for ray` "
                    "(the exporter sends no headers); not needed by the embedded server",
                },
            ],
            "requestBody": {
                "required": True,
                "content": {
                    "application/json": {"schema": {"type": "array", "items": {"type": "object"}}}
                },
            },
            "responses": {
                **ok(
                    "stored (duplicate: this body was stored before)",
                    {
                        "type": "object",
                        "required": ["accepted", "skipped", "duplicate"],
                        "properties": {
                            "accepted": {"type": "integer"},
                            "skipped": {
                                "type": "object",
                                "additionalProperties": {"type": "integer"},
                            },
                            "duplicate": {"type": "boolean"},
                            "sessions": {"type": "array", "items": {"type": "string"}},
                            "tasks_written": {
                                "type": "integer",
                                "description": "tasks written with this body; with a sweeper "
                                "(gunicorn, hindsight serve) it writes most of them just after",
                            },
                        },
                    },
                    status="200",
                ),
                "400": error("the body is not a JSON array, or the cluster name is invalid"),
                **AUTH_ERRORS,
                "408": error(
                    "the body stopped arriving, or ended before its Content-Length; "
                    "nothing stored: send it again"
                ),
                "413": error("larger than the cap after decompression"),
                "415": error("unknown Content-Type or Content-Encoding"),
                "429": error("tenant over its rate limit; retry after Retry-After seconds"),
                **UNAVAILABLE,
            },
        }
    },
}

OPENAPI = document(
    "Hindsight collector",
    PATHS,
    _components,
)
