"""A run whose agents fell silent before its end (the collector died mid-run, or the network
went; the agents' later batches wait in a spool the next cluster may never see) is never
shown complete: the API says since when nothing came, and the page says incomplete, not
"100% of batches"."""

from __future__ import annotations

import dataclasses

from tests.helpers import auth, post
from tests.query.test_runs import run_batch


def test_a_run_left_open_by_silent_agents_reads_incomplete(clients, make_token, monkeypatch):
    collector, query = clients
    token = make_token()
    h = auth(token)
    # Its scheduler's first batches arrived, the run's end never did.
    open_run = run_batch("c", "s-open", "r-open", 0, status=None)
    ended = run_batch("c", "s-ended", "r-ended", 0)
    for body in (open_run, ended):
        assert post(collector, body, token=token).status_code == 202
    runs = {r["run_key"]: r for r in query.get("/v1/runs", headers=h).json["runs"]}
    open_id, ended_id = runs["r-open"]["id"], runs["r-ended"]["id"]

    def completeness(run_id: str) -> dict:
        return query.get(f"/v1/runs/{run_id}", headers=h).json["completeness"]

    # Heard from just now: an open run is still running, nothing to say yet.
    assert completeness(open_id)["silent_since"] is None
    assert "agents-silent" not in query.get(f"/runs/{open_id}", headers=h).data.decode()

    # Nothing heard for longer than a run's agents stay quiet while it is open.
    store = query.application.extensions["hindsight"]
    monkeypatch.setattr(
        store, "settings", dataclasses.replace(store.settings, silent_agents_seconds=1e-6)
    )
    got = completeness(open_id)
    assert got["silent_since"] is not None and got["ratio"] == 1.0  # every batch sent arrived
    page = query.get(f"/runs/{open_id}", headers=h).data.decode()
    assert 'id="agents-silent"' in page and "incomplete: agents silent since" in page
    assert "100.0% of batches" not in page and "hindsight spool push" in page
    # A run its scheduler ended is whole, however long ago its agents were heard from.
    assert completeness(ended_id)["silent_since"] is None
    assert "100.0% of batches" in query.get(f"/runs/{ended_id}", headers=h).data.decode()
