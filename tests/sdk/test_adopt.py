"""Spools whose agent is gone: adopted by the next agent (once, and only when their agent is
gone, across processes), or pushed by hand with ``hindsight spool push``."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any

from click.testing import CliRunner

from hindsight.agent import Agent
from hindsight.agent.adopt import META_NAME, read_meta, target_of, try_lock
from hindsight.cli import EXIT_RETRY_LATER, main
from hindsight.config import Settings
from hindsight.schema import CustomEvent
from tests.helpers import ROOT
from tests.sdk.fake_collector import FakeCollector


def settings(collector: FakeCollector, spool: Path, **changes: Any) -> Settings:
    base = Settings(url=collector.url, cluster="adopt-test", spool_dir=str(spool),
                    flush_events=10, flush_interval=0.05, close_timeout=5.0)  # fmt: skip
    return base.replace(**changes)


def make_orphan(collector: FakeCollector, spool: Path, n: int = 50, **changes: Any) -> Path:
    """An agent spools ``n`` events while the collector answers it 503, then closes within
    a short budget: its directory, final batch included, is left behind."""
    down = collector.rule
    collector.rule = lambda b: (503, {}) if b.agent.startswith("gone-") else None
    agent = Agent(settings(collector, spool, adopt_spools=False, **changes),
                  session="s-gone", name="gone")  # fmt: skip
    for i in range(n):
        agent.add(CustomEvent(stream="gone", time=float(i), value=i))
    agent.close(timeout=0.3)
    collector.rule = down
    directory = spool / agent.name
    assert len(list(directory.glob("*.hsb"))) == n // 10 + 1  # n/10 batches and the final one
    return directory


def gone_batches(collector: FakeCollector) -> list[Any]:
    return [b for b in collector.accepted if b.agent.startswith("gone-")]


def assert_delivered_once_in_order(collector: FakeCollector, n: int) -> None:
    batches = gone_batches(collector)  # the fake accepts a repeated batch again: no dedup
    assert [b.seq for b in batches] == list(range(n // 10 + 1))
    assert batches[-1].final
    assert [e.value for b in batches for e in b.events] == list(range(n))
    assert {(b.cluster, b.session) for b in batches} == {("adopt-test", "s-gone")}


def adopter(collector: FakeCollector, spool: Path, **changes: Any) -> Agent:
    agent = Agent(settings(collector, spool, **changes), session="s-next", name="next")
    agent.add(CustomEvent(stream="next", time=0.0, value=0))
    assert agent.adoption is not None
    return agent


def test_the_next_agent_delivers_an_orphan_once_in_order_and_removes_it(collector, tmp_path):
    orphan = make_orphan(collector, tmp_path)
    agent = adopter(collector, tmp_path)
    assert agent.adoption.finished.wait(30)
    agent.close()
    assert_delivered_once_in_order(collector, 50)
    assert not orphan.exists()
    (done,) = agent.adoption.deliveries
    assert (done.batches, done.events, done.complete) == (6, 50, True)


def test_a_corrupted_orphan_file_is_skipped_and_counted(collector, tmp_path):
    orphan = make_orphan(collector, tmp_path)
    files = sorted(orphan.glob("*.hsb"))
    data = bytearray(files[2].read_bytes())
    data[-3] ^= 0xFF
    files[2].write_bytes(bytes(data))
    agent = adopter(collector, tmp_path)
    assert agent.adoption.finished.wait(30)
    agent.close()
    (done,) = agent.adoption.deliveries
    assert (done.corrupt_files, done.corrupt_events, done.batches, done.events) == (1, 10, 5, 40)
    assert not done.complete
    assert [b.seq for b in gone_batches(collector)] == [0, 1, 3, 4, 5]
    assert not orphan.exists()


def test_an_older_collector_gets_an_orphan_without_the_kinds_it_does_not_know(collector, tmp_path):
    from hindsight.schema import ProfileEvent

    profile = ProfileEvent(worker="w", prefix="p", start=1.0, stop=2.0, frames=[], nodes=[])
    collector.rule = lambda b: (503, {})
    agent = Agent(settings(collector, tmp_path, adopt_spools=False), session="s-gone", name="gone")
    for i in range(20):
        agent.add(CustomEvent(stream="gone", time=float(i), value=i))
        agent.add(profile)
    agent.close(timeout=0.3)

    def older(batch: Any) -> Any:
        for i, e in enumerate(batch.events):
            if isinstance(e, ProfileEvent):
                return 400, {}, f"Invalid value 'profile' - at `$.events[{i}].kind`"
        return None

    collector.rule = older
    next_agent = adopter(collector, tmp_path)
    assert next_agent.adoption.finished.wait(30)
    next_agent.close()
    (done,) = next_agent.adoption.deliveries
    assert (done.batches, done.events, done.unsupported_events, done.complete) == (5, 20, 20, True)
    batches = gone_batches(collector)
    assert [b.seq for b in batches] == [0, 1, 2, 3, 4]
    assert [e.value for b in batches for e in b.events] == list(range(20))
    assert batches[-1].final and batches[-1].dropped == {"unsupported_kind": 20}
    assert sum(1 for status, b in collector.requests if status == 400) == 1


def test_orphans_of_another_collector_or_token_are_not_adopted(collector, tmp_path):
    orphan = make_orphan(collector, tmp_path, token="tenant-a")
    agent = adopter(collector, tmp_path, token="tenant-b")
    assert agent.adoption.finished.wait(30)
    agent.close()
    assert agent.adoption.deliveries == [] and gone_batches(collector) == []
    assert read_meta(str(orphan))["target"] == target_of(collector.url, "tenant-a")
    assert len(list(orphan.glob("*.hsb"))) == 6


def _spawn(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.sdk.spool_agent", *args],
        cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip


def _end(procs: list[subprocess.Popen[str]], readers: list[threading.Thread] = ()) -> None:
    for proc in procs:
        proc.kill()
        proc.wait(30)
    for reader in readers:
        reader.join(30)
    for proc in procs:
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                stream.close()


def _lines(
    procs: list[subprocess.Popen[str]],
) -> tuple[queue.Queue[tuple[int, str]], list[threading.Thread]]:
    """One queue of (process index, line) read from every process's stdout."""
    out: queue.Queue[tuple[int, str]] = queue.Queue()
    readers = []
    for i, proc in enumerate(procs):
        assert proc.stdout is not None
        stream = proc.stdout
        reader = threading.Thread(
            target=lambda i=i, s=stream: [out.put((i, line)) for line in s], daemon=True
        )
        reader.start()
        readers.append(reader)
    return out, readers


def test_a_live_agents_spool_is_left_alone_until_its_process_is_killed(collector, tmp_path):
    collector.rule = lambda b: (503, {}) if b.agent.startswith("held-") else None
    holder = _spawn("hold", collector.url, str(tmp_path), "50")
    try:
        assert holder.stdout is not None
        held = json.loads(holder.stdout.readline())
        directory = Path(held["directory"])
        agent = adopter(collector, tmp_path)
        assert agent.adoption.scanned.wait(30)
        assert agent.adoption.live == [str(directory)]
        assert agent.adoption.deliveries == []
        agent.close()
        assert len(list(directory.glob("*.hsb"))) == 5
        assert not [b for b in collector.accepted if b.agent.startswith("held-")]
        assert try_lock(str(directory)) is None  # still held by the other process

        holder.send_signal(signal.SIGKILL)  # no close, no atexit: only the kernel lets go
        holder.wait(30)
        collector.rule = None
        agent = adopter(collector, tmp_path)
        assert agent.adoption.finished.wait(30)
        agent.close()
        delivered = [b for b in collector.accepted if b.agent == held["agent"]]
        assert [b.seq for b in delivered] == [0, 1, 2, 3, 4]
        assert [e.value for b in delivered for e in b.events] == list(range(50))
        assert not directory.exists()
    finally:
        _end([holder])


def test_two_agents_starting_at_once_deliver_an_orphan_once(collector, tmp_path):
    orphan = make_orphan(collector, tmp_path)
    # Hold the first orphan batch in the collector until one adopter has looked and found
    # the directory claimed: both are then certainly at it at the same time.
    release = threading.Event()

    def hold_first(batch: Any) -> None:
        if batch.agent.startswith("gone-") and batch.seq == 0:
            release.wait(60)

    collector.rule = hold_first
    procs = [_spawn("adopt", collector.url, str(tmp_path)) for _ in range(2)]
    lines, readers = _lines(procs)
    try:
        first, line = lines.get(timeout=60)
        skipped = json.loads(line)
        assert skipped == {"live": [str(orphan)], "deliveries": []}
        release.set()
        second, line = lines.get(timeout=60)
        assert second != first
        (done,) = json.loads(line)["deliveries"]
        assert (done["batches"], done["events"], done["directory"]) == (6, 50, str(orphan))
        for proc in procs:
            assert proc.wait(60) == 0
    finally:
        release.set()
        _end(procs, readers)
    assert_delivered_once_in_order(collector, 50)
    assert not orphan.exists()


def test_close_does_not_wait_for_an_adoption_in_progress(collector, tmp_path):
    orphan = make_orphan(collector, tmp_path)
    stuck, release = threading.Event(), threading.Event()

    def slow(batch: Any) -> None:  # the collector hangs on the orphan's first batch
        if batch.agent.startswith("gone-"):
            stuck.set()
            release.wait(60)

    collector.rule = slow
    agent = adopter(collector, tmp_path)
    try:
        assert stuck.wait(30)
        start = time.monotonic()
        agent.close(timeout=1.0)
        assert time.monotonic() - start < 5, "close() waited for the adoption"
        assert not agent.adoption.finished.is_set()
    finally:
        release.set()
    assert agent.adoption.finished.wait(30)  # it stopped after the request in flight
    assert len(list(orphan.glob("*.hsb"))) == 5  # the rest waits for the next agent
    lock = try_lock(str(orphan))
    assert lock is not None
    lock.release()


def test_a_forked_child_does_not_keep_its_parents_spool_owned(collector, tmp_path):
    collector.rule = lambda b: (503, {})
    agent = Agent(settings(collector, tmp_path, adopt_spools=False), session="s", name="parent")
    for i in range(20):
        agent.add(CustomEvent(stream="x", time=float(i), value=i))
    directory = tmp_path / agent.name
    collector.wait_for(lambda: len(list(directory.glob("*.hsb"))) >= 2, timeout=30)
    go_r, go_w = os.pipe()
    ready_r, ready_w = os.pipe()
    with warnings.catch_warnings():
        # Forking with threads running: the child only signals and waits.
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:
        os.close(go_w)
        os.write(ready_w, b"x")  # the at-fork hooks have run by now
        os.read(go_r, 1)
        os._exit(0)
    os.close(go_r)
    os.close(ready_w)
    try:
        assert os.read(ready_r, 1) == b"x"
        assert try_lock(str(directory)) is None
        agent.close(timeout=0.1)  # the parent's agent is done: its batches are up for adoption
        lock = try_lock(str(directory))
        assert lock is not None, "the forked child kept the parent's spool directory owned"
        lock.release()
    finally:
        os.close(go_w)
        os.close(ready_r)
        os.waitpid(pid, 0)


# -- hindsight spool push ----------------------------------------------------------------------
def push(*args: str) -> Any:
    return CliRunner().invoke(main, ["spool", "push", *args], catch_exceptions=False)


def test_spool_push_delivers_every_orphan_with_progress(collector, tmp_path):
    first = make_orphan(collector, tmp_path)
    second = make_orphan(collector, tmp_path, n=30)
    result = push(str(tmp_path), "--url", collector.url)
    assert result.exit_code == 0, result.output
    assert f"2 agent directories, 10 batches (80 events) -> {collector.url}" in result.stdout
    assert f"{first.name}: 6 batches (50 events) delivered" in result.stdout
    assert f"{second.name}: 4 batches (30 events) delivered" in result.stdout
    assert "delivered 10 of 10 batches (80 events); 0 corrupted files skipped" in result.stdout
    assert not first.exists() and not second.exists()
    agents = {b.agent for b in gone_batches(collector)}
    assert agents == {first.name, second.name}
    for name in agents:
        batches = [b for b in gone_batches(collector) if b.agent == name]
        assert [b.seq for b in batches] == list(range(len(batches))) and batches[-1].final


def test_spool_push_of_one_directory_skips_and_counts_a_corrupted_file(collector, tmp_path):
    orphan = make_orphan(collector, tmp_path)
    victim = sorted(orphan.glob("*.hsb"))[1]
    victim.write_bytes(victim.read_bytes()[:12])  # truncated inside the header
    result = push(str(orphan), "--url", collector.url)
    assert result.exit_code == 1, result.output
    assert "5 batches (40 events) delivered; 1 corrupted files skipped (10 events)" in result.stdout
    assert [b.seq for b in gone_batches(collector)] == [0, 2, 3, 4, 5]


def test_spool_push_leaves_batches_on_disk_while_the_collector_is_away(collector, tmp_path):
    orphan = make_orphan(collector, tmp_path)
    collector.rule = lambda b: (503, {"Retry-After": "1"})
    result = push(str(tmp_path), "--url", collector.url, "--timeout", "0.5")
    assert result.exit_code == EXIT_RETRY_LATER, result.output
    assert "6 left on disk: collector unavailable (503)" in result.stdout
    assert len(list(orphan.glob("*.hsb"))) == 6 and (orphan / META_NAME).exists()
    collector.rule = None
    result = push(str(tmp_path), "--url", collector.url)  # running it again finishes the job
    assert result.exit_code == 0, result.output
    assert_delivered_once_in_order(collector, 50)


def test_spool_push_leaves_a_live_agents_directory_alone(collector, tmp_path):
    collector.rule = lambda b: (503, {})
    agent = Agent(settings(collector, tmp_path, adopt_spools=False), session="s", name="alive")
    for i in range(20):
        agent.add(CustomEvent(stream="x", time=float(i), value=i))
    directory = tmp_path / agent.name
    collector.wait_for(lambda: len(list(directory.glob("*.hsb"))) >= 2, timeout=30)
    collector.rule = None
    try:
        result = push(str(tmp_path), "--url", collector.url)
        assert result.exit_code == EXIT_RETRY_LATER, result.output
        assert f"{agent.name}: in use by a running agent; left alone" in result.stdout
        assert not [b for b in collector.accepted if b.agent == agent.name]
    finally:
        agent.close()
    assert [e.value for e in collector.events()] == list(range(20))  # the agent itself, later


def test_adoption_can_be_turned_off(collector, tmp_path):
    from hindsight.config import load_settings

    for value, expected in (("false", False), ("0", False), ("off", False), ("yes", True)):
        environ = {"HINDSIGHT_ADOPT_SPOOLS": value}
        assert load_settings(environ=environ, dask_config={}).adopt_spools is expected
    make_orphan(collector, tmp_path)
    agent = Agent(settings(collector, tmp_path, adopt_spools=False), session="s", name="next")
    agent.add(CustomEvent(stream="next", time=0.0, value=0))
    agent.close()
    assert agent.adoption is None and gone_batches(collector) == []
