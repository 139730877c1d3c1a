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
                "413": error("larger than the cap after decompression"),
                "415": error("unknown Content-Type or Content-Encoding"),
                "429": error("tenant over its rate limit; retry after Retry-After seconds"),
                **UNAVAILABLE,
            },
        }
    }
}

OPENAPI = document(
    "Hindsight collector",
    PATHS,
    _components,
)
