"""The verdict and the ranking of ``storage.analysis.explain`` on synthetic histories: the
statistics alone, without a cluster (tests/dask/test_explain.py has the real runs)."""

from __future__ import annotations

import numpy as np

from storage.analysis import explain as ex
from storage.analysis import sketch


def _judge(series: list[float], i: int) -> str:
    base = [series[j] for j in ex.baseline(series[:i])]
    return ex.verdict(series[i], base)[0]


def test_noise_does_not_cry_wolf() -> None:
    # Usual runs with +-15% noise: at most 1 false "slower" in 50 runs, for every history.
    for seed in range(4):
        rng = np.random.default_rng(seed)
        series = list(60.0 * (1 + rng.uniform(-0.15, 0.15, 55)))
        false = sum(_judge(series, i) == "slower" for i in range(5, 55))
        assert false <= 1, (seed, false)


def test_a_real_slowdown_is_slower_and_the_run_after_it_normal() -> None:
    rng = np.random.default_rng(7)
    series = list(60.0 * (1 + rng.uniform(-0.15, 0.15, 12)))
    series += [60.0 * 1.7, 61.0]
    assert _judge(series, 12) == "slower"
    assert _judge(series, 13) == "normal"  # the slow run is not part of "usual"
    assert _judge(series[:12] + [30.0], 12) == "faster"


def test_too_little_history() -> None:
    assert ex.verdict(10.0, [9.0, 11.0])[0] == "no history"
    out = ex.explain({"id": "r", "makespan": 10.0}, [{"id": "a", "makespan": 9.0}])
    assert out["verdict"] == "no history" and "too few" in out["text"]
    # a run without a makespan (no task recorded) is not judged "faster"
    empty = ex.explain({"id": "e", "makespan": None}, [{"id": "a", "makespan": 9.0}] * 5)
    assert empty["verdict"] == "no history" and empty["findings"] == []
    assert "nothing to judge" in empty["text"]


def test_a_lasting_change_becomes_the_new_usual() -> None:
    # After a step change, the runs since it are the baseline: the 10th run at the new
    # level reads normal, not slower.
    rng = np.random.default_rng(3)
    old = list(10.0 * (1 + rng.uniform(-0.05, 0.05, 15)))
    new = list(20.0 * (1 + rng.uniform(-0.05, 0.05, 10)))
    assert ex.change_points(old + new) == [15]
    assert _judge(old + new + [20.5], 25) == "normal"
    assert ex.change_points(old) == []


def test_mann_whitney_sees_shifted_durations_only() -> None:
    rng = np.random.default_rng(1)
    same_a = rng.normal(1.0, 0.1, 300)
    same_b = rng.normal(1.0, 0.1, 300)
    slow = rng.normal(1.3, 0.1, 300)

    def counts(xs: np.ndarray) -> dict[float, int]:
        out: dict[float, int] = {}
        for x in xs:
            out[round(float(x), 3)] = out.get(round(float(x), 3), 0) + 1
        return out

    assert ex.mann_whitney(counts(same_a), counts(same_b)) > 0.01
    assert ex.mann_whitney(counts(same_a), counts(slow)) < 1e-6


def _run(
    rid: str,
    ms: float,
    *,
    sleep: float,
    cpu: float,
    new_frame: bool = False,
    threads: int = 4,
    versions: dict[str, str] | None = None,
) -> dict:
    per_task = sleep + cpu
    hist = {sketch.bucket(per_task * f): 25 for f in (0.95, 1.0, 1.05, 1.1)}
    frames = {("run", "job.py", 1): 100 * per_task, ("sleepy", "job.py", 5): 100 * sleep}
    if new_frame:
        frames[("crunch", "job.py", 9)] = 100 * cpu
    return {
        "id": rid,
        "makespan": ms,
        "prefixes": {"step": {"tasks": 100, "compute": 100 * per_task, "nbytes": 8, "hist": hist}},
        "activity": {"thread-cpu": 100 * cpu + 1, "thread-noncpu": 100 * sleep},
        "frames": {"step": frames},
        "versions": versions or {"dask": "1", "python": "3.11"},
        "cluster": {"workers": threads, "threads": threads, "memory_limit": 4 << 30},
    }


def test_findings_name_the_cause_and_rank_by_seconds() -> None:
    history = [_run(f"u{i}", 25.0 + i % 2, sleep=1.0, cpu=0.0) for i in range(6)]
    slow = _run("s", 50.0, sleep=1.0, cpu=1.0, new_frame=True)
    out = ex.explain(slow, history)
    assert out["verdict"] == "slower" and out["baseline"]["n"] == 6
    kinds = [f["kind"] for f in out["findings"]]
    assert {"step", "activity", "profile"} <= set(kinds)
    seconds = [f["seconds"] for f in out["findings"] if f["seconds"] is not None]
    assert seconds == sorted(seconds, reverse=True)
    act = next(f for f in out["findings"] if f["kind"] == "activity")
    assert act["activity"] == "thread-cpu"
    prof = next(f for f in out["findings"] if f["kind"] == "profile")
    assert prof["frames"][0]["function"] == "crunch" and prof["frames"][0]["before_share"] == 0
    assert "thread-noncpu" not in {f["activity"] for f in out["findings"]}

    waits = ex.explain(_run("w", 50.0, sleep=2.0, cpu=0.0), history)
    act = next(f for f in waits["findings"] if f["kind"] == "activity")
    assert waits["verdict"] == "slower" and act["activity"] == "thread-noncpu"


def test_cluster_and_environment_findings() -> None:
    history = [_run(f"u{i}", 25.0 + i % 2, sleep=1.0, cpu=0.0) for i in range(6)]
    fewer = ex.explain(_run("f", 50.0, sleep=1.0, cpu=0.0, threads=2), history)
    top = fewer["findings"][0]
    assert (top["kind"], top["what"], top["before"], top["after"]) == ("cluster", "threads", 4, 2)
    assert top["seconds"] == 24.5

    upgraded = _run("v", 25.0, sleep=1.0, cpu=0.0, versions={"dask": "2", "python": "3.11"})
    out = ex.explain(upgraded, history)
    assert out["verdict"] == "normal"
    env = [f for f in out["findings"] if f["kind"] == "environment"]
    assert [(f["what"], f["before"], f["after"]) for f in env] == [("dask", "1", "2")]
