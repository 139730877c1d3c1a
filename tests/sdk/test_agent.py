"""The agent core against a real HTTP server: batching, retries, splitting, spool, close."""

from __future__ import annotations

import os
import time

import pytest

from hindsight.agent import Agent
from hindsight.config import Settings
from hindsight.schema import CustomEvent

from .fake_collector import DROP


def make_agent(collector, tmp_path, **overrides) -> Agent:
    settings = Settings(
        url=overrides.pop("url", collector.url),
        cluster="test",
        spool_dir=str(tmp_path / "spool"),
        flush_interval=overrides.pop("flush_interval", 0.05),
        close_timeout=overrides.pop("close_timeout", 5.0),
        **overrides,
    )
    return Agent(settings, session="s1", name="unit")


def ev(i: int) -> CustomEvent:
    return CustomEvent(stream="n", time=1.0, value=i)


def values(collector) -> list[int]:
    return [e.value for e in collector.events()]


def test_delivers_every_event_once_in_order_and_ends_with_final(collector, tmp_path):
    agent = make_agent(collector, tmp_path)
    for i in range(100):
        agent.add(ev(i))
    agent.close()
    assert values(collector) == list(range(100))
    seqs = [b.seq for b in collector.accepted]
    assert seqs == list(range(len(seqs)))
    assert collector.accepted[-1].final
    assert not any(b.final for b in collector.accepted[:-1])
    assert {(b.cluster, b.session, b.agent) for b in collector.accepted} == {
        ("test", "s1", agent.name)
    }


def test_cuts_a_batch_when_flush_size_is_reached(collector, tmp_path):
    agent = make_agent(collector, tmp_path, flush_events=10, flush_interval=3600)
    for i in range(25):
        agent.add(ev(i))
    collector.wait_for(lambda: len(collector.accepted) >= 2)
    assert [len(b.events) for b in collector.accepted[:2]] == [10, 10]
    agent.close()
    assert values(collector) == list(range(25))


def test_cuts_a_batch_when_flush_interval_passes(collector, tmp_path):
    agent = make_agent(collector, tmp_path, flush_events=1000, flush_interval=0.1)
    agent.add(ev(1))
    collector.wait_for(lambda: values(collector) == [1])
    agent.close()


def test_add_never_blocks_and_counts_what_the_full_buffer_drops(collector, tmp_path):
    agent = make_agent(collector, tmp_path, buffer_events=50, flush_events=50)
    start = time.perf_counter()
    for i in range(20_000):
        agent.add(ev(i))
    assert time.perf_counter() - start < 2.0
    agent.close()
    dropped = collector.accepted[-1].dropped.get("buffer_full", 0)
    assert dropped > 0
    assert len(collector.events()) + dropped == 20_000


def test_an_event_that_cannot_be_built_is_counted_not_raised(collector, tmp_path):
    agent = make_agent(collector, tmp_path)

    def broken() -> CustomEvent:
        raise RuntimeError("bad producer")

    agent.add((broken,))
    agent.add(ev(7))
    agent.close()
    assert values(collector) == [7]
    assert collector.accepted[-1].dropped == {"invalid": 1}


def test_a_lone_surrogate_in_a_value_is_sent_as_u_fffd_with_the_rest(collector, tmp_path):
    """A file name Python decoded with surrogateescape
    ('caf\udce9.csv'), logged or emitted, is no UTF-8: the whole batch was lost, its
    sequence number with it, and nothing counted."""
    agent = make_agent(collector, tmp_path)
    agent.add(ev(6))
    agent.add(CustomEvent(stream="bad-\udce9", time=1.0, value={"file": "caf\udce9.csv"}))
    agent.add(ev(7))
    agent.close()
    assert values(collector) == [6, {"file": "caf\ufffd.csv"}, 7]
    assert [e.stream for e in collector.events()][1] == "bad-\ufffd"
    assert [b.seq for b in collector.accepted] == list(range(len(collector.accepted)))


@pytest.mark.parametrize(
    "status,headers",
    [(503, {"Retry-After": "0.2"}), (429, {"Retry-After": "0"}), (502, {}), (408, {})],
)
def test_retryable_answers_are_retried_until_accepted(collector, tmp_path, status, headers):
    collector.script.extend([(status, headers), (status, headers)])
    agent = make_agent(collector, tmp_path)
    agent.add(ev(1))
    collector.wait_for(lambda: values(collector) == [1])
    agent.close()
    assert [s for s, _ in collector.requests[:3]] == [status, status, 202]
    assert values(collector) == [1]


@pytest.mark.parametrize("status", [404, 405])
def test_an_answer_that_the_url_is_no_collector_keeps_the_batch(
    collector, tmp_path, status, caplog
):
    """Pointed at a query service, a proxy's page or a wrong path, the
    agent dropped every batch (404: the whole run lost, nothing spooled to push later). It
    is the URL that is wrong, not the batch: it is kept and retried, and the log says so."""
    collector.script.extend([(status, {}), (status, {})])
    agent = make_agent(collector, tmp_path)
    agent.add(ev(1))
    collector.wait_for(lambda: values(collector) == [1])
    agent.close()
    assert [s for s, _ in collector.requests[:3]] == [status, status, 202]
    assert collector.accepted[-1].dropped == {}
    assert f"no collector at {collector.url}" in caplog.text


@pytest.mark.parametrize("suffix", ["/v1/batches", "/v1/batches/"])
def test_the_endpoints_url_works_as_the_collectors(collector, tmp_path, suffix):
    """The server's banner prints the endpoint; a user who copies it loses nothing."""
    agent = make_agent(collector, tmp_path, url=collector.url + suffix)
    agent.add(ev(1))
    agent.close()
    assert values(collector) == [1]
    assert [s for s, _ in collector.requests] == [202, 202]


def test_closing_tries_at_once_whatever_backoff_an_outage_left(collector, tmp_path):
    """After a collector outage, an agent closing within its
    backoff (up to 30 s, or a long Retry-After) did not try at all (the backoff outlived
    the close budget; a nanny kills its worker 4 s into closing), and its batches waited
    in the spool for some later agent. The collector is back: closing delivers."""
    agent = make_agent(collector, tmp_path)
    collector.script.append((503, {"Retry-After": "60"}))
    agent.add(ev(1))
    collector.wait_for(lambda: len(collector.requests) == 1)
    started = time.monotonic()
    agent.close(timeout=3)
    assert values(collector) == [1] and collector.accepted[-1].final
    assert time.monotonic() - started < 3


def test_closing_tries_again_when_a_collector_replica_dies_mid_request(collector, tmp_path):
    """A collector process killed mid-request (a replica restarting behind one address) drops
    the connection without an answer; closing tries again at once instead of leaving the
    run's last batch in the spool."""
    agent = make_agent(collector, tmp_path, flush_interval=3600)
    agent.add(ev(1))
    # Five answers dropped: more than closing's two sends of the batch would survive, each
    # with the sender's one reconnect.
    collector.script.extend([(DROP, {})] * 5)
    started = time.monotonic()
    agent.close(timeout=3)
    assert time.monotonic() - started < 1.5
    assert values(collector) == [1] and collector.accepted[-1].final
    statuses = [s for s, _ in collector.requests]
    assert statuses[:5] == [DROP] * 5 and set(statuses[5:]) == {202}
    assert agent.pending() == 0


def test_retry_after_is_honoured(collector, tmp_path):
    collector.script.append((503, {"Retry-After": "1"}))
    agent = make_agent(collector, tmp_path)
    agent.add(ev(1))
    collector.wait_for(lambda: len(collector.requests) == 1)
    first = time.monotonic()
    collector.wait_for(lambda: values(collector) == [1])
    assert time.monotonic() - first >= 0.9
    agent.close()


@pytest.mark.parametrize("status", [400, 401, 403, 500])
def test_non_retryable_answers_drop_the_batch_and_count_it(collector, tmp_path, status):
    agent = make_agent(collector, tmp_path, flush_interval=3600, flush_events=3)
    collector.script.append((status, {}))
    for i in range(6):
        agent.add(ev(i))
    agent.close()
    # The rejected batch was sent once, never again; later batches go through and
    # carry the count.
    assert [s for s, _ in collector.requests].count(status) == 1
    assert values(collector) == [3, 4, 5]
    assert collector.accepted[-1].dropped == {f"http_{status}": 3}


def test_too_large_batches_are_split_into_halves(collector, tmp_path):
    collector.rule = lambda b: (413, {}) if len(b.events) > 3 else None
    agent = make_agent(collector, tmp_path, flush_interval=3600, flush_events=10)
    for i in range(10):
        agent.add(ev(i))
    agent.close()
    assert sorted(values(collector)) == list(range(10))
    seqs = sorted(b.seq for b in collector.accepted)
    assert seqs == list(range(len(seqs)))
    assert sum(b.final for b in collector.accepted) == 1
    assert max(collector.accepted, key=lambda b: b.seq).final


def test_collector_down_then_back_everything_arrives_once_in_order(collector, tmp_path):
    agent = make_agent(collector, tmp_path, flush_events=10)
    agent.add(ev(0))
    collector.wait_for(lambda: values(collector) == [0])
    collector.stop()
    for i in range(1, 200):
        agent.add(ev(i))
    spool_dir = tmp_path / "spool" / agent.name
    collector.wait_for(lambda: spool_dir.exists() and len(os.listdir(spool_dir)) >= 5)
    collector.start()
    collector.wait_for(lambda: len(values(collector)) == 200, timeout=30)
    agent.close()
    assert values(collector) == list(range(200))
    ids = [b.batch_id for b in collector.accepted]
    assert len(ids) == len(set(ids))
    assert [b.seq for b in collector.accepted] == sorted(b.seq for b in collector.accepted)
    assert not spool_dir.exists()


def test_full_spool_drops_the_oldest_batches_and_counts_them(collector, tmp_path):
    agent = make_agent(collector, tmp_path, flush_events=20, spool_max_bytes=4000)
    collector.stop()
    for i in range(2000):
        agent.add(CustomEvent(stream="n", time=1.0, value=f"{i}-{os.urandom(8).hex()}"))
    collector.wait_for(lambda: agent.pending() < 2000)
    collector.start()
    agent.close()
    received = [int(e.value.split("-")[0]) for e in collector.events()]
    dropped = collector.accepted[-1].dropped.get("spool_full", 0)
    assert dropped > 0
    assert len(received) + dropped == 2000
    assert received == sorted(received)
    assert received[-1] == 1999  # the newest survive


def test_close_returns_within_its_budget_when_collector_is_down(collector, tmp_path):
    collector.stop()
    agent = make_agent(collector, tmp_path, close_timeout=1.0)
    for i in range(10):
        agent.add(ev(i))
    start = time.monotonic()
    agent.close()
    assert time.monotonic() - start < 3.0
    # What could not be sent waits on disk.
    assert os.listdir(tmp_path / "spool" / agent.name)


def test_flush_waits_for_acknowledgement(collector, tmp_path):
    agent = make_agent(collector, tmp_path, flush_interval=3600)
    agent.add(ev(1))
    assert agent.flush(timeout=5)
    assert values(collector) == [1]
    agent.close()


def test_drop_counts_travel_even_when_no_events_follow(collector, tmp_path):
    agent = make_agent(collector, tmp_path)
    agent.add(ev(1))
    agent.drop("custom_reason", 4)
    collector.wait_for(lambda: any(b.dropped.get("custom_reason") == 4 for b in collector.accepted))
    agent.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_forked_child_becomes_a_new_agent(collector, tmp_path):
    agent = make_agent(collector, tmp_path)
    agent.add(ev(1))
    assert agent.flush(timeout=5)
    pid = os.fork()
    if pid == 0:  # child: must not reuse the parent's identity or thread
        code = 1
        try:
            agent.add(ev(2))
            agent.close(timeout=5)
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    agent.add(ev(3))
    agent.close()
    by_agent: dict[str, list[int]] = {}
    for b in sorted(collector.accepted, key=lambda b: b.seq):
        by_agent.setdefault(b.agent, []).extend(e.value for e in b.events)
    assert by_agent[agent.name] == [1, 3]
    (child,) = set(by_agent) - {agent.name}
    assert by_agent[child] == [2]
    assert min(b.seq for b in collector.accepted if b.agent == child) == 0


def test_a_collector_older_than_an_event_kind_gets_the_batch_without_it(collector, tmp_path):
    """An older collector refuses a kind added later (400 naming ``$.events[i].kind``): the
    batch goes again, same seq, without those events, and they are not sent any more."""
    from hindsight.schema import ProfileEvent

    def older(batch):
        for i, e in enumerate(batch.events):
            if isinstance(e, ProfileEvent):
                return 400, {}, f"Invalid value 'profile' - at `$.events[{i}].kind`"
        return None

    collector.rule = older
    profile = ProfileEvent(worker="w", prefix="p", start=1.0, stop=2.0, frames=[], nodes=[])
    agent = make_agent(collector, tmp_path)
    for i in range(5):
        agent.add(ev(i))
        agent.add(profile)
    agent.flush()
    for i in range(5, 10):
        agent.add(ev(i))
        agent.add(profile)
    agent.close()
    assert values(collector) == list(range(10))
    assert [b.seq for b in collector.accepted] == list(range(len(collector.accepted)))
    assert sum(1 for status, _ in collector.requests if status == 400) == 1
    assert collector.accepted[-1].dropped == {"unsupported_kind": 10}
