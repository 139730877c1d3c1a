"""Retention per tenant: remove old history from the blob store and the index.

The unit removed is a **session** (one scheduler lifetime), not a single run: a batch holds
events of every run its agent saw, and batches are stored once and never rewritten, so a
run's blobs can only go when every run sharing them goes. A session expires when

- ``max_age``: nothing arrived for it for longer than ``max_age`` seconds (``last_seen``), or
- ``max_runs``: none of its runs is among the tenant's newest ``max_runs`` runs (by start).

A long-lived session that keeps starting runs is kept whole until it falls out of both.

Order: **blobs first, then index rows.** The blob store is the source of truth and
``hindsight reindex`` rebuilds the index from it, so deleting index rows first would let a
crash (or a reindex running meanwhile) resurrect the session from its blobs, with fresh
``last_seen`` times that age-based retention would not catch for another ``max_age``.
Deleting blobs first, a crash leaves index rows whose blobs are (partly) gone: the session is
still expired, so the next ``apply`` finishes it (deleting a missing blob is not an error).
So every expired session's blobs go first; then, on Postgres, every range of run ids whose
runs are all in those sessions leaves the per-run tables whole (``storage.core.partitions``:
a partition dropped, not a million rows deleted); then the index rows, in one transaction
per session (ON DELETE CASCADE takes agents, batches, runs and what is left of their
rollups). Per-cluster hourly rollups and prefix days older than the age cut-off go too.

The history lake (``storage/lake/build.py``) holds the session's runs too: they leave it in the
same transaction, just before the index rows, and the files that held them are deleted at
once (no grace period). A crash in between leaves the session expired, so the next
``apply`` finishes it; taking runs out of the lake again is a no-op.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from sqlalchemy import delete, func, select
from sqlalchemy.orm import Session, sessionmaker

from storage.core import models as m
from storage.core import partitions
from storage.core.blobs import BlobStore
from storage.lake import build as lake
from storage.ray import bodies as ray_bodies

logger = logging.getLogger(__name__)


@dataclass
class ExpiredSession:
    """One session retention removes, with what it holds."""

    id: int
    cluster: str
    name: str
    last_seen: float
    runs: int
    batches: int
    bytes: int

    @property
    def prefix(self) -> str:
        return f"{self.cluster}/{self.name}/"


@dataclass
class RetentionPlan:
    """What ``apply`` removes (or, on a dry run, would remove)."""

    tenant: str
    sessions: list[ExpiredSession] = field(default_factory=list)
    # per cluster id: the time before which its hours and prefix days go (max_age only)
    cutoffs: dict[int, float] = field(default_factory=dict)
    blobs_deleted: int = 0

    @property
    def runs(self) -> int:
        return sum(s.runs for s in self.sessions)

    @property
    def batches(self) -> int:
        return sum(s.batches for s in self.sessions)

    @property
    def bytes(self) -> int:
        return sum(s.bytes for s in self.sessions)


def plan(
    db: Session,
    tenant: str,
    *,
    max_age: float | None = None,
    max_runs: int | None = None,
    now: float | None = None,
) -> RetentionPlan:
    """The sessions of ``tenant`` past retention (nothing is changed)."""
    if max_age is None and max_runs is None:
        raise ValueError("give a maximum age, a maximum number of runs, or both")
    if (max_age is not None and max_age < 0) or (max_runs is not None and max_runs < 0):
        raise ValueError("retention limits must not be negative")
    now = time.time() if now is None else now
    out = RetentionPlan(tenant)
    tenant_id = db.scalar(select(m.Tenant.id).where(m.Tenant.name == tenant))
    if tenant_id is None:
        return out
    expired: set[int] = set()
    base = (
        select(m.Session.id)
        .join(m.Cluster, m.Cluster.id == m.Session.cluster_id)
        .where(m.Cluster.tenant_id == tenant_id)
    )
    cutoff = None
    if max_age is not None:
        cutoff = now - max_age
        expired |= set(db.scalars(base.where(m.Session.last_seen < cutoff)))
    if max_runs is not None:
        started = func.coalesce(m.Run.started_at, m.Run.first_seen)
        newest = (
            select(m.Run.session_id)
            .where(m.Run.tenant_id == tenant_id)
            .order_by(started.desc(), m.Run.id.desc())
            .limit(max_runs)
        )
        keep = set(db.scalars(newest))
        with_runs = set(
            db.scalars(select(m.Run.session_id).where(m.Run.tenant_id == tenant_id).distinct())
        )
        expired |= with_runs - keep
    if cutoff is not None:
        # Each cluster's hours and prefix days (by event time) go before the cut-off, but
        # not those of a kept session of that cluster: one delivered late (a spool pushed
        # from a kept volume) lost its runs' history for good, kept runs and all (reindex
        # does not redo what it has). Per cluster: a kept session of another cluster must not
        # hold back the removal of this one's.
        kept_first: dict[int, float] = {}
        for table in (m.Batch, m.ManifestChunk):  # the manifest's rows and its chunks
            for cluster_id, first in db.execute(
                select(m.Session.cluster_id, func.min(table.t_min))
                .join(m.Agent, m.Agent.session_id == m.Session.id)
                .join(table, table.agent_id == m.Agent.id)
                .where(m.Session.id.in_(base), m.Session.id.not_in(expired))
                .group_by(m.Session.cluster_id)
            ):
                if first is not None:
                    have = kept_first.get(cluster_id)
                    kept_first[cluster_id] = first if have is None else min(have, first)
        clusters = db.scalars(select(m.Cluster.id).where(m.Cluster.tenant_id == tenant_id))
        out.cutoffs = {
            c: min(cutoff, kept_first[c]) if kept_first.get(c) is not None else cutoff
            for c in clusters
        }
    if not expired:
        return out
    runs = dict(
        db.execute(
            select(m.Run.session_id, func.count())
            .where(m.Run.session_id.in_(expired))
            .group_by(m.Run.session_id)
        ).all()
    )
    sizes: dict[int, tuple[int, int]] = {}
    B, C = m.Batch, m.ManifestChunk
    for table, count in ((B, func.count(B.id)), (C, func.sum(C.batches))):
        for sid, n, b in db.execute(
            select(m.Agent.session_id, count, func.sum(table.bytes))
            .join(table, table.agent_id == m.Agent.id)
            .where(m.Agent.session_id.in_(expired))
            .group_by(m.Agent.session_id)
        ):
            have = sizes.get(sid, (0, 0))
            sizes[sid] = (have[0] + int(n or 0), have[1] + int(b or 0))
    rows = db.execute(
        select(m.Session.id, m.Cluster.name, m.Session.name, m.Session.last_seen)
        .join(m.Cluster, m.Cluster.id == m.Session.cluster_id)
        .where(m.Session.id.in_(expired))
        .order_by(m.Session.last_seen, m.Session.id)
    ).all()
    for sid, cluster, name, last_seen in rows:
        n, b = sizes.get(sid, (0, 0))
        out.sessions.append(
            ExpiredSession(sid, cluster, name, last_seen, runs.get(sid, 0), n, int(b))
        )
    return out


def _delete_under(blobs: BlobStore, prefix: str) -> int:
    """Delete every blob under ``prefix``; how many went."""
    keys = list(blobs.list(prefix))
    for key in keys:
        blobs.delete(key)
    return len(keys)


def _blob_prefixes(tenant: str, s: ExpiredSession) -> tuple[str, ...]:
    """The blob prefixes a session's data lives under: its batches, its runs' compacted
    copies and extras (``compact/``: storage.runs.runfile, runlogs), its Ray bodies."""
    cluster, name = s.prefix.rstrip("/").split("/", 1)
    prefixes = (f"v1/{tenant}/{s.prefix}", f"compact/v1/{tenant}/{s.prefix}")
    return (*prefixes, *ray_bodies.session_prefixes(tenant, cluster, name))


def apply(
    blobs: BlobStore,
    sessions: sessionmaker[Session],
    tenant: str,
    *,
    max_age: float | None = None,
    max_runs: int | None = None,
    dry_run: bool = False,
    now: float | None = None,
    on_progress: Callable[[ExpiredSession], None] | None = None,
) -> RetentionPlan:
    """Remove the expired sessions of ``tenant``: blobs first, then index rows (see the
    module docstring for why). With ``dry_run`` only the plan is returned."""
    with sessions() as db:
        result = plan(db, tenant, max_age=max_age, max_runs=max_runs, now=now)
    if dry_run:
        return result
    for s in result.sessions:
        # Every blob under the session's prefix, indexed or not: a batch stored but not yet
        # indexed (index down at the time) would otherwise survive and be reindexed later.
        for prefix in _blob_prefixes(tenant, s):
            result.blobs_deleted += _delete_under(blobs, prefix)
    if result.sessions:
        # Every blob of these sessions is gone: a range of run ids whose runs are all
        # theirs leaves the per-run tables whole (Postgres), before the rows below.
        dropped = partitions.drop_expired(sessions.kw["bind"], [s.id for s in result.sessions])
        if dropped:
            logger.info("retention: dropped the partitions of run ids %s", dropped)
    for s in result.sessions:
        with sessions.begin() as db:
            lake.forget_session(db, blobs, tenant, s.id)
            db.execute(delete(m.Session).where(m.Session.id == s.id))
            # After the session (its row lock waits for merges in flight, which cannot
            # start anew without it): ray_tasks and ray_ready have no foreign key to cascade
            # through.
            db.execute(delete(m.RayTask).where(m.RayTask.session_id == s.id))
            db.execute(delete(m.RayReady).where(m.RayReady.session_id == s.id))
        # Again, now that the index has none of the session's runs: a finisher that read a
        # run before the rows went (its compacted copy, its logs) may have written after
        # the first listing; one that starts now finds no run and writes nothing.
        result.blobs_deleted += _delete_under(blobs, _blob_prefixes(tenant, s)[1])
        logger.info(
            "retention: removed session %s of tenant %s (%d runs, %d batches)",
            s.prefix.rstrip("/"),
            tenant,
            s.runs,
            s.batches,
        )
        if on_progress:
            on_progress(s)
    if result.cutoffs:
        with sessions.begin() as db:
            for cluster_id, before in sorted(result.cutoffs.items()):
                H, D = m.ClusterHour, m.PrefixDay
                db.execute(
                    delete(H).where(H.cluster_id == cluster_id, H.hour < int(before // 3600))
                )
                # whole days before the cut-off's (prefix_days were never removed: the
                # prefix history kept counting removed runs)
                db.execute(
                    delete(D).where(D.cluster_id == cluster_id, D.day < int(before // 86400))
                )
    return result
