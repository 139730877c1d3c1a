"""Why a run was slower than its job's usual runs: the facts ``storage.analysis.explain``
judges, read from the index, and the explanation stored when the run finishes.

A run's job is the runs sharing its name on its cluster (its workload fingerprint where it
has no name), across sessions: a nightly job is usually a fresh cluster each night.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from sqlalchemy import or_, select
from sqlalchemy.orm import Session

from storage.analysis import explain as ex
from storage.analysis.profile import Node, Profile
from storage.analysis.runfacts import makespan
from storage.core import models as m
from storage.core.blobs import BlobStore
from storage.query.compare import previous_runs
from storage.runs import packed, profiles, runcode
from storage.runs.context import FinishedRun
from storage.runs.runfile import compact_prefix
from storage.runs.runlogs import WINDOW_SLACK_S, window

#: Earlier runs of the job read for the verdict (their makespans only).
HISTORY = 4 * ex.BASELINE_RUNS
#: Baseline runs whose profiles are read (the latest): profiles are the costliest facts.
PROFILED = 5
VERSION = "v1"


def _key(db: Session, run: m.Run) -> str:
    return f"{compact_prefix(db, run)}/explain-{VERSION}.json"


def _prefix_facts(db: Session, run_ids: list[int]) -> dict[int, dict[str, dict[str, Any]]]:
    out: dict[int, dict[str, dict[str, Any]]] = defaultdict(dict)
    P, A = m.RunPrefix, m.RunPrefixAction
    for r, p, count, nbytes, errors in db.execute(
        select(P.run_id, P.prefix, P.count, P.nbytes, P.errors).where(P.run_id.in_(run_ids))
    ):
        out[r][p] = {"tasks": int(count), "nbytes": int(nbytes), "errors": int(errors)}
        out[r][p].update(compute=0.0, hist={})
    for r, p, total in db.execute(
        select(A.run_id, A.prefix, A.total).where(A.run_id.in_(run_ids), A.action == "compute")
    ):
        out[r].setdefault(p, {"tasks": 0, "nbytes": 0, "errors": 0, "hist": {}})
        out[r][p]["compute"] = float(total)
    for (r, p, _), buckets in sorted(packed.hists(db, run_ids, action="compute").items()):
        hist = out[r].setdefault(p, {"compute": 0.0, "hist": {}})["hist"]
        packed.add_hist(hist, buckets)
    return out


def _activity(db: Session, run_ids: list[int]) -> dict[int, dict[str, float]]:
    out: dict[int, dict[str, float]] = defaultdict(dict)
    for r, metrics in packed.activity(db, run_ids).items():
        for (context, _, act, unit), (_, value) in sorted(metrics.items()):
            if unit == "seconds" and context == "execute":
                out[r][act] = out[r].get(act, 0.0) + float(value)
    return out


def _cluster(db: Session, run: m.Run) -> dict[str, Any]:
    """The session's workers there during the run: how many, their threads, the smallest
    memory limit."""
    lo, hi = window(run)
    W = m.Worker
    q = select(W.nthreads, W.memory_limit).where(W.session_id == run.session_id)
    if hi is not None:
        q = q.where(or_(W.joined_at.is_(None), W.joined_at <= hi + WINDOW_SLACK_S))
    if lo is not None:
        q = q.where(or_(W.left_at.is_(None), W.left_at >= lo - WINDOW_SLACK_S))
    rows = db.execute(q).all()
    limits = [ml for _, ml in rows if ml]
    return {
        "workers": len(rows),
        "threads": sum(t or 0 for t, _ in rows),
        "memory_limit": min(limits) if limits else None,
    }


def _frames(profile: Profile) -> dict[tuple[str, str, int], float]:
    """Inclusive seconds (samples x interval) per frame, each frame counted once a stack."""
    out: dict[tuple[str, str, int], float] = defaultdict(float)

    def walk(node: Node, on_stack: frozenset[int]) -> None:
        for fid, child in node.children.items():
            if fid not in on_stack:
                key = profile.keys.get(fid)
                if key is not None:
                    out[tuple(key)] += child.count * profile.interval  # type: ignore[index]
            walk(child, on_stack | {fid})

    walk(profile.root, frozenset())
    return dict(out)


def _code(db: Session, run: m.Run) -> str | None:
    subs = runcode.run_code(db, run.id)
    if not subs:
        return None
    return "\n".join(f.get("code") or "" for f in reversed(subs[-1]["frames"]))


def run_facts(
    db: Session, blobs: BlobStore | None, runs: list[m.Run], *, profiled: set[int]
) -> list[dict[str, Any]]:
    """Each run's facts as ``storage.analysis.explain`` takes them (the profile only of
    the runs in ``profiled``)."""
    ids = [r.id for r in runs]
    prefixes, activity = _prefix_facts(db, ids), _activity(db, ids)
    infos = dict(
        db.execute(
            select(m.Session.id, m.Session.info).where(
                m.Session.id.in_({r.session_id for r in runs})
            )
        ).all()
    )
    out = []
    for r in runs:
        facts: dict[str, Any] = {
            "id": r.public_id,
            "makespan": makespan(r.task_start, r.task_stop),
            "errors": r.error_count,
            "prefixes": prefixes.get(r.id, {}),
            "activity": activity.get(r.id, {}),
            "versions": (infos.get(r.session_id) or {}).get("versions") or {},
            "cluster": _cluster(db, r),
            "code": _code(db, r),
        }
        if blobs is not None and r.id in profiled:
            try:
                trees = profiles.load_prefixes(db, blobs, r)
            except FileNotFoundError:  # batches gone (retention): no profile to compare
                trees = {}
            facts["frames"] = {p: _frames(t) for p, t in trees.items()}
        out.append(facts)
    return out


def compute(
    db: Session, blobs: BlobStore | None, run: m.Run, baseline: m.Run | None = None
) -> dict[str, Any]:
    """The explanation of ``run`` against its job's usual runs (or against ``baseline``)."""
    if baseline is not None:
        picked = [baseline]
    else:
        history = [
            h
            for h in previous_runs(db, run, HISTORY, same_cluster=True)[::-1]  # oldest first
            if (makespan(h.task_start, h.task_stop) or 0.0) > 0
        ]
        picked = [history[i] for i in ex.baseline([h.task_stop - h.task_start for h in history])]
        if len(picked) < ex.MIN_HISTORY:
            picked = []  # too little history: judged by nothing, not by one or two runs
    profiled = {run.id} | {h.id for h in picked[-PROFILED:]}
    facts = run_facts(db, blobs, [run, *picked], profiled=profiled)
    out = ex.explain(facts[0], facts[1:], chosen=True)
    return out


def explanation(
    db: Session, blobs: BlobStore, run: m.Run, baseline: m.Run | None = None
) -> dict[str, Any]:
    """The stored explanation of a finished run (computed and stored when missing), or
    one computed now (a running run, or against a chosen ``baseline``)."""
    import msgspec

    if baseline is not None or run.status == "running":
        return compute(db, blobs, run, baseline)
    key = _key(db, run)
    try:
        return msgspec.json.decode(blobs.get(key))
    except FileNotFoundError:
        pass
    out = compute(db, blobs, run)
    blobs.put(key, msgspec.json.encode(out), if_absent=True)
    return out


def finish(fr: FinishedRun) -> None:
    """Finisher (``storage.jobs.finish``): explain the run against its job's history now,
    so no page waits for it (rewritten: a reindex judges it anew)."""
    import msgspec

    out = compute(fr.db, fr.blobs, fr.run)
    fr.blobs.put(_key(fr.db, fr.run), msgspec.json.encode(out))
