"""Spools whose agent is gone: adopted by the next agent, or pushed by hand.

An agent writes to ``<spool_dir>/<agent name>/`` only while the collector is away.  If its
process ends first (a batch job's cluster closing during a collector upgrade, a worker
killed for memory, a pod evicted), nothing in that process will ever send those batches.

* **A spool directory is owned through a lock held for the agent's life.**  The agent
  creates its directory under a hidden staging name, takes ``flock(LOCK_EX)`` on
  ``.lock`` inside it, writes ``agent.json``, and only then renames it into place, so a
  directory is never visible unlocked while its agent lives.  The kernel drops the lock
  when the process ends, however it ends (``kill -9`` included): a directory that can be
  locked belongs to an agent that is gone, or that closed without delivering everything.
* **Any agent adopts.**  Each agent starts a ``hindsight-adopt`` thread that looks at the
  other directories under its spool root, claims each one it can lock without waiting
  (a live one is skipped, never waited for) and POSTs its files in sequence order, byte
  for byte as spooled.  They arrive under their original cluster, session, agent and
  ``seq``, so completeness stays exact.  The claim is held while delivering, so two
  agents starting at once never both deliver one directory.
* **Only to the collector they were meant for.**  ``agent.json`` records the collector
  URL and a fingerprint of (URL, token); an agent adopts only directories with its own
  fingerprint, so batches never move to another deployment or tenant.  Anything else,
  and directories copied off a volume, is for ``hindsight spool push``.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import shutil
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from hindsight.agent.kinds import UNKNOWN_KIND, decompress, kind_of
from hindsight.agent.spool import SUFFIX, Spool, SpooledBatch
from hindsight.agent.transport import Transport, retry_delay
from hindsight.config import Settings
from hindsight.schema import LATER_KINDS, decode_batch, encode_batch
from hindsight.sender import compress

try:
    import fcntl
except ImportError:  # Windows: no flock, so no automatic adoption (`spool push` works)
    fcntl = None  # type: ignore[assignment]

logger = logging.getLogger(__name__)

LOCK_NAME = ".lock"
META_NAME = "agent.json"
STAGING_SUFFIX = ".new"
#: While a directory for our collector is held by another live process, look again this often.
RESCAN_S = 60.0
#: A staging directory (an agent died between creating and publishing its spool) this old
#: is removed; younger ones may be in the middle of being published.
STALE_STAGING_S = 3600.0
#: Answers that say "not here, not with these credentials": stop and leave the batches on
#: disk.  Other 4xx answers refuse the batch itself, which retrying cannot change.
STOP_STATUSES = frozenset({401, 403, 404, 405})

# Lock descriptors this process holds; a forked child closes its copies so that only the
# parent's life keeps a directory owned (flock belongs to the open file, which fork shares).
_held: set[int] = set()


def _forget_locks_in_child() -> None:
    for fd in list(_held):
        with contextlib.suppress(OSError):
            os.close(fd)  # not LOCK_UN: that would release the parent's lock too
    _held.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_locks_in_child)


class DirLock:
    """An exclusive ``flock`` on ``<directory>/.lock``, held until :meth:`release` or the
    end of the process."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        _held.add(fd)

    def release(self) -> None:
        fd, self._fd = self._fd, -1
        if fd >= 0:
            _held.discard(fd)
            with contextlib.suppress(OSError):
                os.close(fd)


def try_lock(directory: str) -> DirLock | None:
    """Claim ``directory``: a :class:`DirLock`, or ``None`` when a live process holds it.

    Raises ``OSError`` where the platform or filesystem cannot lock; then nobody can tell
    whether the directory's agent still runs.
    """
    if fcntl is None:
        raise OSError(errno.ENOSYS, "flock is not available on this platform")
    fd = os.open(os.path.join(directory, LOCK_NAME), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except OSError:
        os.close(fd)
        raise
    return DirLock(fd)


def target_of(url: str | None, token: str | None) -> str:
    """A fingerprint of (collector URL, token): which deployment and tenant batches are for.

    Not the token, and not the hash the index stores for it.
    """
    material = b"hindsight-spool\0" + (url or "").encode() + b"\0" + (token or "").encode()
    return hashlib.sha256(material).hexdigest()[:32]


def agent_meta(settings: Settings, session: str, name: str) -> dict[str, Any]:
    """What ``agent.json`` records about the agent that owns a spool directory."""
    return {
        "format": 1,
        "agent": name,
        "cluster": settings.cluster,
        "session": session,
        "collector": settings.url,
        "target": target_of(settings.url, settings.token),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "created": time.time(),
    }


def read_meta(directory: str) -> dict[str, Any] | None:
    """``agent.json`` of a spool directory, or ``None`` (absent, unreadable, not ours)."""
    try:
        with open(os.path.join(directory, META_NAME), "rb") as f:
            meta = json.loads(f.read())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


def create_owned(root: str, name: str, meta: dict[str, Any]) -> tuple[str, DirLock | None]:
    """Create ``<root>/<name>`` already locked by this process, with ``agent.json``.

    The lock is ``None`` where the filesystem cannot lock: the spool still works, but an
    agent that dies there leaves its batches for ``hindsight spool push``.
    """
    final = os.path.join(root, name)
    staging = os.path.join(root, f".{name}{STAGING_SUFFIX}")
    os.makedirs(staging)
    lock: DirLock | None = None
    try:
        try:
            lock = try_lock(staging)
        except OSError as exc:
            logger.info(
                "hindsight: cannot lock spool directory %s (%s): if this process dies, "
                "its batches wait for `hindsight spool push`",
                final,
                exc,
            )
        tmp = os.path.join(staging, META_NAME + ".tmp")
        with open(tmp, "w") as f:
            json.dump(meta, f)
        os.replace(tmp, os.path.join(staging, META_NAME))
        os.rename(staging, final)
    except OSError:
        if lock is not None:
            lock.release()
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return final, lock


def _has_batches(directory: str) -> bool:
    try:
        return any(name.endswith(SUFFIX) for name in os.listdir(directory))
    except OSError:
        return False


def spool_directories(path: str) -> list[str]:
    """The agent spool directories at ``path``: ``path`` itself if it holds batch files,
    else its sub-directories that do (or that an agent created), in name order."""
    if _has_batches(path):
        return [path]
    try:
        entries = sorted(os.scandir(path), key=lambda e: e.name)
    except OSError:
        return []
    return [
        e.path
        for e in entries
        if not e.name.startswith(".")
        and e.is_dir(follow_symlinks=False)
        and (_has_batches(e.path) or os.path.exists(os.path.join(e.path, META_NAME)))
    ]


def spooled(directory: str) -> tuple[int, int]:
    """(batch files, events) in a spool directory, from the file names alone."""
    spool = Spool(directory, sys.maxsize)
    return len(spool), spool.events()


def _clean_stale_staging(path: str) -> None:
    try:
        if time.time() - os.stat(path).st_mtime < STALE_STAGING_S:
            return
        lock = try_lock(path)
    except OSError:
        return
    if lock is not None:
        shutil.rmtree(path, ignore_errors=True)
        lock.release()


@dataclass
class Delivery:
    """What became of one spool directory's batches."""

    directory: str
    batches: int = 0
    events: int = 0
    corrupt_files: int = 0
    corrupt_events: int = 0
    rejected: int = 0
    rejected_events: int = 0
    #: Still on disk: the collector stayed unavailable, said stop, or we were stopped.
    left: int = 0
    left_events: int = 0
    #: Events of kinds the collector is too old to know, left out of the batches sent.
    unsupported_events: int = 0
    error: str = ""

    @property
    def complete(self) -> bool:
        """Every batch that was in the directory reached the collector."""
        return not (self.left or self.corrupt_files or self.rejected)


def _unknown_later_kind(message: str) -> str | None:
    match = UNKNOWN_KIND.search(message or "")
    return match.group(1) if match and match.group(1) in LATER_KINDS else None


def _reencoded(
    batch: SpooledBatch, kinds: set[str], before: int, corrupt: int
) -> tuple[SpooledBatch, int] | None:
    """``batch`` re-encoded, same identity and ``seq``: without events of ``kinds`` and with
    its drop counters raised by what adoption lost (``before`` events of ``kinds`` left out
    of earlier batches, ``corrupt`` events in spool files that could not be read). Drop
    counters are cumulative (the highest ``seq``'s copy is the total), so the run's
    completeness shows them."""
    try:
        decoded = decode_batch(decompress(batch.body, batch.encoding))
    except Exception:
        return None
    kept = [e for e in decoded.events if kind_of(e) not in kinds] if kinds else decoded.events
    removed = len(decoded.events) - len(kept)
    dropped = dict(decoded.dropped)
    if kinds:
        dropped["unsupported_kind"] = dropped.get("unsupported_kind", 0) + before + removed
    if corrupt:
        dropped["spool_corrupt"] = dropped.get("spool_corrupt", 0) + corrupt
    again = msgspec.structs.replace(decoded, events=kept, dropped=dropped)
    body = compress(encode_batch(again), batch.encoding)
    return SpooledBatch(batch.seq, body, len(kept), batch.encoding), removed


def deliver(
    directory: str,
    transport: Transport,
    *,
    stop: threading.Event | None = None,
    deadline: float | None = None,
    on_batch: Callable[[int], None] | None = None,
) -> Delivery:
    """POST every batch file of a claimed ``directory`` in sequence order, as spooled.

    Retries 429/5xx and connection errors with the agent's backoff until ``deadline``
    (``time.monotonic()``) or ``stop``; skips and counts unreadable files; drops and counts
    batches the collector refuses (400, 413, ...: a gone agent's batch cannot be split or
    re-sequenced); stops on 401/403/404/405.  A collector older than the batches, which
    refuses an event kind added to the protocol later, gets them without that kind (as the
    agent itself does).  The directory is removed once empty.
    ``on_batch(n)`` is called as ``n`` more batch files are done with, for progress.
    """
    spool = Spool(directory, sys.maxsize)
    done = Delivery(directory)
    attempts = 0
    unsupported: set[str] = set()
    while stop is None or not stop.is_set():
        corrupt_before = spool.corrupt_files
        batch = spool.peek()
        if on_batch is not None and spool.corrupt_files > corrupt_before:
            on_batch(spool.corrupt_files - corrupt_before)
        if batch is None:
            break
        sent, removed = batch, 0
        corrupt = spool.dropped["spool_corrupt"]
        if unsupported or corrupt:
            redone = _reencoded(batch, unsupported, done.unsupported_events, corrupt)
            if redone is not None:
                sent, removed = redone
        outcome = transport.post(sent.body, sent.encoding)
        kind = _unknown_later_kind(outcome.message) if outcome.status == 400 else None
        if kind is not None and kind not in unsupported:
            unsupported.add(kind)
            continue
        if outcome.verdict == "ok":
            attempts = 0
            spool.remove(batch.seq)
            done.batches += 1
            done.events += sent.events
            done.unsupported_events += removed
        elif outcome.verdict == "retry":
            attempts += 1
            delay = retry_delay(outcome, attempts)
            if deadline is not None and time.monotonic() + delay > deadline:
                done.error = f"collector unavailable ({outcome.status or outcome.message})"
                break
            if stop is not None:
                stop.wait(delay)
            else:
                time.sleep(delay)
            continue
        elif outcome.status in STOP_STATUSES:
            done.error = f"HTTP {outcome.status}: {outcome.message}"
            break
        else:
            spool.remove(batch.seq)
            done.rejected += 1
            done.rejected_events += batch.events
            logger.warning(
                "hindsight: collector refused spooled batch %s of %s (HTTP %s: %s); "
                "%d events dropped",
                batch.seq,
                directory,
                outcome.status,
                outcome.message,
                batch.events,
            )
        if on_batch is not None:
            on_batch(1)
    done.corrupt_files = spool.corrupt_files
    done.corrupt_events = spool.dropped["spool_corrupt"]
    done.left, done.left_events = len(spool), spool.events()
    if not done.left:
        spool.remove_directory()
    return done


class Adoption:
    """The ``hindsight-adopt`` thread of one agent: deliver the spools of agents that are
    gone, for the same collector and token, off every hot path.

    It does one request at a time, never waits for a lock, and stops (leaving what is left
    on disk for the next agent) as soon as its agent closes.
    """

    def __init__(self, settings: Settings, own: str) -> None:
        self.settings = settings
        self.own = own
        self.target = target_of(settings.url, settings.token)
        #: One entry per directory this agent claimed.
        self.deliveries: list[Delivery] = []
        #: Directories for our collector that another live process held at the last look.
        self.live: list[str] = []
        #: Set after every complete look at the spool root.
        self.scanned = threading.Event()
        self.finished = threading.Event()
        self._stop = threading.Event()

    def start(self) -> None:
        threading.Thread(target=self._run, name="hindsight-adopt", daemon=True).start()

    def stop(self) -> None:
        """Stop after the request in flight, if any; never waited for."""
        self._stop.set()

    def candidates(self) -> list[str]:
        """Directories under the spool root recorded for our collector and token."""
        root = self.settings.spool_dir
        try:
            entries = sorted(os.scandir(root), key=lambda e: e.name)
        except OSError:
            return []
        out = []
        for entry in entries:
            if entry.name == self.own or not entry.is_dir(follow_symlinks=False):
                continue
            if entry.name.startswith("."):
                if entry.name.endswith(STAGING_SUFFIX):
                    _clean_stale_staging(entry.path)
                continue
            meta = read_meta(entry.path)
            if meta is not None and meta.get("target") == self.target:
                out.append(entry.path)
        return out

    def _run(self) -> None:
        transport: Transport | None = None
        try:
            while not self._stop.is_set():
                live = []
                for path in self.candidates():
                    if self._stop.is_set():
                        break
                    try:
                        lock = try_lock(path)
                    except OSError:
                        continue  # cannot tell whether its agent lives: leave it alone
                    if lock is None:
                        live.append(path)
                        continue
                    try:
                        if transport is None:
                            transport = Transport(
                                self.settings.url or "",
                                self.settings.token,
                                self.settings.request_timeout,
                            )
                        done = deliver(path, transport, stop=self._stop)
                    finally:
                        lock.release()
                    self.deliveries.append(done)
                    self._log(done)
                self.live = live
                self.scanned.set()
                if not live or self._stop.wait(RESCAN_S):
                    break
        except Exception:  # never into the host
            logger.exception("hindsight: adopting spools failed")
        finally:
            if transport is not None:
                transport.close()
            self.finished.set()

    @staticmethod
    def _log(done: Delivery) -> None:
        if done.batches or done.rejected or done.corrupt_files:
            logger.info(
                "hindsight: delivered %d batches (%d events) left in %s by an agent that is "
                "gone; %d corrupted files skipped, %d refused, %d left",
                done.batches,
                done.events,
                done.directory,
                done.corrupt_files,
                done.rejected,
                done.left,
            )
