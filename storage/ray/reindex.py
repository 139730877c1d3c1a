"""Rebuilding Ray's tables and derived batches from the stored raw bodies."""

from __future__ import annotations

import hashlib
import logging
import time

from sqlalchemy import (
    select,
)
from sqlalchemy.exc import DataError
from sqlalchemy.orm import Session, sessionmaker

from storage.core import models as m
from storage.core.blobs import BlobStore
from storage.core.tokens import ensure_tenant
from storage.ray.bodies import RAW_KEY_RE, RAW_PREFIX, prepare, read_stored
from storage.ray.derived import Derived, tasks_as_events, write_derived
from storage.ray.events import (
    NO_SESSION,
)
from storage.ray.hold import recover_held
from storage.ray.merge import index_part, workers_of
from storage.ray.statements import statements_for
from storage.ray.sweep import emit_ready, run_due, take_ready
from storage.ray.translate import job_started

logger = logging.getLogger(__name__)


def parse_raw_key(key: str) -> dict[str, str] | None:
    match = RAW_KEY_RE.match(key)
    return match.groupdict() if match else None


def reindex(
    blobs: BlobStore,
    sessions: sessionmaker[Session],
    *,
    settle: float,
    idle: float,
) -> dict[str, int]:
    """Rebuild the Ray side of the index from the stored bodies. Two passes, so the result
    does not depend on the order bodies are listed in: merge every body not yet merged,
    then emit what is complete, the workers, the jobs' starts, and sweep as the collector
    does. Each body is merged as of when it was stored, so ``settle`` (the collector's)
    keeps a job whose end arrived moments ago open for its late events, as the live
    sweeper would (with 0 a rebuild on a live index closed it and wrote its tasks still
    under way as lost, for good). Safe on a live index and to repeat."""
    counts = {"ray_bodies": 0, "ray_merged": 0, "ray_already": 0, "ray_skipped": 0}
    touched: dict[int, tuple[int, str, str, str]] = {}
    tenants: dict[str, int] = {}
    for key, stored_at in blobs.listed(f"{RAW_PREFIX}/"):  # merged as of when it arrived
        counts["ray_bodies"] += 1
        ident = parse_raw_key(key)
        if ident is None:
            counts["ray_skipped"] += 1
            continue
        data = blobs.get(key)
        raw = read_stored(data)
        if hashlib.sha256(raw).hexdigest() != ident["sha"]:
            logger.error("skipping Ray body %s: its content does not match its name", key)
            counts["ray_skipped"] += 1
            continue
        try:
            parts = prepare(raw)
        except ValueError as exc:
            logger.error("skipping unreadable Ray body %s: %s", key, exc)
            counts["ray_skipped"] += 1
            continue
        tenant, cluster = ident["tenant"], ident["cluster"]
        for stored in parts:
            if stored.session != ident["session"] or stored.session == NO_SESSION:
                continue
            try:
                with sessions.begin() as db:
                    if tenant not in tenants:
                        tenants[tenant] = ensure_tenant(db, tenant, time.time())
                    res = index_part(
                        db,
                        blobs,
                        tenant_id=tenants[tenant],
                        tenant=tenant,
                        cluster=cluster,
                        stored=stored,
                        emit=False,
                        now=min(stored_at, time.time()),
                    )
                    if res.session_id is not None:
                        touched[res.session_id] = (tenants[tenant], tenant, cluster, stored.session)
            except DataError as exc:  # a value the index cannot hold: this body, not the rebuild
                logger.error("skipping Ray body %s: the index cannot hold it: %s", key, exc.orig)
                counts["ray_skipped"] += 1
                continue
            counts["ray_already" if res.duplicate else "ray_merged"] += 1
    # Bodies a collector held and did not merge (it died; no sweeper came since), from
    # their blobs (a live collector's held bodies merge twice: merges are idempotent).
    counts["ray_recovered"] = 0
    while True:
        got = recover_held(sessions, blobs, now=time.time(), after=0, limit=1_000)
        counts["ray_recovered"] += got.batches
        if got.batches + got.failed < 1_000:
            break
    for sid, (tenant_id, tenant, cluster, session) in touched.items():
        emit_session(sessions, blobs, sid, tenant_id, tenant, cluster, session)
    emit_ready(sessions, blobs, limit=1_000_000)  # what recovery completed
    sweep = run_due(sessions, blobs, settle=settle, idle=idle, limit=1_000_000)
    counts["ray_jobs_closed"] = sweep.jobs_closed
    return counts


def emit_session(
    sessions: sessionmaker[Session],
    blobs: BlobStore,
    session_id: int,
    tenant_id: int,
    tenant: str,
    cluster: str,
    session: str,
) -> int:
    """Write everything of a session that is complete (reindex's second pass)."""
    st = None
    with sessions.begin() as db:
        st = statements_for(db)
        rows = take_ready(db, session_id)
        rows += db.execute(st.emit_all_complete, {"p_session": session_id}).all()
        derived = Derived(tasks=tasks_as_events(db, session_id, rows))
        J, W = m.RayJob, m.RayWorker
        jobs = db.execute(select(J).where(J.session_id == session_id)).scalars().all()
        derived.runs = [e for e in (job_started(j) for j in jobs) if e is not None]
        workers = db.execute(select(W).where(W.session_id == session_id)).scalars().all()
        derived.workers = workers_of(db, session_id, list(workers), [])
        write_derived(
            db,
            blobs,
            tenant_id=tenant_id,
            tenant=tenant,
            cluster=cluster,
            session=session,
            derived=derived,
            now=time.time(),
        )
    return len(rows)
