"""Why a run was slower (or faster) than its job's usual runs: a verdict by statistics and
findings ranked by the seconds of makespan each explains. Pure: the query layer reads the
facts (``storage.query.explain``); docs/explain.md says how the numbers are decided.

A run's facts, as this module takes them (a dict; every key optional but ``makespan``)::

    {"id": public id, "makespan": s, "errors": n,
     "prefixes": {prefix: {"tasks": n, "compute": s, "nbytes": b, "errors": n,
                           "hist": {bucket: count}}},
     "activity": {activity: thread-seconds},
     "frames": {prefix: {(function, file, line): seconds}},   # inclusive, samples x interval
     "versions": {package: version}, "cluster": {"workers": n, "threads": n,
     "memory_limit": bytes}, "code": text}
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

import numpy as np

from storage.analysis import sketch

#: Fewer usual runs than this before a run: its job has no history to judge it by.
MIN_HISTORY = 3
#: The most recent usual runs a run is judged against.
BASELINE_RUNS = 20
#: A run is changed when its makespan is this many robust standard deviations (1.4826 x the
#: median absolute deviation) from the baseline's median: Iglewicz and Hoaglin's cut-off for
#: the modified z-score.
Z_CUTOFF = 3.5
#: The spread is never taken below this share of the median: a baseline of near-identical
#: runs would otherwise call a scheduling hiccup a change.
MIN_SPREAD = 0.03
#: A step is slower or faster when the rank test's p-value is below this.
P_STEP = 0.001
#: E-divisive: permutations of the significance test, and its level.
PERMUTATIONS = 99
P_CHANGE = 0.01
#: Findings explaining less than this share of the change are left out (noise).
MIN_SHARE = 0.05
ACTIVITIES = (
    "thread-cpu",
    "thread-noncpu",
    "disk-read",
    "disk-write",
    "deserialize",
    "serialize",
    "compress",
    "decompress",
    "transfer",
    "memory-read",
    "spill",
    "idle",
)


# ------------------------------------------------------------------------------ statistics


def robust_center(values: Sequence[float]) -> tuple[float, float]:
    """The median and a robust standard deviation (1.4826 x MAD, at least
    :data:`MIN_SPREAD` of the median)."""
    med = statistics.median(values)
    mad = statistics.median(abs(v - med) for v in values)
    return med, max(1.4826 * mad, MIN_SPREAD * abs(med), 1e-9)


def _best_split(d: np.ndarray, min_size: int) -> tuple[int, float]:
    """The split of a series with pairwise distances ``d`` that maximises the E-statistic
    (Matteson and James, 2014), and that statistic: every split at once from the summed
    area table of ``d``."""
    n = len(d)
    s = np.zeros((n + 1, n + 1))
    s[1:, 1:] = d.cumsum(0).cumsum(1)
    tau = np.arange(min_size, n - min_size + 1)
    if not len(tau):
        return -1, -math.inf
    within_a = s[tau, tau]
    total = s[n, n]
    between = s[tau, n] - within_a
    within_b = total - 2 * between - within_a
    a, b = tau.astype(float), (n - tau).astype(float)
    e = 2 * between / (a * b) - within_a / (a * a) - within_b / (b * b)
    e = e * a * b / n
    i = int(np.argmax(e))
    return int(tau[i]), float(e[i])


def change_points(series: Sequence[float], *, min_size: int = 3, seed: int = 0) -> list[int]:
    """E-divisive means: indices where ``series`` changes in distribution, each split kept
    when a permutation test finds it significant at :data:`P_CHANGE` (the method of
    MongoDB's signal processing and Apache Otava, in numpy)."""
    x = np.asarray(series, dtype=float)
    rng = np.random.default_rng(seed)
    found: list[int] = []
    segments = [(0, len(x))]
    while segments:
        lo, hi = segments.pop()
        seg = x[lo:hi]
        if len(seg) < 2 * min_size:
            continue
        d = np.abs(seg[:, None] - seg[None, :])
        tau, e = _best_split(d, min_size)
        if tau < 0:
            continue
        beaten = 0
        for _ in range(PERMUTATIONS):
            perm = rng.permutation(len(seg))
            beaten += _best_split(d[np.ix_(perm, perm)], min_size)[1] >= e
        if (beaten + 1) / (PERMUTATIONS + 1) > P_CHANGE:
            continue
        found.append(lo + tau)
        segments += [(lo, lo + tau), (lo + tau, hi)]
    return sorted(found)


def mann_whitney(a: dict[float, int], b: dict[float, int]) -> float:
    """Two-sided p-value of the Mann-Whitney U test of values given as {value: count}
    (histogram buckets): normal approximation with the tie correction."""
    n1, n2 = sum(a.values()), sum(b.values())
    if n1 == 0 or n2 == 0:
        return 1.0
    values = sorted(set(a) | set(b))
    rank_sum_a, below, ties = 0.0, 0, 0.0
    for v in values:
        t = a.get(v, 0) + b.get(v, 0)
        mid = below + (t + 1) / 2.0
        rank_sum_a += a.get(v, 0) * mid
        below += t
        ties += t**3 - t
    n = n1 + n2
    u = rank_sum_a - n1 * (n1 + 1) / 2.0
    mu = n1 * n2 / 2.0
    var = n1 * n2 / 12.0 * ((n + 1) - ties / (n * (n - 1))) if n > 1 else 0.0
    if var <= 0:
        return 1.0
    z = (abs(u - mu) - 0.5) / math.sqrt(var)
    return math.erfc(max(z, 0.0) / math.sqrt(2))


def _values(hist: dict[Any, int]) -> dict[float, int]:
    """A duration histogram as {representative duration: count}."""
    out: dict[float, int] = {}
    for b, c in hist.items():
        v = sketch.value(int(b))
        out[v] = out.get(v, 0) + int(c)
    return out


def _median_of(values: dict[float, int]) -> float | None:
    n = sum(values.values())
    if not n:
        return None
    seen = 0
    for v in sorted(values):
        seen += values[v]
        if seen * 2 >= n:
            return v
    return None


# ------------------------------------------------------------------------------ the baseline


def baseline(history: Sequence[float]) -> list[int]:
    """Indices of ``history`` (oldest first) that are the job's usual runs now: those after
    the last change point in the makespans (when that leaves :data:`MIN_HISTORY`), less the
    runs that were themselves changed against the rest, the latest :data:`BASELINE_RUNS`."""
    idx = list(range(len(history)))
    window = idx[-4 * BASELINE_RUNS :]
    cps = change_points([history[i] for i in window]) if len(window) >= 6 else []
    if cps and len(window) - cps[-1] >= MIN_HISTORY:
        window = window[cps[-1] :]
    if len(window) < MIN_HISTORY:
        return window
    med, spread = robust_center([history[i] for i in window])
    usual = [i for i in window if abs(history[i] - med) / spread <= Z_CUTOFF]
    return usual[-BASELINE_RUNS:]


def verdict(
    makespan: float, base: Sequence[float], *, chosen: bool = False
) -> tuple[str, float | None, float | None]:
    """(verdict, change as a fraction of the baseline's median, the baseline's median).
    ``chosen``: one run the user picked; with no spread to judge by, a change beyond the
    spread floor times the cut-off counts."""
    if len(base) < MIN_HISTORY:
        if chosen and len(base) == 1 and base[0] > 0:
            change = makespan / base[0] - 1
            if abs(change) <= 3 * MIN_SPREAD * Z_CUTOFF:
                return "normal", change, base[0]
            return ("slower" if change > 0 else "faster"), change, base[0]
        return "no history", None, None
    med, spread = robust_center(base)
    change = makespan / med - 1 if med else None
    z = (makespan - med) / spread
    if z > Z_CUTOFF:
        return "slower", change, med
    if z < -Z_CUTOFF:
        return "faster", change, med
    return "normal", change, med


# ------------------------------------------------------------------------------ findings


def _median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else 0.0


def _concurrency(run: dict[str, Any]) -> float:
    """Average busy threads over the run: thread-seconds per second of makespan."""
    busy = sum(p.get("compute", 0.0) for p in run.get("prefixes", {}).values())
    ms = run.get("makespan") or 0.0
    return max(busy / ms, 1.0) if ms > 0 else 1.0


def _finding(kind: str, seconds: float | None, text: str, **kw: Any) -> dict[str, Any]:
    out = {
        "kind": kind,
        "prefix": None,
        "activity": None,
        "frames": [],
        "what": None,
        "before": None,
        "after": None,
        "seconds": None if seconds is None else round(seconds, 3),
        "text": text,
    }
    out.update(kw)
    return out


def _steps(run: dict[str, Any], base: list[dict[str, Any]], c: float) -> list[dict[str, Any]]:
    out = []
    mine = run.get("prefixes", {})
    for p, cur in mine.items():
        before_s = _median([b.get("prefixes", {}).get(p, {}).get("compute", 0.0) for b in base])
        delta = cur.get("compute", 0.0) - before_s
        pooled: dict[float, int] = {}
        for b in base:
            for v, n in _values(b.get("prefixes", {}).get(p, {}).get("hist", {})).items():
                pooled[v] = pooled.get(v, 0) + n
        now = _values(cur.get("hist", {}))
        p_value = mann_whitney(pooled, now) if pooled and now else None
        m0, m1 = _median_of(pooled), _median_of(now)
        ratio = (m1 / m0) if m0 and m1 else None
        if p_value is not None and p_value >= P_STEP:
            continue  # task durations did not move: a count change is a data finding
        if p_value is None and before_s > 0:
            continue
        word = "new" if not before_s else f"{ratio:.2f}x per task" if ratio else "changed"
        out.append(
            _finding(
                "step",
                delta / c,
                f"step {p}: {before_s:.1f} -> {cur.get('compute', 0.0):.1f} thread-seconds"
                f" ({word}; median task {m0 or 0:.3g} s -> {m1 or 0:.3g} s)",
                prefix=p,
                what="thread-seconds",
                before=round(before_s, 3),
                after=round(cur.get("compute", 0.0), 3),
                ratio=None if ratio is None else round(ratio, 3),
                p_value=p_value,
            )
        )
    return out


def _activity(run: dict[str, Any], base: list[dict[str, Any]], c: float) -> list[dict[str, Any]]:
    out = []
    mine = run.get("activity", {})
    for a in ACTIVITIES:
        before = _median([b.get("activity", {}).get(a, 0.0) for b in base])
        after = mine.get(a, 0.0)
        if not before and not after:
            continue
        out.append(
            _finding(
                "activity",
                (after - before) / c,
                f"{a}: {before:.1f} -> {after:.1f} thread-seconds",
                activity=a,
                what="thread-seconds",
                before=round(before, 3),
                after=round(after, 3),
            )
        )
    return out


def _profile(run: dict[str, Any], base: list[dict[str, Any]], c: float) -> list[dict[str, Any]]:
    """Per step, the frames new or grown (inclusive seconds), deepest first: a frame whose
    growth one of its callees holds is the callee's caller, not the cause."""
    out = []
    for p, frames in run.get("frames", {}).items():
        tot_after = sum(frames.values()) or 1.0
        befores = [b.get("frames", {}).get(p, {}) for b in base]
        befores = [f for f in befores if f]
        tot_before = _median([sum(f.values()) for f in befores]) or 1.0
        grown = []
        for key, after in frames.items():
            before = _median([f.get(key, 0.0) for f in befores]) if befores else 0.0
            # a frame whose share of the step's samples did not grow only scales with it
            if after > before and (not before or after / tot_after > before / tot_before + 0.02):
                grown.append((after - before, key, before, after))
        if not grown:
            continue
        grown.sort(key=lambda g: -g[0])
        top = grown[0][0]
        # the deepest frame holding most of the top growth: the smallest inclusive time
        holders = [g for g in grown if g[0] >= 0.8 * top]
        delta, key, before, after = min(holders, key=lambda g: g[3])
        fn, file, line = key
        out.append(
            _finding(
                "profile",
                delta / c,
                f"in step {p}, {fn} ({file}:{line}): {before:.1f} -> {after:.1f} s of samples"
                + (" (new)" if not before else ""),
                prefix=p,
                frames=[
                    {
                        "function": fn,
                        "file": file,
                        "line": line,
                        "before_share": round(before / tot_before, 4),
                        "after_share": round(after / tot_after, 4),
                        "before_seconds": round(before, 3),
                        "after_seconds": round(after, 3),
                    }
                ],
                before=round(before, 3),
                after=round(after, 3),
            )
        )
    return out


def _data(run: dict[str, Any], base: list[dict[str, Any]], c: float) -> list[dict[str, Any]]:
    out = []
    for p, cur in run.get("prefixes", {}).items():
        for what, unit in (("tasks", "tasks"), ("nbytes", "bytes")):
            before = _median([b.get("prefixes", {}).get(p, {}).get(what, 0) for b in base])
            after = cur.get(what, 0)
            if before == after or not before:
                continue
            per_task = cur.get("compute", 0.0) / max(cur.get("tasks", 0), 1)
            seconds = (after - before) * per_task / c if what == "tasks" else None
            out.append(
                _finding(
                    "data",
                    seconds,
                    f"step {p}: {before:g} -> {after:g} {unit}",
                    prefix=p,
                    what=what,
                    before=before,
                    after=after,
                )
            )
    return out


def _environment(run: dict[str, Any], base: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    mine = run.get("versions") or {}
    if not base or not mine:
        return out
    usual = base[-1].get("versions") or {}
    for pkg in sorted(set(mine) | set(usual)):
        if mine.get(pkg) != usual.get(pkg) and usual:
            out.append(
                _finding(
                    "environment",
                    None,
                    f"{pkg} {usual.get(pkg) or '(absent)'} -> {mine.get(pkg) or '(absent)'}",
                    what=pkg,
                    before=usual.get(pkg),
                    after=mine.get(pkg),
                )
            )
    return out


def _cluster(run: dict[str, Any], base: list[dict[str, Any]], extra: float) -> list[dict]:
    out = []
    mine = run.get("cluster") or {}
    for what in ("workers", "threads", "memory_limit"):
        vals = [b.get("cluster", {}).get(what) for b in base if b.get("cluster", {}).get(what)]
        after = mine.get(what)
        if not vals or not after:
            continue
        before = _median(vals)
        before = int(before) if float(before).is_integer() else before
        if before == after:
            continue
        seconds = None
        if what == "threads":
            # the same work on fewer threads: the makespan grows by before/after at most
            base_ms = _median([b["makespan"] for b in base])
            seconds = min(max(extra, 0.0), base_ms * (before / after - 1)) if before > after else 0
        out.append(
            _finding(
                "cluster",
                seconds,
                f"{what}: {_shown(what, before)} -> {_shown(what, after)}",
                what=what,
                before=before,
                after=after,
            )
        )
    return out


def _shown(what: str, v: float) -> str:
    return f"{v / 2**30:.1f} GiB" if what == "memory_limit" else f"{v:g}"


def _code(run: dict[str, Any], base: list[dict[str, Any]]) -> list[dict[str, Any]]:
    mine = run.get("code")
    before = base[-1].get("code") if base else None
    if not mine or not before or mine == before:
        return []
    import difflib

    diff = list(
        difflib.unified_diff(before.splitlines(), mine.splitlines(), "before", "after", lineterm="")
    )
    changed = sum(1 for d in diff if d[:1] in "+-" and d[:3] not in ("+++", "---"))
    return [
        _finding(
            "code",
            None,
            f"the submitting code changed ({changed} lines)",
            what="diff",
            before=None,
            after="\n".join(diff[:200]),
        )
    ]


def _failures(run: dict[str, Any], base: list[dict[str, Any]]) -> list[dict[str, Any]]:
    before = _median([b.get("errors", 0) for b in base])
    after = run.get("errors", 0)
    if after <= before:
        return []
    return [
        _finding(
            "failures",
            None,
            f"{after:g} failed tasks (usually {before:g})",
            what="errors",
            before=before,
            after=after,
        )
    ]


def explain(
    run: dict[str, Any], history: Sequence[dict[str, Any]], *, chosen: bool = False
) -> dict[str, Any]:
    """``run`` against ``history`` (the job's earlier runs, oldest first; with ``chosen``,
    the runs to compare with as they are): the verdict and the ranked findings."""
    hist = [h for h in history if h.get("makespan")]
    picked = list(hist) if chosen else [hist[i] for i in baseline([h["makespan"] for h in hist])]
    ms = run.get("makespan") or 0.0
    if ms <= 0:  # no task ran (or none was recorded): nothing to judge
        picked = []
    v, change, base_ms = verdict(ms, [b["makespan"] for b in picked], chosen=chosen)
    findings: list[dict[str, Any]] = []
    if v != "no history":
        extra = ms - (base_ms or 0.0)
        c = _concurrency(run)
        findings = (
            _steps(run, picked, c)
            + _activity(run, picked, c)
            + _profile(run, picked, c)
            + _data(run, picked, c)
            + _cluster(run, picked, extra)
        )
        sign = 1 if extra >= 0 else -1
        floor = MIN_SHARE * abs(extra)
        findings = [
            f for f in findings if f["seconds"] is None or f["seconds"] * sign > max(floor, 1e-3)
        ]
        findings.sort(key=lambda f: -abs(f["seconds"] or 0.0))
        # causes with no measure of their own come after the measured ones, never dropped
        findings += _environment(run, picked) + _code(run, picked) + _failures(run, picked)
    return {
        "run": run.get("id"),
        "verdict": v,
        "baseline": {
            "runs": [b.get("id") for b in picked],
            "makespan": base_ms,
            "n": len(picked),
        },
        "makespan": ms,
        "change": None if change is None else round(change, 4),
        "findings": findings,
        "text": paragraph(v, change, ms, base_ms, findings),
    }


def paragraph(
    v: str, change: float | None, ms: float, base_ms: float | None, findings: list[dict]
) -> str:
    """The explanation in one paragraph of plain English."""
    if v == "no history" and ms <= 0:
        return "This run recorded no task with a duration: there is nothing to judge."
    if v == "no history":
        return (
            f"This run took {ms:.1f} s. Its job has too few earlier runs (fewer than "
            f"{MIN_HISTORY}) to say what is usual."
        )
    pct = abs(change or 0.0) * 100
    if v == "normal":
        head = (
            f"This run took {ms:.1f} s, within its job's usual range "
            f"(median {base_ms:.1f} s, {'+' if (change or 0) >= 0 else '-'}{pct:.0f}%)."
        )
    else:
        head = (
            f"This run took {ms:.1f} s, {pct:.0f}% {'longer' if v == 'slower' else 'shorter'}"
            f" than its usual {base_ms:.1f} s."
        )
    extra = abs(ms - (base_ms or 0.0))
    parts = []
    for f in findings[:3]:
        if f["seconds"] is not None and extra > 0:
            share = min(abs(f["seconds"]) / extra, 1.0) * 100
            parts.append(f"{f['text']} (~{share:.0f}% of the difference)")
        else:
            parts.append(f["text"])
    if v != "normal" and parts:
        return head + " Most of it: " + "; ".join(parts) + "."
    kinds = {f["kind"] for f in findings}
    unchanged = [k for k in ("environment", "cluster", "code") if k not in kinds]
    if v != "normal" and not parts:
        return head + " No step, activity or setting explains it."
    tail = f" Nothing changed in {', '.join(unchanged)}." if unchanged and v != "normal" else ""
    return head + tail
