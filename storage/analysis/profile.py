"""A statistical profile as a call tree: building, merging, pruning, and its compact form
at rest (integers only, zstd-compressed)."""

from __future__ import annotations

import re
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import zstandard

from hindsight.schema import ProfileEvent

ZSTD_LEVEL = 3

FrameKey = tuple[str, str, int]  # function name, filename, first line


class Node:
    """A frame in a call tree: samples with it on the stack, and its callees by frame id."""

    __slots__ = ("count", "children")

    def __init__(self) -> None:
        self.count = 0
        self.children: dict[int, Node] = {}


@dataclass
class Profile:
    """A call tree. ``root.count`` is every sample. Nodes refer to frames by id, which
    keeps merging to integer lookups: ``keys[id]`` is a frame's identity and ``lines[id]``
    a sampled line number and its source text, for display. Trees read from the index
    use the tenant's frame ids (``profile_frames``); trees built in memory number their
    frames from 0."""

    root: Node = field(default_factory=Node)
    keys: dict[int, FrameKey] = field(default_factory=dict)
    lines: dict[int, tuple[int, str]] = field(default_factory=dict)
    ids: dict[FrameKey, int] = field(default_factory=dict)
    interval: float = 0.01
    _next: int = 0

    @property
    def samples(self) -> int:
        return self.root.count

    def intern(self, key: FrameKey, line: tuple[int, str]) -> int:
        i = self.ids.get(key)
        if i is None:
            i = self.ids[key] = self._next
            self._next += 1
            self.keys[i] = key
            self.lines[i] = line
        return i

    def size(self) -> int:
        n, stack = 0, [self.root]
        while stack:
            node = stack.pop()
            n += len(node.children)
            stack.extend(node.children.values())
        return n

    def frame_ids(self) -> set[int]:
        out: set[int] = set()
        stack = [self.root]
        while stack:
            node = stack.pop()
            out.update(node.children)
            stack.extend(node.children.values())
        return out


def _add_nodes(p: Profile, remap: list[int] | None, parents: Any, frames: Any, counts: Any) -> None:
    """Add pre-order nodes (already checked), frames given in ``p``'s ids via ``remap``
    (None: they are ``p``'s ids already)."""
    placed: list[Node] = []
    append = placed.append
    root = p.root
    top = 0
    for parent, f, c in zip(parents, frames, counts, strict=True):
        if parent < 0:
            up = root
            top += c
        else:
            up = placed[parent]
        fid = remap[f] if remap is not None else f
        child = up.children.get(fid)
        if child is None:
            child = up.children[fid] = Node()
        child.count += c
        append(child)
    root.count += top


def add_flat(
    p: Profile,
    frames: list[tuple[str, str, int, int, str]],
    nodes: list[tuple[int, int, int]],
) -> bool:
    """Add a flat pre-order tree (frames as (name, filename, first_line, line_number,
    line); nodes as (parent, frame, samples)). A malformed tree (a parent that is not an
    earlier node, a frame out of range) is skipped whole; returns whether it was added."""
    n_frames = len(frames)
    for i, (parent, f, c) in enumerate(nodes):
        if not (-1 <= parent < i) or not (0 <= f < n_frames) or c < 0:
            return False
    remap = [p.intern((n, fn, first), (ln, line)) for n, fn, first, ln, line in frames]
    _add_nodes(p, remap, [n[0] for n in nodes], [n[1] for n in nodes], [n[2] for n in nodes])
    return True


def add_event(p: Profile, ev: ProfileEvent) -> bool:
    """Add one ``profile`` event's tree."""
    p.interval = ev.interval
    frames = [(f.name, f.filename, f.first_line, f.line_number, f.line) for f in ev.frames]
    return add_flat(p, frames, ev.nodes)  # type: ignore[arg-type]


def merge_into(dst: Profile, src: Profile) -> None:
    """Add ``src``'s samples to ``dst``."""
    remap = {f: dst.intern(k, src.lines[f]) for f, k in src.keys.items()}
    dst.root.count += src.root.count
    stack = [(dst.root, src.root)]
    while stack:
        d, s = stack.pop()
        for fid, sc in s.children.items():
            key = remap[fid]
            dc = d.children.get(key)
            if dc is None:
                dc = d.children[key] = Node()
            dc.count += sc.count
            if sc.children:
                stack.append((dc, sc))


def prune(p: Profile, max_nodes: int) -> None:
    """Keep at most ``max_nodes`` nodes: the least-sampled frames are folded into their
    callers (a callee never has more samples than its caller, so a count threshold keeps
    every kept node's callers)."""
    counts: list[int] = []
    stack = [p.root]
    while stack:
        node = stack.pop()
        for c in node.children.values():
            counts.append(c.count)
            stack.append(c)
    if len(counts) <= max_nodes:
        return
    threshold = sorted(counts, reverse=True)[max_nodes - 1]
    budget = max_nodes - sum(1 for c in counts if c > threshold)
    # Pre-order walk, children in order of samples: ties at the threshold are kept first
    # come, first served until the budget is spent.
    stack = [p.root]
    while stack:
        node = stack.pop()
        kept: dict[int, Node] = {}
        for key, c in sorted(node.children.items(), key=lambda kv: -kv[1].count):
            if c.count > threshold or (c.count == threshold and budget > 0):
                if c.count == threshold:
                    budget -= 1
                kept[key] = c
        node.children = kept
        stack.extend(reversed(kept.values()))


# A tree at rest: b"HSP3", the sampling interval (float64), the node count n (uint32), then
# pre-order nodes as three little-endian arrays: parent index (int32, -1 for a top-level
# frame), the tenant's frame id (int64; frames are stored once per tenant in
# ``profile_frames``) and samples (int64); zstd-compressed. Integers only: small at rest,
# and many trees merge as arrays without parsing anything.
_MAGIC = b"HSP3"
_HEAD = struct.Struct("<4sdI")


def flatten(p: Profile) -> tuple[list[int], list[int], list[int]]:
    """Pre-order (parents, frame ids, counts), children by samples, most first."""
    parents: list[int] = []
    frames: list[int] = []
    counts: list[int] = []
    stack: list[tuple[int, Node, int]] = [
        (k, c, -1) for k, c in sorted(p.root.children.items(), key=lambda kv: kv[1].count)
    ]
    while stack:
        fid, node, parent = stack.pop()
        i = len(parents)
        parents.append(parent)
        frames.append(fid)
        counts.append(node.count)
        stack.extend(
            (k, c, i) for k, c in sorted(node.children.items(), key=lambda kv: kv[1].count)
        )
    return parents, frames, counts


def encode(p: Profile, global_ids: dict[int, int]) -> bytes:
    """The tree at rest, its frames renumbered to the tenant's ids (``global_ids``)."""
    import numpy as np

    parents, frames, counts = flatten(p)
    body = b"".join(
        (
            _HEAD.pack(_MAGIC, p.interval, len(parents)),
            np.asarray(parents, dtype="<i4").tobytes(),
            np.asarray([global_ids[f] for f in frames], dtype="<i8").tobytes(),
            np.asarray(counts, dtype="<i8").tobytes(),
        )
    )
    return zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(body)


def _arrays(data: bytes) -> tuple[float, Any, Any, Any]:
    import numpy as np

    raw = zstandard.ZstdDecompressor().decompress(data)
    magic, interval, n = _HEAD.unpack_from(raw)
    if magic != _MAGIC or len(raw) != _HEAD.size + 20 * n:
        raise ValueError("not a stored profile tree")
    at = _HEAD.size
    parents = np.frombuffer(raw, dtype="<i4", count=n, offset=at)
    frames = np.frombuffer(raw, dtype="<i8", count=n, offset=at + 4 * n)
    counts = np.frombuffer(raw, dtype="<i8", count=n, offset=at + 12 * n)
    return interval, parents, frames, counts


def decode_into(p: Profile, data: bytes) -> None:
    """Add a stored tree to ``p``, in the tenant's frame ids; :func:`resolve` names the
    frames at the end."""
    interval, parents, frames, counts = _arrays(data)
    p.interval = interval
    _add_nodes(p, None, parents.tolist(), frames.tolist(), counts.tolist())


def merge_stored(datas: Iterable[bytes]) -> Profile:
    """Stored trees merged into one, in the tenant's frame ids. (Merging the arrays
    level by level with numpy was measured no faster than this loop: decoding is free.)"""
    out = Profile()
    for data in datas:
        decode_into(out, data)
    return out


#: The file cloudpickle gives functions it ships by value (those of ``__main__``: a script,
#: a notebook): their first line stays, their file does not.
DYNAMIC_FILE = "<dynamic-code>"


def name_dynamic_frames(p: Profile, sources: Iterable[tuple[str, str, int]]) -> int:
    """Give frames of functions shipped by value (``<dynamic-code>``) the file they were
    written in, where the submitting code holds a ``def``/``class`` of that name at that
    first line. ``sources`` are (filename, source text, the text's first line in the
    file); returns how many frames were named."""
    found: dict[tuple[str, int], str] = {}
    for filename, code, start in sources:
        for offset, text in enumerate(code.splitlines()):
            head = _DEF.match(text)
            if head:
                found.setdefault((head.group(1), start + offset), filename)
    named = 0
    for fid, (name, filename, first) in list(p.keys.items()):
        script = found.get((name, first)) if filename == DYNAMIC_FILE else None
        if script is None:
            continue
        key = (name, script, first)
        p.ids.pop((name, filename, first), None)
        p.keys[fid] = key
        p.ids.setdefault(key, fid)
        named += 1
    return named


_DEF = re.compile(r"\s*(?:async\s+def|def|class)\s+([A-Za-z_][A-Za-z0-9_]*)")
