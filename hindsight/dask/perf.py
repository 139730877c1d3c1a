"""Why a run was slow, as Dask measures it: statistical profiles, fine performance metrics
and the submitting code, turned into protocol events.

* Profiles (worker side). Every worker samples its executing threads every 10 ms and
  closes a per-prefix call tree every profile cycle (1 s) into
  ``Worker.profile_keys_history``, a deque bounded by
  ``distributed.admin.low-level-log-length`` cycles. :class:`ProfileShipper` takes each
  finished cycle from it as it is made (a run longer than the history keeps its early
  profile) and queues one ``profile`` event per prefix; the tree is flattened on the
  agent thread, not the worker's event loop.
* Fine performance metrics and code (scheduler side). :class:`RunPerf` reads each open
  run's span (``Span.cumulative_worker_metrics``, ``Span.code``) once per sample and
  sends what changed; it keeps watching a finished run for a few heartbeats, because the
  metrics of a run's last tasks arrive with the workers' next heartbeat.

Nothing here raises into Dask: callers wrap every call.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

from hindsight.schema import (
    ActivityEvent,
    ActivityMetric,
    CodeEvent,
    CodeFrame,
    ProfileEvent,
    ProfileFrame,
)

logger = logging.getLogger(__name__)

#: Nodes kept per profile event: past it the least sampled frames are folded into their
#: callers (their samples stay counted, as the caller's own).
MAX_EVENT_NODES = 2000
#: Longest source line kept per profile frame.
LINE_MAX = 120
LABEL_MAX = 1024
#: Code of one submitting frame is cut to this many characters (around the line that
#: submitted); a run keeps at most ``MAX_CODE_PER_RUN`` distinct submissions.
CODE_MAX = 16_384
MAX_CODE_PER_RUN = 32
MAX_CODE_FRAMES = 64
#: Dask setting that makes clients send their code (0, nothing, by default).
NFRAMES_KEY = "distributed.diagnostics.computations.nframes"


def _cut(value: Any, n: int = LABEL_MAX) -> str:
    s = value if type(value) is str else str(value)
    return s if len(s) <= n else s[:n]


# -- profiles ----------------------------------------------------------------------------
def flatten_profile(tree: dict[str, Any]) -> tuple[list[ProfileFrame], list[tuple[int, int, int]]]:
    """A Dask profile tree as (frames, pre-order nodes ``[parent, frame, samples]``).

    Dask (2026.8) samples with ``profile.process(frame, True, ...)``, which never counts a
    sample for its innermost frame: a leaf's count stays 0 and its samples show up only as
    its caller's. Such trees (a childless node with count 0) are repaired here: the samples
    a node has beyond its children's went to its innermost children. With one child that
    was only ever innermost (count 0) they are its own: for the common case, a task
    function whose callees are C code, that is exact. With several, the tree cannot tell
    how they were shared, so they go to one frame under the caller that says so, ``one of:
    f, g`` (a split would be made up: two helpers called in one loop, one 9x the other's
    cost, came out even). With none, to all children in proportion to their counts. Trees
    from Dasks that count leaves are taken as they are.
    """
    # Iterative walk: (node dict, parent index); node lists in pre-order.
    parents: list[int] = []
    idents: list[str] = []
    descs: list[Any] = []
    counts: list[int] = []
    children: list[list[int]] = []
    stack: list[tuple[dict[str, Any], int]] = [
        (c, -1) for c in reversed(list(tree.get("children", {}).values()))
    ]
    while stack:
        node, parent = stack.pop()
        i = len(parents)
        parents.append(parent)
        idents.append(node.get("identifier", ""))
        descs.append(node.get("description") or {})
        counts.append(int(node.get("count", 0)))
        children.append([])
        if parent >= 0:
            children[parent].append(i)
        kids = list(node.get("children", {}).values())
        stack.extend((c, i) for c in reversed(kids))
    n = len(parents)
    total = int(tree.get("count", 0))
    shared: dict[int, tuple[int, list[int]]] = {}
    if any(counts[i] == 0 and not children[i] for i in range(n)):
        counts, shared = _count_leaves(counts, children, parents, total)
    keep = _keep(counts, parents, n, MAX_EVENT_NODES - min(len(shared), MAX_EVENT_NODES // 2))
    frames: list[ProfileFrame] = []
    frame_ids: dict[str, int] = {}
    nodes: list[tuple[int, int, int]] = []
    new_index: dict[int, int] = {}

    def add_shared(parent: int) -> None:
        """The node of samples ``parent``'s innermost callees shared (pre-order: first
        of its children). Past the bound of nodes they stay the caller's own."""
        if len(nodes) >= MAX_EVENT_NODES:
            return
        samples, kids = shared[parent]
        callees = [_frame(idents[k], descs[k]) for k in kids]
        names = sorted({c.name for c in callees})
        files = {c.filename for c in callees}
        frame = ProfileFrame(
            name=_cut("one of: " + ", ".join(names)),
            filename=files.pop() if len(files) == 1 else "",
        )
        ident = f"{frame.name};{frame.filename};0"
        f = frame_ids.get(ident)
        if f is None:
            f = frame_ids[ident] = len(frames)
            frames.append(frame)
        nodes.append((new_index[parent] if parent >= 0 else -1, f, samples))

    if -1 in shared:
        add_shared(-1)
    for i in range(n):
        if not keep[i] or counts[i] <= 0:
            continue
        f = frame_ids.get(idents[i])
        if f is None:
            f = frame_ids[idents[i]] = len(frames)
            frames.append(_frame(idents[i], descs[i]))
        parent = parents[i]
        new_index[i] = len(nodes)
        nodes.append((new_index[parent] if parent >= 0 else -1, f, counts[i]))
        if i in shared:
            add_shared(i)
    return frames, nodes


def _count_leaves(
    counts: list[int], children: list[list[int]], parents: list[int], total: int
) -> tuple[list[int], dict[int, tuple[int, list[int]]]]:
    """Inclusive counts for a tree whose counts leave out each sample's innermost frame,
    and the samples that several innermost callees of one caller shared: ``{caller (-1 for
    the top level): (samples, the callees)}``.

    ``counts[i]`` is the number of samples in which frame ``i`` had a callee on the stack;
    under a parent, ``parent - sum(children)`` samples ended in one of the children. Those
    are the children's own samples, shared out as described in :func:`flatten_profile`;
    a frame's inclusive count is then ``counts[i] + own[i]``.
    """
    own = [0] * len(counts)
    shared: dict[int, tuple[int, list[int]]] = {}
    top = [i for i, p in enumerate(parents) if p < 0]
    for parent, parent_count, kids in [
        (-1, total, top),
        *((i, counts[i], children[i]) for i in range(len(counts))),
    ]:
        if not kids:
            continue
        missing = parent_count - sum(counts[k] for k in kids)
        if missing <= 0:
            continue
        zero = [k for k in kids if counts[k] == 0]
        if len(zero) == 1:
            own[zero[0]] += missing
        elif zero:
            shared[parent] = (missing, zero)
        else:
            weight = sum(counts[k] for k in kids)
            given = 0
            for k in kids:
                add = missing * counts[k] // weight
                own[k] += add
                given += add
            own[max(kids, key=lambda k: counts[k])] += missing - given
    return [c + o for c, o in zip(counts, own, strict=True)], shared


def _keep(
    counts: list[int], parents: list[int], n: int, limit: int = MAX_EVENT_NODES
) -> list[bool]:
    if n <= limit:
        return [True] * n
    # A child never has more samples than its parent, so a count threshold keeps every
    # kept node's ancestors; ties at the threshold are cut in pre-order.
    threshold = sorted(counts, reverse=True)[limit - 1]
    keep = [False] * n
    kept = 0
    for i in range(n):
        if counts[i] > threshold:
            keep[i] = parents[i] < 0 or keep[parents[i]]
            kept += keep[i]
    for i in range(n):
        if kept >= limit:
            break
        if counts[i] == threshold and (parents[i] < 0 or keep[parents[i]]):
            keep[i] = True
            kept += 1
    return keep


def _frame(ident: str, desc: dict[str, Any]) -> ProfileFrame:
    name, filename, first = desc.get("name", ""), desc.get("filename", ""), 0
    parts = ident.rsplit(";", 2)
    if len(parts) == 3:
        name, filename = parts[0], parts[1]
        try:
            first = int(parts[2])
        except ValueError:
            first = 0
    line_number = desc.get("line_number", 0)
    return ProfileFrame(
        name=_cut(name or ident),
        filename=_cut(filename),
        first_line=first if type(first) is int else 0,
        line_number=line_number if type(line_number) is int else 0,
        line=_cut((desc.get("line") or "").strip(), LINE_MAX),
    )


def profile_event(
    worker: str, prefix: str, start: float, stop: float, tree: dict[str, Any], interval: float
) -> ProfileEvent:
    """Deferred builder (runs on the agent thread): one prefix's tree of one cycle."""
    frames, nodes = flatten_profile(tree)
    return ProfileEvent(
        worker=_cut(worker),
        prefix=_cut(prefix),
        start=start,
        stop=max(start, stop),
        frames=frames,
        nodes=nodes,
        interval=interval,
    )


class ProfileShipper:
    """Takes each profile cycle a worker closes and queues its per-prefix trees.

    Polled from a periodic callback on the worker's event loop; a poll only walks the
    cycles closed since the last one (from the right end of the deque). Trees in the
    history are never changed again by Dask (a cycle swaps in fresh trees), so the agent
    thread can flatten them later without a copy. Cycles closed before the shipper
    started are not sent: they belong to runs before recording began.
    """

    def __init__(self, worker: Any, agent: Any, interval: float = 5.0) -> None:
        import dask.config
        from dask.utils import parse_timedelta

        self.worker = worker
        self.agent = agent
        self.address = str(worker.address)
        self.interval = float(
            parse_timedelta(dask.config.get("distributed.worker.profile.interval"), default="ms")
        )
        self.cycle = float(
            parse_timedelta(dask.config.get("distributed.worker.profile.cycle"), default="ms")
        )
        history = worker.profile_keys_history
        self.last = history[-1][0] if history else 0.0
        self.enabled = True
        # Seconds between polls: each cycle stays its own event, but cycles shipped
        # together share a batch's compression (~40% smaller on the wire). Never slower
        # than a quarter of the history Dask keeps, so no cycle is missed.
        kept = (history.maxlen or 1000) * self.cycle
        self.every = max(self.cycle, min(interval, kept / 4))

    def set_enabled(self, enabled: bool) -> None:
        """Stop or resume shipping; cycles closed while stopped are not sent."""
        if enabled and not self.enabled:
            history = self.worker.profile_keys_history
            self.last = history[-1][0] if history else self.last
        self.enabled = enabled

    def poll(self) -> int:
        """Queue the cycles closed since the last poll; returns how many events."""
        if not self.enabled:
            return 0
        history = self.worker.profile_keys_history
        fresh: list[tuple[float, dict[str, Any]]] = []
        prev = None
        for t, trees in reversed(history):
            if t <= self.last:
                prev = t
                break
            fresh.append((t, trees))
        if not fresh:
            return 0
        fresh.reverse()
        if len(fresh) == len(history) and self.last:
            # The deque wrapped since the last poll (it holds fewer cycles than we missed):
            # count what could not be recovered.
            missed = int((fresh[0][0] - self.last) / self.cycle) - 1
            if missed > 0:
                self.agent.drop("profile_history_wrapped", missed)
        sent = 0
        start = prev if prev is not None else fresh[0][0] - self.cycle
        for t, trees in fresh:
            for prefix, tree in trees.items():
                if tree.get("count"):
                    self.agent.add(
                        (profile_event, self.address, prefix, start, t, tree, self.interval)
                    )
                    sent += 1
            start = t
        self.last = fresh[-1][0]
        return sent

    def final(self) -> None:
        """At teardown: the cycles not yet taken and the cycle in progress."""
        self.poll()
        if not self.enabled:
            return
        now = time.time() + getattr(self.worker, "scheduler_delay", 0.0)
        start = self.last or now - self.cycle
        for prefix, tree in list(self.worker.profile_keys.items()):
            if tree.get("count"):
                # The current cycle's trees are still being sampled: flatten them now.
                self.agent.add(profile_event(self.address, prefix, start, now, tree, self.interval))


# -- fine performance metrics and code ---------------------------------------------------
def activity_metrics(metrics: dict[Any, Any]) -> dict[tuple[str, str, str, str], float]:
    """``Span.cumulative_worker_metrics`` as (context, prefix, activity, unit) -> value.

    Keys are ``(context, prefix, activity, unit)`` today; Dask says other shapes may come,
    so any tuple maps to its first element, its middle ones joined, and its last two."""
    out: dict[tuple[str, str, str, str], float] = {}
    for key, value in metrics.items():
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            continue
        value = float(value)
        if not math.isfinite(value):
            continue
        if isinstance(key, tuple) and len(key) >= 3:
            parts = [str(k) for k in key]
            ctx, prefix, activity, unit = parts[0], ";".join(parts[1:-2]), parts[-2], parts[-1]
        else:
            ctx, prefix, activity, unit = "other", "", str(key), ""
        if abs(value) > 1e15:
            continue
        out[(_cut(ctx, 64), _cut(prefix), _cut(activity, 64), _cut(unit, 64))] = value
    return out


def trim_code(code: str, relative: int) -> str:
    """At most ``CODE_MAX`` characters of a frame's source, around line ``relative``."""
    if len(code) <= CODE_MAX:
        return code
    lines = code.splitlines(keepends=True)
    at = min(max(relative, 0), max(len(lines) - 1, 0))
    lo = hi = at
    size = len(lines[at]) if lines else 0
    while True:
        grew = False
        if lo > 0 and size + len(lines[lo - 1]) <= CODE_MAX:
            lo -= 1
            size += len(lines[lo])
            grew = True
        if hi + 1 < len(lines) and size + len(lines[hi + 1]) <= CODE_MAX:
            hi += 1
            size += len(lines[hi])
            grew = True
        if not grew:
            break
    return "".join(lines[lo : hi + 1])[:CODE_MAX]


def code_event(run: str, sources: tuple[Any, ...], now: float) -> CodeEvent:
    frames = []
    for sc in sources[:MAX_CODE_FRAMES]:
        code = str(getattr(sc, "code", "") or "")
        relative = int(getattr(sc, "lineno_relative", 0) or 0)
        lo = 0
        if len(code) > CODE_MAX:
            trimmed = trim_code(code, relative)
            lo = code[: code.find(trimmed)].count("\n") if trimmed in code else 0
            code = trimmed
        frames.append(
            CodeFrame(
                code=code,
                filename=_cut(getattr(sc, "filename", "") or ""),
                lineno_frame=int(getattr(sc, "lineno_frame", 0) or 0),
                lineno_relative=relative - lo,
            )
        )
    return CodeEvent(run=run, time=now, frames=frames)


def heartbeat_interval(n_workers: int) -> float:
    """Dask's worker heartbeat interval for a cluster of ``n_workers`` (``heartbeat_interval``
    in distributed.scheduler)."""
    if n_workers <= 10:
        return 0.5
    if n_workers < 50:
        return 1.0
    if n_workers < 200:
        return 2.0
    return n_workers / 200 + 1


class RunPerf:
    """Sends each run's fine performance metrics and submitting code from its span.

    ``sample(open_runs)`` runs once per sample interval on the scheduler's event loop.
    Values are cumulative, so only what changed since the last send goes out. A run that
    finished is watched for ``grace`` more seconds (a few worker heartbeats), which brings
    in the metrics of its last tasks.
    """

    #: Minimum seconds a finished run is still watched.
    GRACE = 5.0

    def __init__(self, agent: Any, scheduler: Any) -> None:
        self.agent = agent
        self.scheduler = scheduler
        self.spans = scheduler.extensions.get("spans")
        self._sent: dict[str, dict[tuple[str, str, str, str], float]] = {}
        self._code: dict[str, set[Any]] = {}
        self._until: dict[str, float] = {}

    def watch(self, run: str) -> None:
        """A run opened: watch it until it has finished (and a grace period after)."""
        self._until[run] = math.inf

    def sample(self, open_runs: Any, closing: bool = False) -> None:
        if self.spans is None:
            return
        now = time.time()
        grace = max(self.GRACE, 4 * heartbeat_interval(len(self.scheduler.workers)))
        watched = set(self._until)
        for run in open_runs:
            self._until[run] = math.inf
        for run in watched - set(open_runs):
            if self._until[run] == math.inf:
                self._until[run] = now + grace
        for run, until in list(self._until.items()):
            span = self.spans.spans.get(run)
            if span is not None:
                self._send(run, span, now)
            if span is None or closing or now > until:
                del self._until[run]
                self._sent.pop(run, None)
                self._code.pop(run, None)

    def _send(self, run: str, span: Any, now: float) -> None:
        metrics = activity_metrics(span.cumulative_worker_metrics)
        sent = self._sent.setdefault(run, {})
        changed = [
            ActivityMetric(context=k[0], prefix=k[1], activity=k[2], unit=k[3], value=v)
            for k, v in metrics.items()
            if sent.get(k) != v
        ]
        if changed:
            sent.update(metrics)
            self.agent.add(ActivityEvent(run=run, time=now, metrics=changed))
        seen = self._code.setdefault(run, set())
        if len(seen) >= MAX_CODE_PER_RUN:
            return
        # The tuples of SourceCode are hashable and their strings cache their hashes, so
        # checking a run's submissions again each sample is cheap.
        for sources in span.code:
            if sources in seen:
                continue
            seen.add(sources)
            self.agent.add(code_event(run, tuple(sources), now))
            if len(seen) >= MAX_CODE_PER_RUN:
                return


def enable_code_capture(frames: int) -> None:
    """Make clients in this process send the code that submits each computation: raise
    ``distributed.diagnostics.computations.nframes`` to ``frames`` (never lower it)."""
    if frames <= 0:
        return
    import dask.config

    try:
        current = int(dask.config.get(NFRAMES_KEY, 0) or 0)
    except (TypeError, ValueError):
        current = 0
    if current < frames:
        dask.config.set({NFRAMES_KEY: frames})
