"""The ways to turn the agent on: ``install(client)``, and ``--preload hindsight.dask``
(``dask_setup``)."""

from __future__ import annotations

import logging
from typing import Any

import click

from hindsight.config import load_settings
from hindsight.dask.perf import enable_code_capture
from hindsight.dask.records import PLUGIN_NAME
from hindsight.dask.scheduler import SchedulerAgentPlugin

logger = logging.getLogger(__name__)


# -- set-up paths ------------------------------------------------------------------------
def install(
    client: Any,
    url: str | None = None,
    cluster: str | None = None,
    token: str | None = None,
    **settings: Any,
) -> Installed:
    """Start recording a running cluster: registers the scheduler plugin (which registers
    the worker plugin).  A no-op if the cluster already records (e.g. via the preload).
    Returns a view of the scheduler agent's state (its HTML in Jupyter).

    Settings not given here come from the scheduler's Dask config and environment.
    This client is also made to send the code of each computation (``code_frames``
    client frames, default 1; see ``distributed.diagnostics.computations.nframes``).
    """
    try:
        frames = settings.get("code_frames")
        enable_code_capture(
            load_settings({} if frames is None else {"code_frames": frames}).code_frames
        )
    except Exception:
        logger.warning("hindsight: could not turn on code capture", exc_info=True)
    client.register_plugin(
        SchedulerAgentPlugin(url=url, cluster=cluster, token=token, **settings), name=PLUGIN_NAME
    )
    return Installed(client)


def _agent_state(dask_scheduler: Any) -> dict[str, Any] | None:
    """The scheduler agent's state, read in the scheduler (``client.run_on_scheduler``)."""
    plugin = dask_scheduler.plugins.get(PLUGIN_NAME)
    agent = getattr(plugin, "agent", None)
    if plugin is None or agent is None:
        return None
    st = plugin.settings
    return {
        "url": st.url,
        "cluster": st.cluster,
        "session": plugin.session,
        "batches_sent": int(agent.stats.get("sent_batches", 0)),
        "events_sent": int(agent.stats.get("sent_events", 0)),
        "batches_spooled": int(agent.stats.get("spooled", 0)),
        "events_pending": int(agent.pending()),
        "events_dropped": dict(agent._all_dropped()),
        "retries": int(agent.stats.get("retries", 0)),
    }


class Installed:
    """What ``install`` started: ``state()`` reads the scheduler agent's collector URL,
    cluster, batches sent and spooled, events pending and dropped; in Jupyter it draws
    them with a link to the cluster's live runs."""

    def __init__(self, client: Any) -> None:
        self.client = client

    def state(self) -> dict[str, Any] | None:
        """The scheduler agent's state (None: the cluster does not record)."""
        result: dict[str, Any] | None = self.client.run_on_scheduler(_agent_state)
        return result

    def __repr__(self) -> str:
        st = self.state()
        if st is None:
            return "hindsight: not recording"
        return (
            f"hindsight: recording cluster {st['cluster']!r} to {st['url']}, "
            f"{st['batches_sent']} batches sent, {st['batches_spooled']} spooled, "
            f"{sum(st['events_dropped'].values())} events dropped"
        )

    def _repr_html_(self) -> str:
        from html import escape
        from urllib.parse import quote

        st = self.state()
        if st is None:
            return "<p>hindsight: this cluster does not record</p>"
        runs = f"{st['url'].rstrip('/')}/runs?cluster={quote(str(st['cluster']))}"
        dropped = ", ".join(f"{k}: {v}" for k, v in st["events_dropped"].items()) or "none"
        rows = [
            ("collector", escape(str(st["url"]))),
            ("cluster", escape(str(st["cluster"]))),
            ("session", escape(str(st["session"]))),
            ("batches sent", f"{st['batches_sent']:,} ({st['events_sent']:,} events)"),
            ("batches spooled", f"{st['batches_spooled']:,}"),
            ("events pending", f"{st['events_pending']:,}"),
            ("events dropped", escape(dropped)),
            ("runs", f"<a href='{escape(runs)}' target='_blank'>the live run pages</a>"),
        ]
        body = "".join(
            f"<tr><th style='text-align:left'>{k}</th><td>{v}</td></tr>" for k, v in rows
        )
        return f"<table class='hindsight-agent'>{body}</table>"


@click.command(context_settings={"ignore_unknown_options": True})
@click.option("--hindsight-url", default=None, help="Collector URL (else HINDSIGHT_URL).")
@click.option("--hindsight-token", default=None, help="Bearer token (else HINDSIGHT_TOKEN).")
@click.option("--hindsight-cluster", default=None, help="Cluster name (else HINDSIGHT_CLUSTER).")
def dask_setup(
    server: Any,
    hindsight_url: str | None,
    hindsight_token: str | None,
    hindsight_cluster: str | None,
) -> None:
    """Preload entry point: ``dask scheduler --preload hindsight.dask``."""
    from distributed import Scheduler

    if not isinstance(server, Scheduler):
        logger.warning(
            "hindsight.dask is a scheduler preload; workers get their plugin from the "
            "scheduler. Ignoring the preload on %s",
            type(server).__name__,
        )
        return
    try:
        server.add_plugin(
            SchedulerAgentPlugin(
                url=hindsight_url, token=hindsight_token, cluster=hindsight_cluster
            ),
            name=PLUGIN_NAME,
            idempotent=True,
        )
    except Exception:
        logger.exception("hindsight: could not add the scheduler plugin")


def dask_teardown(server: Any) -> None:
    """Preload teardown: nothing to do, the plugin's ``close`` flushes the agent."""
