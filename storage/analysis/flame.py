"""Profiles in the shapes people read: a JSON call tree, folded stacks, speedscope's JSON,
the hottest functions, and the difference of two profiles."""

from __future__ import annotations

from typing import Any

from storage.analysis.profile import FrameKey, Node, Profile

#: Depth past which a JSON tree is cut (its samples stay counted in the cut frame).
MAX_DEPTH = 256


def where(filename: str, first: int) -> str:
    """A function's place: ``file:first line``; the file alone for a frame with no first
    line (``one of: f, g``, callees Dask's profile does not tell apart), else ""."""
    return f"{filename}:{first}" if filename and first else filename


def label(key: FrameKey) -> str:
    """A frame as one folded-stack element: ``name (file:line)``, without ``;`` or
    whitespace breaks (folded stacks split on both)."""
    name, filename, first = key
    text = f"{name} ({where(filename, first)})" if filename else name
    return text.replace(";", ":").replace("\n", " ").replace("\r", " ")


def _frame(p: Profile, fid: int) -> dict[str, Any]:
    key = p.keys[fid]
    line_number, line = p.lines[fid]
    return {
        "name": key[0],
        "filename": key[1],
        "first_line": key[2],
        "line_number": line_number,
        "line": line,
    }


def tree_json(p: Profile, max_depth: int = MAX_DEPTH) -> dict[str, Any]:
    """The call tree as nested JSON; children sorted by samples, most first.
    ``samples`` includes callees, ``self`` does not."""

    def one(fid: int | None, node: Node, depth: int) -> dict[str, Any]:
        kids = sorted(node.children.items(), key=lambda kv: -kv[1].count)
        out: dict[str, Any] = dict(ROOT) if fid is None else _frame(p, fid)
        out["samples"] = node.count
        out["self"] = node.count - sum(c.count for c in node.children.values())
        out["children"] = [one(k, c, depth + 1) for k, c in kids] if depth < max_depth else []
        if depth >= max_depth and kids:
            out["self"] = node.count
        return out

    return one(None, p.root, 0)


ROOT = {"name": "all", "filename": "", "first_line": 0, "line_number": 0, "line": ""}


def walk(p: Profile) -> Any:
    """(stack of frame ids, node) for every node, pre-order."""
    stack: list[tuple[tuple[int, ...], Node]] = [((), p.root)]
    while stack:
        path, node = stack.pop()
        if path:
            yield path, node
        for key, child in node.children.items():
            stack.append(((*path, key), child))


def collapsed(p: Profile) -> str:
    """Brendan Gregg's folded stacks: ``frame;frame;frame COUNT`` a line, counts being a
    stack's own samples (flamegraph.pl, speedscope and inferno read it)."""
    lines = []
    for path, node in walk(p):
        own = node.count - sum(c.count for c in node.children.values())
        if own > 0:
            lines.append(f"{';'.join(label(p.keys[f]) for f in path)} {own}")
    lines.sort()
    return "\n".join(lines) + ("\n" if lines else "")


def speedscope(p: Profile, name: str) -> dict[str, Any]:
    """speedscope's file format: one sampled profile, weights in seconds."""
    frames: list[dict[str, Any]] = []
    index: dict[int, int] = {}
    samples: list[list[int]] = []
    weights: list[float] = []
    for path, node in walk(p):
        own = node.count - sum(c.count for c in node.children.values())
        if own <= 0:
            continue
        stack = []
        for fid in path:
            i = index.get(fid)
            if i is None:
                i = index[fid] = len(frames)
                key = p.keys[fid]
                frames.append({"name": key[0], "file": key[1], "line": key[2]})
            stack.append(i)
        samples.append(stack)
        weights.append(own * p.interval)
    total = sum(weights)
    return {
        "$schema": "https://www.speedscope.app/file-format-schema.json",
        "shared": {"frames": frames},
        "profiles": [
            {
                "type": "sampled",
                "name": name,
                "unit": "seconds",
                "startValue": 0,
                "endValue": total,
                "samples": samples,
                "weights": weights,
            }
        ],
        "name": name,
        "activeProfileIndex": 0,
        "exporter": "hindsight",
    }


def top(p: Profile, n: int = 20) -> list[dict[str, Any]]:
    """The functions with the most samples of their own (``self``), with their samples
    including callees (``samples``, a recursive function counted once per stack)."""
    own: dict[int, int] = {}
    total: dict[int, int] = {}
    for path, node in walk(p):
        key = path[-1]
        own[key] = own.get(key, 0) + node.count - sum(c.count for c in node.children.values())
        if key not in path[:-1]:
            total[key] = total.get(key, 0) + node.count
    ranked = sorted(own, key=lambda k: (-own[k], -total.get(k, 0), p.keys[k]))[:n]
    return [
        {
            **_frame(p, k),
            "self": own[k],
            "samples": total.get(k, 0),
            "self_seconds": own[k] * p.interval,
        }
        for k in ranked
    ]


def summary(p: Profile, **extra: Any) -> dict[str, Any]:
    """The JSON answer for one profile: totals, the tree and the hottest functions."""
    return {
        **extra,
        "samples": p.samples,
        "interval": p.interval,
        "seconds": p.samples * p.interval,
        "top": top(p),
        "tree": tree_json(p),
    }


def diff(a: Profile, b: Profile, max_depth: int = MAX_DEPTH) -> dict[str, Any]:
    """What changed from ``a`` to ``b``: the union of both trees, each frame with its
    samples in a and b, its seconds (samples x interval: ``seconds_a``, ``seconds_b``) and
    its share of each profile's samples (``share_a``, ``share_b``). ``delta`` is the change
    in seconds: a frame 2x slower is a positive delta even when another grew more and its
    share fell (``share_delta``)."""
    ta, tb = a.samples or 1, b.samples or 1
    ia, ib = a.interval, b.interval

    def by_key(p: Profile, node: Node | None) -> dict[FrameKey, tuple[int, Node]]:
        return {p.keys[f]: (f, c) for f, c in node.children.items()} if node else {}

    def one(frame: dict[str, Any], na: Node | None, nb: Node | None, depth: int) -> dict[str, Any]:
        out = dict(frame)
        ca, cb = (na.count if na else 0), (nb.count if nb else 0)
        out.update(a=ca, b=cb, share_a=ca / ta, share_b=cb / tb, share_delta=cb / tb - ca / ta)
        out.update(seconds_a=ca * ia, seconds_b=cb * ib, delta=cb * ib - ca * ia)
        ka, kb = by_key(a, na), by_key(b, nb)
        kids = []
        for key in ka.keys() | kb.keys():
            xa, xb = ka.get(key), kb.get(key)
            shown = _frame(b, xb[0]) if xb else _frame(a, xa[0])  # type: ignore[index]
            kids.append((shown, xa[1] if xa else None, xb[1] if xb else None))
        kids.sort(key=lambda t: -max(t[1].count if t[1] else 0, t[2].count if t[2] else 0))
        out["children"] = [one(f, x, y, depth + 1) for f, x, y in kids] if depth < max_depth else []
        return out

    return one(ROOT, a.root, b.root, 0)


def collapsed_diff(a: Profile, b: Profile) -> str:
    """Folded stacks with two counts, ``stack A B`` (the input of flamegraph.pl's
    differential mode, as difffolded.pl writes it)."""
    own: dict[tuple[FrameKey, ...], list[int]] = {}
    for i, p in enumerate((a, b)):
        for path, node in walk(p):
            c = node.count - sum(x.count for x in node.children.values())
            if c > 0:
                own.setdefault(tuple(p.keys[f] for f in path), [0, 0])[i] += c
    lines = [f"{';'.join(label(k) for k in path)} {ca} {cb}" for path, (ca, cb) in own.items()]
    lines.sort()
    return "\n".join(lines) + ("\n" if lines else "")
