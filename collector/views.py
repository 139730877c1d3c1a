"""POST /v1/batches: acknowledge a batch only once it is durable in the blob store."""

from __future__ import annotations

import logging
import time
from typing import Any

import zstandard
from flask import Blueprint, current_app, request
from sqlalchemy.exc import IntegrityError

from collector.body import read_body
from collector.ratelimit import enforce
from hindsight.schema import Batch, SchemaError, decode_batch, has_nul
from services.common.ops import BATCHES, BLOB_SECONDS, BYTES, EVENTS, INDEX_SECONDS, timed
from services.common.web import ApiError, db, require, store
from storage.core.batches import blob_key, decode_stored
from storage.ingest.aggregate import aggregate
from storage.ingest.writer import index_batch

logger = logging.getLogger(__name__)

bp = Blueprint("collector", __name__)

STORE_LEVEL = 3


def check_no_nul(body: bytes) -> None:
    """400 if any string holds U+0000: Postgres cannot store it in text, so such a batch would
    be stored and then fail the index with a 500 on every retry.
    JSON can only carry it as the escape ``\\u0000``; the full walk runs only then. A body
    without a backslash (most task batches) is ruled out by one memchr."""
    if has_nul(body):
        raise ApiError(400, "invalid_batch", "strings must not contain NUL (U+0000)")


def decode_body(body: bytes) -> Batch:
    """The validated batch in a decompressed body, or 400 naming what is wrong."""
    try:
        # The bounds the index needs are part of the schema: msgspec checks them in C while
        # decoding (they were a Python pass over every field of every event).
        batch = decode_batch(body)
        check_no_nul(body)
        return batch
    except SchemaError as exc:
        message = str(exc)
        for magic, encoding in ((b"\x1f\x8b", "gzip"), (b"\x28\xb5\x2f\xfd", "zstd")):
            if body.startswith(magic):  # compressed, sent without its Content-Encoding
                message += (
                    f" (the body looks {encoding}-compressed: send Content-Encoding: {encoding})"
                )
        raise ApiError(400, "invalid_batch", message) from None
    except UnicodeDecodeError as exc:
        # msgspec raises this (not a DecodeError) for invalid UTF-8 inside a string: it is a
        # malformed body like any other.
        raise ApiError(400, "invalid_batch", f"body is not valid UTF-8: {exc.reason}") from None


@bp.post("/v1/batches")
def post_batch() -> Any:
    principal = require("ingest")
    settings = current_app.config["SETTINGS"]
    if request.mimetype != "application/json":
        raise ApiError(415, "unsupported_media_type", "Content-Type must be application/json")
    limiter = current_app.extensions["hindsight.ratelimit"]
    # an empty bucket: refused before the body is read
    enforce(limiter, principal.tenant, None, request.content_length)
    raw, body, encoding = read_body(settings.max_batch_bytes, settings.body_timeout)
    batch = decode_body(body)

    enforce(limiter, principal.tenant, len(batch.events))
    # Aggregated before the blob put: a batch the pass cannot take is refused before it is
    # stored (ADR 0006), and the pass reads the events just decoded, before the put's wait
    # lets other requests' threads run and push them out of the CPU's caches.
    t0 = time.perf_counter()
    agg = aggregate(batch)
    t_agg = time.perf_counter() - t0

    # zstd bodies are stored as received (already compressed); others are compressed here.
    stored = (
        raw if encoding == "zstd" else zstandard.ZstdCompressor(level=STORE_LEVEL).compress(body)
    )
    key = blob_key(principal.tenant, batch)
    st = store()
    with timed(BLOB_SECONDS.labels("put")):
        written = st.blobs.put(key, stored, if_absent=True)
    if not written:
        # Index what the store holds, not this request: the index stays a function of the
        # blob store even if a buggy agent reused an identity for different content.
        with timed(BLOB_SECONDS.labels("get")):
            stored = st.blobs.get(key)
        batch = decode_stored(stored)
        agg = aggregate(batch)

    session = db()
    t0 = time.perf_counter() - t_agg  # the index step's time includes the aggregation's
    for attempt in range(2):
        try:
            index_batch(
                session,
                tenant_id=principal.tenant_id,
                tenant=principal.tenant,
                batch=batch,
                blob_key=key,
                size=len(stored),
                now=time.time(),
                agg=agg,
                cache=st.ids,
                settle=settings.finish_settle_seconds,
            )
            session.commit()
            break
        except IntegrityError:
            # Two batches starting one run at once: the second run insert trips the
            # public id's unique index, which its upsert does not arbitrate. Once the first
            # has committed, the retry merges into its row.
            session.rollback()
            if attempt:
                raise
    INDEX_SECONDS.observe(time.perf_counter() - t0)
    BATCHES.labels(str(not written).lower()).inc()
    if written:
        EVENTS.inc(len(batch.events))
        BYTES.labels(encoding).inc(len(raw))
    return {
        "batch_id": batch.batch_id,
        "accepted": len(batch.events),
        "duplicate": not written,
    }, 202
