"""Ray's worker exit types, translated at the edge, read as the run page's causes by the
generic reader, which names no Ray exit type."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from storage.ray.translate import EXIT_CAUSES, worker_events
from storage.runs.runlogs import CAUSES, cause_of


def departure(exit_type: str | None, detail: str | None = "detail") -> tuple:
    worker = SimpleNamespace(
        worker_type="WORKER",
        pid=4242,
        node_id="ab" * 14,
        worker_id="cd" * 14,
        started_at=100.0,
        ended_at=200.0,
        exit_type=exit_type,
        exit_detail=detail,
    )
    left = worker_events(worker, "10.0.0.1")[-1]
    assert left.event == "left"
    return left.reason, left.expected, left.status


@pytest.mark.parametrize("exit_type, cause", sorted(EXIT_CAUSES.items()))
@pytest.mark.parametrize("detail", ["BadInit.__init__() failed", None])
def test_each_exit_type_reads_as_its_cause(exit_type, cause, detail):
    assert cause in CAUSES
    assert cause_of(*departure(exit_type, detail)) == cause


def test_an_exit_type_ray_has_not_told_us_of_reads_unknown():
    assert cause_of(*departure("SOME_NEW_EXIT")) == "unknown"


@pytest.mark.parametrize(
    "reason, cause",
    [
        ("handle-worker-cleanup", "lost"),
        ("check-worker-ttl", "timed-out"),
        ("remove-worker", "removed"),
        ("retire-workers", "removed"),
        (None, "removed"),
    ],
)
def test_a_schedulers_stimulus_is_read_as_dask_says(reason, cause):
    assert cause_of(reason, False, "running") == cause
