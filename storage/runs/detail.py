"""A finished run's detail as one immutable object in the blob store, out of the index.

The index is a catalog (docs/decisions/0034-detail-objects.md): what is read across runs
stays in it (runs, per-run per-prefix summaries, rollups); what is read one run at a time
moves, when the run finishes, into one object next to the run's compacted copy:

- ``states``: its replay samples (what ``run_states`` held while it ran), by time;
- ``profiles``: its statistical profile rows (what ``run_profiles`` held), each tree with
  its frames numbered in the object's own frame dictionary (``frames``), so the object
  reads without the index and a rebuilt index writes the same one.

The finisher (:func:`finish`, the last of ``storage.jobs.finish.FINISHERS``) merges what
the previous version held with what the index holds now (a late batch adds samples after
the run finished; the profile finisher writes fresh rows), writes the merged object under
the digest of its content, records the digest in ``runs.detail_digest`` and deletes the
rows, all in the finisher's transaction, after the object is stored: if that transaction
fails the rows stay and the object is an orphan the next version overwrites or prunes.

Readers read a finished run's object by key through a bounded LRU of the process
(objects are immutable, so a cached one is never stale) and add the index rows that
arrived after it (none, unless a late batch is waiting for its finish job). A version a
late batch supersedes is deleted by the next finisher (:func:`prune`), once the new digest
is committed; a reader that read the old digest just before finds it gone and reads the
digest again, once. Retention deletes them all with the run's compacted copy.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zstandard
from sqlalchemy import delete, select
from sqlalchemy.orm import Session
from sqlalchemy.orm.attributes import set_committed_value

from storage.analysis.profile import Profile, decode_into, encode
from storage.core import models as m
from storage.core.blobs import BlobStore
from storage.runs.context import FinishedRun
from storage.runs.runfile import compact_prefix

logger = logging.getLogger(__name__)

FORMAT = 1
ZSTD_LEVEL = 6
#: The decoded objects a process keeps, by the bytes they were stored in (a run page
#: reads its run's object several times; an object is ~2-20 KB compressed).
CACHE_BYTES = 64 << 20


class Frame(msgspec.Struct, array_like=True, frozen=True, order=True):
    name: str
    filename: str
    first_line: int
    line_number: int
    line: str


class ProfileRow(msgspec.Struct, array_like=True, frozen=True):
    """A ``run_profiles`` row, its tree's frames numbered in the object's ``frames``."""

    prefix: str
    worker: str
    samples: int
    nodes: int
    interval: float
    tag: str
    data: bytes


class StateRow(msgspec.Struct, array_like=True, frozen=True):
    """A ``run_states`` row."""

    time: float
    prefixes: dict[str, list[int]]
    workers: dict[str, list[int]]


class Detail(msgspec.Struct, frozen=True):
    """One run's detail object."""

    format: int
    run: str
    states: list[StateRow] = []
    frames: list[Frame] = []
    profiles: list[ProfileRow] = []


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Detail)


def encode_detail(detail: Detail) -> bytes:
    return zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(_encoder.encode(detail))


def decode_detail(data: bytes) -> Detail:
    return _decoder.decode(zstandard.ZstdDecompressor().decompress(data))


def digest_of(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()[:32]


def base_key(db: Session, run: m.Run) -> str:
    return f"{compact_prefix(db, run)}/detail"


def object_key(db: Session, run: m.Run, digest: str) -> str:
    return f"{base_key(db, run)}/{digest}.msgpack.zst"


@dataclass
class _Cache:
    """Decoded detail objects, least recently used out first, bounded by the bytes they
    were stored in."""

    limit: int
    _items: OrderedDict[str, tuple[Detail, int]] = field(default_factory=OrderedDict)
    _size: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def get(self, key: str) -> Detail | None:
        with self._lock:
            hit = self._items.get(key)
            if hit is None:
                return None
            self._items.move_to_end(key)
            return hit[0]

    def put(self, key: str, value: Detail, size: int) -> None:
        with self._lock:
            if key in self._items:
                return
            self._items[key] = (value, size)
            self._size += size
            while self._size > self.limit and self._items:
                _, (_, n) = self._items.popitem(last=False)
                self._size -= n

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self._size = 0


_cache = _Cache(CACHE_BYTES)


def clear_cache() -> None:
    """Forget the decoded objects (benchmarks measure cold reads)."""
    _cache.clear()


def read(db: Session, blobs: BlobStore | None, run: m.Run) -> Detail | None:
    """The run's detail object, or None when its detail is in the index (a running run,
    one not finished since this format, or no blob store at hand)."""
    if blobs is None or run.detail_digest is None:
        return None
    for _attempt in range(2):
        # Cached by run and digest: the content names the object, and a hit needs no
        # query for the run's place in the store.
        cached = f"{run.public_id}/{run.detail_digest}"
        hit = _cache.get(cached)
        if hit is not None:
            return hit
        key = object_key(db, run, run.detail_digest)
        try:
            body = blobs.get(key)
        except FileNotFoundError:
            # A newer version replaced it (and pruned this one) since the run was read:
            # read the run's digest again, once.
            digest = db.execute(
                select(m.Run.detail_digest).where(m.Run.id == run.id)
            ).scalar_one_or_none()
            if digest is None or digest == run.detail_digest:
                logger.warning("detail object %s of run %s is missing", key, run.public_id)
                return None
            set_committed_value(run, "detail_digest", digest)  # read, not a change to flush
            continue
        detail = decode_detail(body)
        _cache.put(cached, detail, len(body))
        return detail
    return None


# ------------------------------------------------------------------ replay samples
def states(db: Session, blobs: BlobStore | None, run: m.Run) -> list[StateRow]:
    """The run's replay samples by time: its object's and the index's (rows the index
    holds win: they are what arrived since the object was written, or all of them)."""
    S = m.RunState
    rows = {
        t: StateRow(t, p, w)
        for t, p, w in db.execute(
            select(S.time, S.prefixes, S.workers).where(S.run_id == run.id).order_by(S.time)
        )
    }
    detail = read(db, blobs, run)
    if detail is not None and detail.states:
        for row in detail.states:
            rows.setdefault(row.time, row)
        return [rows[t] for t in sorted(rows)]
    return list(rows.values())


# ------------------------------------------------------------------ profiles
def profile_trees(detail: Detail, want: Any = None) -> list[tuple[ProfileRow, Profile]]:
    """The object's profile rows (those ``want(row)`` accepts) with their trees, frames
    named from the object's dictionary."""
    out = []
    for row in detail.profiles:
        if want is not None and not want(row):
            continue
        out.append((row, tree_of(detail, row.data)))
    return out


def tree_of(detail: Detail, data: bytes) -> Profile:
    p = Profile()
    decode_into(p, data)
    for fid in p.frame_ids():
        f = detail.frames[fid]
        key = (f.name, f.filename, f.first_line)
        p.keys[fid] = key
        p.lines[fid] = (f.line_number, f.line)
        p.ids[key] = fid
    p._next = max(p.keys, default=-1) + 1
    return p


def _frames_by_id(db: Session, tenant_id: int, ids: set[int]) -> dict[int, Frame]:
    F = m.ProfileFrame
    out: dict[int, Frame] = {}
    ordered = sorted(ids)
    for i in range(0, len(ordered), 5000):
        for fid, name, filename, first, line_number, line in db.execute(
            select(F.id, F.name, F.filename, F.first_line, F.line_number, F.line).where(
                F.tenant_id == tenant_id, F.id.in_(ordered[i : i + 5000])
            )
        ):
            out[fid] = Frame(name, filename, first, line_number, line)
    for fid in ordered:  # a frame removed under us: kept, unnamed
        out.setdefault(fid, Frame("?", "", 0, 0, ""))
    return out


def _index_profiles(db: Session, run: m.Run) -> tuple[list[Frame], list[ProfileRow]] | None:
    """The run's ``run_profiles`` rows renumbered into a frame dictionary of their own
    (sorted by frame, so the same trees give the same object whatever the tenant's ids),
    or None if the index holds none."""
    P = m.RunProfile
    found = db.execute(
        select(P.prefix, P.worker, P.samples, P.nodes, P.interval, P.tag, P.data)
        .where(P.run_id == run.id)
        .order_by(P.prefix, P.worker)
    ).all()
    if not found:
        return None
    trees = []
    ids: set[int] = set()
    for *_, data in found:
        p = Profile()
        decode_into(p, data)
        ids |= p.frame_ids()
        trees.append(p)
    named = _frames_by_id(db, run.tenant_id, ids)
    frames = sorted(set(named.values()))
    local = {f: i for i, f in enumerate(frames)}
    remap = {fid: local[f] for fid, f in named.items()}
    rows = [
        ProfileRow(prefix, worker, samples, nodes, interval, tag, encode(p, remap))
        for (prefix, worker, samples, nodes, interval, tag, _), p in zip(found, trees, strict=True)
    ]
    return frames, rows


def _reframed(detail: Detail, frames: list[Frame]) -> list[ProfileRow]:
    """``detail``'s profile rows renumbered into ``frames`` (a superset of its frames)."""
    local = {f: i for i, f in enumerate(frames)}
    out = []
    for row in detail.profiles:
        p = Profile()
        decode_into(p, row.data)
        remap = {fid: local[detail.frames[fid]] for fid in p.frame_ids()}
        out.append(
            ProfileRow(
                row.prefix,
                row.worker,
                row.samples,
                row.nodes,
                row.interval,
                row.tag,
                encode(p, remap),
            )
        )
    return out


def build(db: Session, blobs: BlobStore, run: m.Run) -> Detail:
    """The run's detail as it stands: its previous object merged with the index's rows."""
    previous = read(db, blobs, run)
    states_ = states(db, blobs, run)
    fresh = _index_profiles(db, run)
    if fresh is not None:  # the profile finisher replaces a run's rows whole
        frames, profile_rows = fresh
    elif previous is not None:
        frames, profile_rows = previous.frames, previous.profiles
    else:
        frames, profile_rows = [], []
    return Detail(FORMAT, run.public_id, states_, frames, profile_rows)


def _has_index_rows(db: Session, run_id: int) -> bool:
    return any(
        db.execute(select(t.run_id).where(t.run_id == run_id).limit(1)).first() is not None
        for t in (m.RunState, m.RunProfile)
    )


def _prune(blobs: BlobStore, base: str, *keep: str) -> int:
    gone = 0
    for old in list(blobs.list(f"{base}/")):
        if old not in keep:
            blobs.delete(old)
            gone += 1
    return gone


def store(db: Session, blobs: BlobStore, run: m.Run) -> bool:
    """Write the run's detail object and move its rows out of the index (the caller owns
    the transaction, and commits it after the object is stored). Returns whether a new
    version was written (False: the index held no rows of the run)."""
    if not _has_index_rows(db, run.id):
        return False
    detail = build(db, blobs, run)
    body = encode_detail(detail)
    digest = digest_of(body)
    key = object_key(db, run, digest)
    if not blobs.exists(key):
        blobs.put(key, body)
    run.detail_digest = digest
    db.execute(delete(m.RunState).where(m.RunState.run_id == run.id))
    db.execute(delete(m.RunProfile).where(m.RunProfile.run_id == run.id))
    return True


def finish(fr: FinishedRun) -> None:
    """Finisher (``storage.jobs.finish``, after every finisher that reads the rows): the
    run's detail object, and its rows gone from the index."""
    store(fr.db, fr.blobs, fr.run)
    fr.db.flush()


def prune_versions(db: Session, blobs: BlobStore, run: m.Run, *keep: str | None) -> int:
    """Delete the run's detail versions but its current one and those of the digests in
    ``keep`` (after the current digest is committed); returns how many went."""
    if run.detail_digest is None:
        return 0
    kept = [object_key(db, run, d) for d in (run.detail_digest, *keep) if d is not None]
    return _prune(blobs, base_key(db, run), *kept)


def prune(fr: FinishedRun) -> None:
    """Finisher (right after :func:`finish`, in a transaction of its own, so the new
    digest is committed first): delete the versions the current one superseded. A reader
    that read the old digest just before the commit finds its object gone and reads the
    digest again (:func:`read`): the grace a superseded version needs is the commit of
    the next, not a time."""
    prune_versions(fr.db, fr.blobs, fr.run)
