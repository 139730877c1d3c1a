"""Batch identity and decoding: where a batch lives in the blob store, how a stored batch
is read back, and how runs are named. Both the writer (``storage.ingest.writer``) and every
reader (queries, the compacted copy, reindex) import this; it imports neither.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass

import zstandard

from hindsight.schema import Batch, decode_batch

#: The run of task records that name none (a client outside any span, older agents).
DEFAULT_RUN = "default"

_RUN_NS = uuid.UUID("6f0e4a52-3c9e-4f5b-9a43-1d2f8b7c6e10")
# seq: 12 digits, zero-padded, or more (up to 2**53, 16 digits) as ``blob_key`` writes them
_KEY_RE = re.compile(
    r"v1/(?P<tenant>[^/]+)/(?P<cluster>[^/]+)/(?P<session>[^/]+)/(?P<agent>[^/]+)/"
    r"(?P<seq>\d{12}|[1-9]\d{12,15})\.json\.zst"
)


@dataclass(frozen=True, slots=True)
class BatchKey:
    """The identity a blob key encodes: (tenant, cluster, session, agent, seq)."""

    tenant: str
    cluster: str
    session: str
    agent: str
    seq: int


def blob_key(tenant: str, batch: Batch) -> str:
    """Where a batch lives: listing a prefix finds a tenant's, cluster's or session's batches."""
    return key_of(tenant, batch.cluster, batch.session, batch.agent, batch.seq)


def key_of(tenant: str, cluster: str, session: str, agent: str, seq: int) -> str:
    """The blob key of a batch identity (the manifest stores only keys that differ)."""
    return f"v1/{tenant}/{cluster}/{session}/{agent}/{seq:012d}.json.zst"


def parse_blob_key(key: str) -> BatchKey | None:
    """The identity encoded in a blob key, or None for a key that is not a batch."""
    match = _KEY_RE.fullmatch(key)
    if not match:
        return None
    g = match.groupdict()
    return BatchKey(g["tenant"], g["cluster"], g["session"], g["agent"], int(g["seq"]))


def stored_json(data: bytes) -> bytes:
    """The JSON of a batch as the blob store holds it (zstd, possibly several frames)."""
    return zstandard.ZstdDecompressor().stream_reader(data, read_across_frames=True).read()


def decode_stored(data: bytes) -> Batch:
    """A batch as the blob store holds it (zstd-compressed JSON, possibly several frames)."""
    return decode_batch(stored_json(data))


def run_public_id(tenant: str, cluster: str, session: str, run_key: str) -> str:
    """The stable public id of a run (the same after a rebuild of the index)."""
    return str(uuid.uuid5(_RUN_NS, f"{tenant}/{cluster}/{session}/{run_key}"))
