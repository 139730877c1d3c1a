"""The task graph grouped by prefix: what the run page draws of a graph past its budget."""

from __future__ import annotations

import pyarrow as pa

from storage.analysis.outcome import graph_groups
from storage.analysis.rundata import RunData


def run_with(graph: list[tuple[str, str, list[str]]]) -> RunData:
    table = pa.table(
        {
            "key": [k for k, _, _ in graph],
            "prefix": [p for _, p, _ in graph],
            "dependencies": pa.array([d for _, _, d in graph], pa.list_(pa.string())),
        }
    )
    return RunData(pa.table({"key": pa.array([], pa.string())}), table, None, tag="t", source="raw")


def test_groups_count_tasks_once_and_edges_count_dependencies_between_prefixes():
    graph = [
        ("a-0", "a", []),
        ("a-1", "a", ["a-0"]),  # within a prefix: no edge
        ("b-0", "b", ["a-0", "a-1"]),
        ("b-0", "b", ["a-0", "a-1"]),  # sent again by a later submission: counted once
        ("c-0", "c", ["b-0", "gone"]),  # a dependency outside the graph: no edge
    ]
    got = graph_groups(run_with(graph))
    assert got["groups"] == [
        {"prefix": "a", "tasks": 2, "depth": 0},
        {"prefix": "b", "tasks": 1, "depth": 1},
        {"prefix": "c", "tasks": 1, "depth": 2},
    ]
    assert got["edges"] == [
        {"src": "a", "dst": "b", "count": 2},
        {"src": "b", "dst": "c", "count": 1},
    ]
    assert (got["other_groups"], got["other_tasks"]) == (0, 0)


def test_a_cycle_of_prefixes_still_gets_depths_and_past_the_limit_the_rest_is_counted():
    # x -> y -> x between prefixes (tasks of each depend on tasks of the other)
    graph = [("x-0", "x", []), ("y-0", "y", ["x-0"]), ("x-1", "x", ["y-0"]), ("z-0", "z", [])]
    got = graph_groups(run_with(graph), most=2)
    depth = {g["prefix"]: g["depth"] for g in got["groups"]}
    assert set(depth) == {"x", "y"}  # the two largest (x: 2 tasks; y before z by name)
    assert sorted(depth.values()) == [0, 1]
    assert {(e["src"], e["dst"]) for e in got["edges"]} == {("x", "y"), ("y", "x")}
    assert (got["other_groups"], got["other_tasks"]) == (1, 1)
