"""``hindsight.dask.install(client)`` returns the agent's state, drawn in notebooks: on a
real LocalCluster recording into a real embedded server."""

from __future__ import annotations

import uuid

from tests.dask.conftest import EmbeddedServer, wait_for_run, wait_until


def inc(x: int) -> int:
    return x + 1


def test_install_shows_the_agents_state(hindsight_server: EmbeddedServer) -> None:
    from distributed import Client, LocalCluster, span

    from hindsight.dask import install

    cluster = f"view-{uuid.uuid4().hex[:8]}"
    with (
        LocalCluster(
            n_workers=1, threads_per_worker=1, processes=True, dashboard_address=":0"
        ) as lc,
        Client(lc) as client,
    ):
        shown = install(client, url=hindsight_server.url, cluster=cluster)
        with span("viewed"):
            client.gather(client.map(inc, range(20)))
        wait_for_run(hindsight_server, cluster, "viewed", 20, status="finished")
        state = wait_until(
            lambda: (s := shown.state()) and s["batches_sent"] > 0 and s, 30, "a batch sent"
        )
        assert state["url"] == hindsight_server.url and state["cluster"] == cluster
        assert state["events_sent"] > 0 and state["events_dropped"] == {}
        html = shown._repr_html_()
        assert hindsight_server.url in html and cluster in html
        assert "batches sent" in html and f"/runs?cluster={cluster}" in html
        assert repr(shown).startswith(f"hindsight: recording cluster {cluster!r}")
