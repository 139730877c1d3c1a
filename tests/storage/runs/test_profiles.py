"""Statistical profiles: the agent's repair of Dask's trees, bounds, storage (on SQLite and
Postgres), cross-run merges and the export formats."""

from __future__ import annotations

import random
from typing import Any

import pytest

from hindsight.dask.perf import MAX_EVENT_NODES, flatten_profile, profile_event
from storage.analysis import flame
from storage.analysis.profile import Profile, add_flat, merge_into, prune


def dask_tree(stacks: list[list[str]], *, count_leaves: bool) -> dict[str, Any]:
    """A tree as ``distributed.profile.process`` builds it from one sample per stack; with
    ``count_leaves=False`` as Dask 2026.8's workers do (``process(frame, True, ...)``)."""

    def node(ident: str) -> dict[str, Any]:
        name, filename, line = ident.split(";")
        return {"count": 0, "children": {}, "identifier": ident,
                "description": {"name": name, "filename": filename, "line_number": int(line) + 1,
                                "line": f"{name}()\n"}}  # fmt: skip

    root = {"count": 0, "children": {}, "identifier": "root", "description": {}}
    for stack in stacks:
        state = root
        for i, frame in enumerate(stack):
            ident = f"{frame};/src/{frame}.py;{10 * (i + 1)}"
            child = state["children"].setdefault(ident, node(ident))
            state["count"] += 1
            state = child
        if count_leaves:
            state["count"] += 1
    return root


def as_profile(frames: list[Any], nodes: list[tuple[int, int, int]]) -> Profile:
    p = Profile()
    assert add_flat(
        p, [(f.name, f.filename, f.first_line, f.line_number, f.line) for f in frames], nodes
    )
    return p


def own_samples(p: Profile) -> dict[str, int]:
    out: dict[str, int] = {}
    for path, node in flame.walk(p):
        own = node.count - sum(c.count for c in node.children.values())
        name = p.keys[path[-1]][0]
        out[name] = out.get(name, 0) + own
    return out


STACKS = (
    [["call", "spin"]] * 70
    + [["call", "parse", "loads"]] * 20
    + [["call", "parse", "fmt", "tick"]] * 10
)


@pytest.mark.parametrize("count_leaves", [False, True])
def test_samples_land_on_the_innermost_frame_whatever_dask_counted(count_leaves):
    p = as_profile(*flatten_profile(dask_tree(STACKS, count_leaves=count_leaves)))
    assert p.samples == 100
    assert own_samples(p) == {"call": 0, "spin": 70, "parse": 0, "loads": 20, "fmt": 0, "tick": 10}
    assert flame.top(p, 1)[0]["name"] == "spin"


def test_an_ambiguous_leafless_tree_is_shared_out_and_stays_consistent():
    # Dask's leafless tree says a had a callee on the stack in 10 samples and b in 5: the
    # other 5 ended in one of a's callees that never had one (d) or in b itself. Which,
    # it cannot tell; they go to d. Totals and callers stay exact.
    stacks = [["a", "b", "c"]] * 5 + [["a", "b"]] * 3 + [["a", "d"]] * 2
    p = as_profile(*flatten_profile(dask_tree(stacks, count_leaves=False)))
    assert p.samples == 10
    for _path, node in flame.walk(p):
        assert node.count >= sum(c.count for c in node.children.values())
    assert own_samples(p) == {"a": 0, "b": 0, "c": 5, "d": 5}


def test_callees_the_tree_cannot_tell_apart_are_named_together_not_split():
    """A loop calling two pure-Python helpers, one 9x the other's
    cost (cProfile: 0.241 s against 0.026 s), came out even (577 against 574 samples) and
    nothing said the split was made up. Dask's tree holds only that x's innermost callees
    had 10 samples between them: they go to one frame that names both."""
    split = [["x", "y"]] * 9 + [["x", "z"]] * 1
    q = as_profile(*flatten_profile(dask_tree(split, count_leaves=False)))
    assert q.samples == 10
    assert own_samples(q) == {"x": 0, "one of: y, z": 10}
    top = flame.top(q, 5)
    assert (top[0]["name"], top[0]["filename"], top[0]["self"]) == ("one of: y, z", "", 10)
    # top level alike (two outermost frames, each only ever innermost)
    r = as_profile(*flatten_profile(dask_tree([["u"]] * 3 + [["v"]] * 4, count_leaves=False)))
    assert own_samples(r) == {"one of: u, v": 7}
    # a tree that counts its leaves is told apart exactly
    t = as_profile(*flatten_profile(dask_tree(split, count_leaves=True)))
    assert own_samples(t) == {"x": 0, "y": 9, "z": 1}


def test_an_event_keeps_at_most_its_bound_of_frames_and_every_sample():
    rng = random.Random(1)
    stacks = [[f"f{rng.randrange(60)}" for _ in range(rng.randint(1, 12))] for _ in range(4000)]
    tree = dask_tree(stacks, count_leaves=False)
    ev = profile_event("tcp://w:1", "p", 1.0, 2.0, tree, 0.01)
    assert len(ev.nodes) <= MAX_EVENT_NODES
    assert sum(c for parent, _f, c in ev.nodes if parent < 0) == 4000


def test_prune_folds_the_least_sampled_frames_into_their_callers():
    rng = random.Random(2)
    p = Profile()
    for _ in range(30):
        q = as_profile(*flatten_profile(dask_tree(
            [[f"g{rng.randrange(40)}" for _ in range(rng.randint(1, 8))] for _ in range(300)],
            count_leaves=True)))  # fmt: skip
        merge_into(p, q)
    before = p.samples
    assert p.size() > 500
    prune(p, 500)
    assert p.size() <= 500 and p.samples == before == 30 * 300
    for _path, node in flame.walk(p):
        assert node.count >= sum(c.count for c in node.children.values())


def test_exports_agree_with_the_tree():
    p = as_profile(*flatten_profile(dask_tree(STACKS, count_leaves=False)))
    folded = flame.collapsed(p).splitlines()
    assert sum(int(line.rsplit(" ", 1)[1]) for line in folded) == 100
    assert "call (/src/call.py:10);spin (/src/spin.py:20) 70" in folded
    doc = flame.speedscope(p, "run")
    prof = doc["profiles"][0]
    assert sum(prof["weights"]) == pytest.approx(1.0)
    names = [f["name"] for f in doc["shared"]["frames"]]
    assert sorted({names[i] for s in prof["samples"] for i in s}) == sorted(
        ["call", "spin", "parse", "loads", "fmt", "tick"]
    )
    tree = flame.tree_json(p)
    assert tree["samples"] == 100 and tree["children"][0]["name"] == "call"


def test_the_difference_of_two_profiles_in_seconds_with_shares_beside():
    a = as_profile(*flatten_profile(dask_tree([["call", "spin"]] * 10, count_leaves=True)))
    b = as_profile(*flatten_profile(dask_tree([["call", "spin"]] * 10 + [["call", "new"]] * 30,
                                              count_leaves=True)))  # fmt: skip
    d = flame.diff(a, b)
    call = d["children"][0]
    kids = {c["name"]: c for c in call["children"]}
    assert kids["new"]["a"] == 0 and kids["new"]["b"] == 30 and kids["new"]["share_delta"] == 0.75
    assert kids["spin"]["share_a"] == 1.0 and kids["spin"]["share_delta"] == -0.75
    # in seconds (samples x interval): spin did not change; its share fell only because
    # new took time beside it
    assert kids["new"]["delta"] == pytest.approx(30 * b.interval)
    assert kids["spin"]["delta"] == 0 and kids["spin"]["seconds_b"] == 10 * b.interval
    assert "call (/src/call.py:10);new (/src/new.py:20) 0 30" in flame.collapsed_diff(a, b)


def test_stored_trees_share_frames_and_merge_across_runs(index_url):
    """Store two runs' profiles through ``store`` and read them back one by one and merged;
    frames are stored once per tenant."""
    from sqlalchemy import func, select

    from storage.core import models as m
    from storage.core.db import make_engine, make_sessionmaker, upgrade
    from storage.core.tokens import ensure_tenant
    from storage.runs.profiles import Row, across_runs, decode, store
    from tests.conftest import new_tenant

    engine = make_engine(index_url)
    upgrade(engine)
    sessions = make_sessionmaker(engine)
    trees = [as_profile(*flatten_profile(dask_tree(STACKS, count_leaves=False))) for _ in range(2)]
    with sessions.begin() as db:
        tid = ensure_tenant(db, new_tenant(), 1.0)
        cluster = m.Cluster(tenant_id=tid, name="c", first_seen=1.0, last_seen=1.0)
        db.add(cluster)
        db.flush()
        session = m.Session(cluster_id=cluster.id, name="s", first_seen=1.0, last_seen=1.0)
        db.add(session)
        db.flush()
        runs = []
        for i, tree in enumerate(trees):
            run = m.Run(public_id=f"00000000-0000-0000-0000-{tid:08d}{i:04d}", tenant_id=tid,
                        cluster_id=cluster.id, session_id=session.id, run_key=f"r{i}", name="job",
                        status="finished", started_at=100.0 + i, first_seen=1.0, last_seen=1.0)  # fmt: skip
            db.add(run)
            db.flush()
            store(db, run, [Row("spin", "", tree), Row("", "", tree)], "t")
            runs.append(run)
    with sessions() as db:
        frames = db.scalar(select(func.count()).where(m.ProfileFrame.tenant_id == tid))
        assert frames == 6  # call, spin, parse, loads, fmt, tick: once for both runs
        (data,) = db.execute(
            select(m.RunProfile.data).where(m.RunProfile.run_id == runs[0].id, m.RunProfile.prefix == "spin")
        ).one()  # fmt: skip
        back = decode(db, tid, data)
        assert own_samples(back) == own_samples(trees[0])
        merged = across_runs(db, tid, prefix="spin", name="job")
        assert merged.runs == 2 and not merged.truncated
        assert merged.profile.samples == 200
        assert own_samples(merged.profile)["spin"] == 140
        newest = across_runs(db, tid, prefix="spin", limit=1)
        assert newest.runs == 1 and newest.truncated
        assert across_runs(db, tid, prefix="spin", since=101.0).runs == 1
        assert across_runs(db, tid + 10**6, prefix="spin").runs == 0  # another tenant's: none
    # A rebuild from newer inputs replaces the run's rows, including ones it no longer has.
    with sessions.begin() as db:
        store(db, runs[0], [Row("", "", trees[0])], "t2")
    with sessions() as db:
        left = db.execute(
            select(m.RunProfile.prefix, m.RunProfile.tag).where(m.RunProfile.run_id == runs[0].id)
        ).all()
        assert [tuple(r) for r in left] == [("", "t2")]
    engine.dispose()
