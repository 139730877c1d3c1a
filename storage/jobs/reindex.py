"""Rebuild the index from the blob store, the source of truth."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from sqlalchemy import exists, or_, select
from sqlalchemy.exc import DataError
from sqlalchemy.orm import Session, sessionmaker

from storage.core import models as m
from storage.core.batches import decode_stored, parse_blob_key
from storage.core.blobs import BlobStore
from storage.core.config import ENVIRONMENT
from storage.core.tokens import ensure_tenant
from storage.ingest.writer import index_batch
from storage.jobs.finish import queue_finished
from storage.lake import build as lake
from storage.ray import reindex as ray_reindex
from storage.runs import detail, packed

logger = logging.getLogger(__name__)


def reindex(
    blobs: BlobStore,
    sessions: sessionmaker[Session],
    *,
    prefix: str = "v1/",
    on_progress: Callable[[int], None] | None = None,
    ray_settle: float = ENVIRONMENT["HINDSIGHT_RAY_SETTLE_SECONDS"][2],
    ray_idle: float = ENVIRONMENT["HINDSIGHT_RAY_IDLE_CLOSE_SECONDS"][2],
) -> dict[str, int]:
    """Index every stored batch not yet in the index, then Ray's stored exporter bodies,
    and queue every finished run's finished-run work (``storage.jobs.finish``: whatever it
    writes is rebuilt too). Safe to run on a live index and to repeat: the manifests make
    each batch and body count once. ``ray_settle`` and ``ray_idle`` are the collector's
    (``HINDSIGHT_RAY_SETTLE_SECONDS``, ``..._IDLE_CLOSE_SECONDS``); a ``ray_settle`` of 0
    says every body is in (nothing is sending). Returns counts."""
    counts = {"blobs": 0, "indexed": 0, "already": 0, "skipped": 0}
    tenants: dict[str, int] = {}
    # Each batch indexed as of when it arrived (the object's stored time): sessions, runs
    # and batches keep their ages, which retention goes by (a rebuild made them all new).
    for key, stored_at in blobs.listed(prefix):
        counts["blobs"] += 1
        ident = parse_blob_key(key)
        if ident is None:
            counts["skipped"] += 1
            continue
        data = blobs.get(key)
        try:
            batch = decode_stored(data)
        except ValueError as exc:
            logger.error("skipping unreadable blob %s: %s", key, exc)
            counts["skipped"] += 1
            continue
        if (batch.cluster, batch.session, batch.agent, batch.seq) != (
            ident.cluster,
            ident.session,
            ident.agent,
            ident.seq,
        ):
            logger.error("skipping blob %s: its content names another batch", key)
            counts["skipped"] += 1
            continue
        try:
            with sessions.begin() as db:
                tenant = ident.tenant
                if tenant not in tenants:
                    tenants[tenant] = ensure_tenant(db, tenant, time.time())
                done = index_batch(
                    db,
                    tenant_id=tenants[tenant],
                    tenant=tenant,
                    batch=batch,
                    blob_key=key,
                    size=len(data),
                    now=min(stored_at, time.time()),
                )
        except DataError as exc:  # a value the index cannot hold: this batch, not the rebuild
            logger.error("skipping blob %s: the index cannot hold it: %s", key, exc.orig)
            counts["skipped"] += 1
            continue
        counts["indexed" if done else "already"] += 1
        if on_progress:
            on_progress(1)
    if prefix == "v1/":
        # Ray's exporter bodies live beside the batches (``storage/ray/``).
        ray_counts = ray_reindex.reindex(blobs, sessions, settle=ray_settle, idle=ray_idle)
        if ray_counts["ray_bodies"]:
            counts.update(ray_counts)
        # A full rebuild: the lake drops the runs the index no longer has and gets its
        # catalog back (the finish hook writes the runs the lake lacks).
        removed = lake.reconcile(blobs, sessions)["runs_removed"]
        if removed:
            counts["lake_runs_removed"] = removed
    with sessions.begin() as db:
        queue_finished(db)
    return counts


def move_detail(
    blobs: BlobStore,
    sessions: sessionmaker[Session],
    *,
    on_progress: Callable[[int], None] | None = None,
    chunk: int = 500,
) -> dict[str, int]:
    """Move the detail rows every finished run still has in the index (replay samples,
    profile: runs finished before migration 0017, or whose finish job has not run since)
    into its detail object, one run a transaction, each object stored before its rows go
    (``storage.runs.detail.store``), and pack its histogram, fine-metric and batch rows
    into their catalog rows (``storage.runs.packed``: runs finished before migration 0018);
    running runs keep theirs. Safe to run on a live index and to repeat. Returns counts:
    ``runs`` moved or packed, ``packed_rows`` the rows packed, ``pruned`` old versions of
    objects deleted."""
    counts = {"runs": 0, "packed_rows": 0, "pruned": 0}
    after = 0
    while True:
        with sessions() as db:
            found = (
                db.execute(
                    select(m.Run.id)
                    .where(
                        m.Run.id > after,
                        m.Run.status != "running",
                        or_(
                            exists().where(m.RunState.run_id == m.Run.id),
                            exists().where(m.RunProfile.run_id == m.Run.id),
                            exists().where(m.RunActivity.run_id == m.Run.id),
                            exists().where(m.RunPrefixHist.run_id == m.Run.id),
                            exists().where(m.RunBatch.run_id == m.Run.id),
                        ),
                    )
                    .order_by(m.Run.id)
                    .limit(chunk)
                )
                .scalars()
                .all()
            )
        if not found:
            return counts
        for run_id in found:
            with sessions.begin() as db:
                run = db.get(m.Run, run_id, with_for_update=True)
                if run is None or run.status == "running":
                    continue
                before = run.detail_digest
                folded = packed.pack_run(db, run.id)
                moved = detail.store(db, blobs, run)
                after_digest = run.detail_digest
            counts["runs"] += bool(moved or folded)
            counts["packed_rows"] += folded
            if moved and before not in (None, after_digest):
                with sessions() as db:  # once the new digest is committed
                    run = db.get(m.Run, run_id)
                    if run is not None:
                        counts["pruned"] += detail.prune_versions(db, blobs, run)
            if on_progress:
                on_progress(1)
        after = found[-1]
