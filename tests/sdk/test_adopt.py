"""Spools whose agent is gone: adopted by the next agent (once, and only when their agent is
gone, across processes), or pushed by hand with ``hindsight spool push``.

What the issue's "done when" names (a corrupted orphan file skipped and counted, a live
agent's directory left alone, two agents starting at once delivering one directory once) is
checked against the real embedded server, read through its API (the end of this file).  The
tests before that script the collector's answers (tests/sdk/fake_collector.py) for what a
real server cannot be made to do on cue: answer as an older version, hang on one batch."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from prometheus_client.parser import text_string_to_metric_families

from hindsight.agent import Agent
from hindsight.agent.adopt import META_NAME, read_meta, target_of, try_lock
from hindsight.cli import EXIT_RETRY_LATER, main
from hindsight.config import Settings
from hindsight.schema import CustomEvent
from tests.dask.conftest import Api, free_port
from tests.helpers import ROOT
from tests.sdk.fake_collector import FakeCollector
from tests.sdk.spool_agent import run_events, task_key


def settings(url: str, spool: Path, **changes: Any) -> Settings:
    base = Settings(url=url, cluster="adopt-test", spool_dir=str(spool),
                    flush_events=10, flush_interval=0.05, close_timeout=5.0)  # fmt: skip
    return base.replace(**changes)


def make_orphan(collector: FakeCollector, spool: Path, n: int = 50, **changes: Any) -> Path:
    """An agent spools ``n`` events while the collector answers it 503, then closes within
    a short budget: its directory, final batch included, is left behind."""
    down = collector.rule
    collector.rule = lambda b: (503, {}) if b.agent.startswith("gone-") else None
    agent = Agent(settings(collector.url, spool, adopt_spools=False, **changes),
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


def adopter(url: str, spool: Path, **changes: Any) -> Agent:
    agent = Agent(settings(url, spool, **changes), session="s-next", name="next")
    agent.add(CustomEvent(stream="next", time=0.0, value=0))
    assert agent.adoption is not None
    return agent


def test_the_next_agent_delivers_an_orphan_once_in_order_and_removes_it(collector, tmp_path):
    orphan = make_orphan(collector, tmp_path)
    agent = adopter(collector.url, tmp_path)
    assert agent.adoption.finished.wait(30)
    agent.close()
    assert_delivered_once_in_order(collector, 50)
    assert not orphan.exists()
    (done,) = agent.adoption.deliveries
    assert (done.batches, done.events, done.complete) == (6, 50, True)


def test_an_older_collector_gets_an_orphan_without_the_kinds_it_does_not_know(collector, tmp_path):
    from hindsight.schema import ProfileEvent

    profile = ProfileEvent(worker="w", prefix="p", start=1.0, stop=2.0, frames=[], nodes=[])
    collector.rule = lambda b: (503, {})
    agent = Agent(
        settings(collector.url, tmp_path, adopt_spools=False), session="s-gone", name="gone"
    )
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
    next_agent = adopter(collector.url, tmp_path)
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
    agent = adopter(collector.url, tmp_path, token="tenant-b")
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


def test_close_does_not_wait_for_an_adoption_in_progress(collector, tmp_path):
    orphan = make_orphan(collector, tmp_path)
    stuck, release = threading.Event(), threading.Event()

    def slow(batch: Any) -> None:  # the collector hangs on the orphan's first batch
        if batch.agent.startswith("gone-"):
            stuck.set()
            release.wait(60)

    collector.rule = slow
    agent = adopter(collector.url, tmp_path)
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
    agent = Agent(settings(collector.url, tmp_path, adopt_spools=False), session="s", name="parent")
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


def test_spool_push_says_what_is_wrong_with_a_url_without_a_scheme(collector, tmp_path):
    """A URL without a scheme is named as the problem (not logged as "ignoring invalid
    argument url" before asking for the --url that was given)."""
    orphan = make_orphan(collector, tmp_path)
    result = CliRunner().invoke(main, ["spool", "push", str(tmp_path), "--url",
                                       collector.url.removeprefix("http://")])  # fmt: skip
    assert result.exit_code == 2 and "--url must start with http:// or https://" in result.output
    assert len(list(orphan.glob("*.hsb"))) == 6  # nothing sent, nothing removed


def test_spool_push_without_a_spool_is_not_a_loss(collector, tmp_path, monkeypatch):
    """With no spool directory it exited 1, which its help defines as
    "some batches were corrupted or refused and are lost"."""
    import tempfile

    monkeypatch.delenv("HINDSIGHT_SPOOL_DIR", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the default spool's place
    assert not os.path.exists(tmp_path / "hindsight-spool")
    result = push("--url", collector.url)
    assert result.exit_code == 0 and "no spool here, nothing to push" in result.output
    # a place named and missing is a mistake (a volume not mounted)
    monkeypatch.setenv("HINDSIGHT_SPOOL_DIR", str(tmp_path / "not-mounted"))
    assert push("--url", collector.url).exit_code == 2
    result = CliRunner().invoke(
        main, ["spool", "push", str(tmp_path / "nope"), "--url", collector.url]
    )
    assert result.exit_code == 2 and "is not a directory" in result.output


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


def test_adoption_can_be_turned_off(collector, tmp_path):
    from hindsight.config import load_settings

    for value, expected in (("false", False), ("0", False), ("off", False), ("yes", True)):
        environ = {"HINDSIGHT_ADOPT_SPOOLS": value}
        assert load_settings(environ=environ, dask_config={}).adopt_spools is expected
    make_orphan(collector, tmp_path)
    agent = Agent(settings(collector.url, tmp_path, adopt_spools=False), session="s", name="next")
    agent.add(CustomEvent(stream="next", time=0.0, value=0))
    agent.close()
    assert agent.adoption is None and gone_batches(collector) == []


# -- against the real server -------------------------------------------------------------------
# Where it matters that batches really arrive (a gap left by a corrupted file, a live agent's
# directory untouched, one directory delivered once), the collector is the embedded Hindsight
# server (collector and query API, SQLite and a local blob directory) on a loopback port
# chosen up front: until the test starts it, that port refuses connections, as a collector
# that is down does.  What arrived is read through the server's read API and /metrics.
ORPHAN_EVENTS = 50  # a run's start, 48 tasks, its end: 5 batches of 10 and the final one


class LateServer(Api):
    """The embedded server at a fixed URL, started only when :meth:`start` is called."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.port = free_port()
        self.cluster = f"adopt-{uuid.uuid4().hex[:8]}"
        super().__init__(f"http://127.0.0.1:{self.port}")
        self._server: Any = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        from werkzeug.serving import make_server

        from services.embedded import create_app

        app = create_app({
            "data_dir": str(self.data_dir), "database_url": f"sqlite:///{self.data_dir / 'index.db'}",
            "blob_url": (self.data_dir / "blobs").as_uri(), "auth": "disabled",
            "finish_worker": False, "access_log": False,
        })  # fmt: skip
        self._server = make_server("127.0.0.1", self.port, app, threaded=True)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            assert self._thread is not None
            self._thread.join(10)
        self.http.close()

    def duplicates(self) -> float:
        """Batches this process's collectors acknowledged as already stored (/metrics)."""
        text = self.http.get(f"{self.url}/metrics", timeout=30).text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "hindsight_ingested_batches_total" and sample.labels == {
                    "duplicate": "true"
                }:
                    return sample.value
        return 0.0

    def run(self, name: str) -> dict[str, Any] | None:
        """The run's detail (completeness included), or ``None`` if nothing of it arrived."""
        run = self.run_named(self.cluster, name)
        return None if run is None else self.get(f"/v1/runs/{run['id']}")

    def task_keys(self, name: str) -> set[str]:
        run = self.run_named(self.cluster, name)
        assert run is not None
        return {t["key"] for t in self.tasks(run["id"])}


@pytest.fixture
def server(tmp_path: Path) -> Iterator[LateServer]:
    (tmp_path / "server").mkdir()
    late = LateServer(tmp_path / "server")
    yield late
    late.stop()


def agent_completeness(detail: dict[str, Any], agent: str) -> dict[str, Any]:
    (found,) = [a for a in detail["completeness"]["agents"] if a["agent"] == agent]
    return found


def make_run_orphan(server: LateServer, spool: Path, name: str = "gone") -> Path:
    """While the collector is down, an agent records run ``name`` (ORPHAN_EVENTS events)
    and closes within a short budget: its directory, final batch included, is left behind."""
    agent = Agent(settings(server.url, spool, cluster=server.cluster, adopt_spools=False),
                  session=f"s-{name}", name=name)  # fmt: skip
    for event in run_events(name, ORPHAN_EVENTS):
        agent.add(event)
    agent.close(timeout=0.3)
    directory = spool / agent.name
    assert len(list(directory.glob("*.hsb"))) == ORPHAN_EVENTS // 10 + 1
    return directory


def assert_arrived_without_batch(server: LateServer, orphan: Path, seq: int) -> None:
    """Run "gone" arrived, finished, less the tasks of batch ``seq``, which completeness
    counts as the one batch missing from the agent's sequence."""
    detail = server.run("gone")
    assert detail is not None and detail["status"] == "finished"
    lost = {task_key(i) for i in range(seq * 10 - 1, seq * 10 + 9)}  # event 0 starts the run
    assert server.task_keys("gone") == {task_key(i) for i in range(ORPHAN_EVENTS - 2)} - lost
    gone = agent_completeness(detail, orphan.name)
    assert (gone["batches_received"], gone["batches_expected"], gone["missing"]) == (5, 6, 1)
    assert gone["final"] and detail["completeness"]["ratio"] == 5 / 6
    # the batches sent after the unreadable file carry its events as dropped
    assert gone["events_dropped"] == {"spool_corrupt": 10}


def test_a_corrupted_orphan_file_is_skipped_and_counted(server, tmp_path):
    orphan = make_run_orphan(server, tmp_path)
    files = sorted(orphan.glob("*.hsb"))
    data = bytearray(files[2].read_bytes())
    data[-3] ^= 0xFF
    files[2].write_bytes(bytes(data))
    server.start()
    agent = adopter(server.url, tmp_path, cluster=server.cluster)
    assert agent.adoption.finished.wait(30)
    agent.close()
    (done,) = agent.adoption.deliveries
    assert (done.corrupt_files, done.corrupt_events, done.batches, done.events) == (1, 10, 5, 40)
    assert not done.complete
    assert not orphan.exists()
    assert_arrived_without_batch(server, orphan, 2)


def test_spool_push_of_one_directory_skips_and_counts_a_corrupted_file(server, tmp_path):
    orphan = make_run_orphan(server, tmp_path)
    victim = sorted(orphan.glob("*.hsb"))[1]
    victim.write_bytes(victim.read_bytes()[:12])  # truncated inside the header
    server.start()
    result = push(str(orphan), "--url", server.url)
    assert result.exit_code == 1, result.output
    assert "5 batches (40 events) delivered; 1 corrupted files skipped (10 events)" in result.stdout
    assert not orphan.exists()
    assert_arrived_without_batch(server, orphan, 1)


def hold_a_spool(server: LateServer, spool: Path) -> tuple[subprocess.Popen[str], Path]:
    """Another process's agent records run "held" while the collector is down, then is
    stopped (SIGSTOP) holding its spool directory: alive, and sending nothing itself."""
    holder = _spawn("hold", server.url, str(spool), server.cluster, str(ORPHAN_EVENTS))
    assert holder.stdout is not None
    held = json.loads(holder.stdout.readline())
    holder.send_signal(signal.SIGSTOP)
    return holder, Path(held["directory"])


def test_a_live_agents_spool_is_left_alone_until_its_process_is_killed(server, tmp_path):
    holder, directory = hold_a_spool(server, tmp_path)
    try:
        server.start()
        agent = adopter(server.url, tmp_path, cluster=server.cluster)
        assert agent.adoption.scanned.wait(30)
        assert agent.adoption.live == [str(directory)]
        agent.close()
        assert agent.adoption.finished.wait(30)
        assert agent.adoption.deliveries == []
        assert len(list(directory.glob("*.hsb"))) == 5
        assert server.run("held") is None  # nothing of it reached the collector
        assert try_lock(str(directory)) is None  # still held by the other process

        holder.send_signal(signal.SIGKILL)  # no close, no atexit: only the kernel lets go
        holder.wait(30)
        agent = adopter(server.url, tmp_path, cluster=server.cluster)
        assert agent.adoption.finished.wait(30)
        agent.close()
        assert not directory.exists()
        detail = server.run("held")
        assert detail is not None and detail["status"] == "finished"
        assert server.task_keys("held") == {task_key(i) for i in range(ORPHAN_EVENTS - 2)}
        held = agent_completeness(detail, directory.name)
        assert (held["batches_received"], held["missing"], held["final"]) == (5, 0, False)
    finally:
        _end([holder])


def test_spool_push_leaves_a_live_agents_directory_alone(server, tmp_path):
    holder, directory = hold_a_spool(server, tmp_path)
    try:
        server.start()
        result = push(str(tmp_path), "--url", server.url)
        assert result.exit_code == EXIT_RETRY_LATER, result.output
        assert f"{directory.name}: in use by a running agent; left alone" in result.stdout
        assert len(list(directory.glob("*.hsb"))) == 5
        assert server.run("held") is None
    finally:
        _end([holder])


def test_two_agents_starting_at_once_deliver_an_orphan_once(server, tmp_path):
    orphan = make_run_orphan(server, tmp_path)
    # Both start while the collector is still down: the one that claims the orphan keeps
    # retrying its first batch, holding the claim, while the other looks and finds it
    # claimed.  Only then does the collector come up.
    procs = [_spawn("adopt", server.url, str(tmp_path), server.cluster) for _ in range(2)]
    lines, readers = _lines(procs)
    try:
        first, line = lines.get(timeout=60)
        skipped = json.loads(line)
        # (the adopters' own spools, written while the collector is down, may be live too)
        assert str(orphan) in skipped["live"] and skipped["deliveries"] == []
        server.start()
        # The counter is the process's: the baseline is what other tests' servers counted.
        duplicates = server.duplicates()
        second, line = lines.get(timeout=60)
        assert second != first
        (done,) = json.loads(line)["deliveries"]
        assert (done["batches"], done["events"], done["directory"]) == (6, 50, str(orphan))
        for proc in procs:
            assert proc.wait(60) == 0
    finally:
        _end(procs, readers)
    assert not orphan.exists()
    detail = server.run("gone")
    assert detail is not None and detail["status"] == "finished"
    assert server.task_keys("gone") == {task_key(i) for i in range(ORPHAN_EVENTS - 2)}
    gone = agent_completeness(detail, orphan.name)
    assert (gone["batches_received"], gone["missing"], gone["final"]) == (6, 0, True)
    assert server.duplicates() == duplicates  # no batch of it was sent twice
