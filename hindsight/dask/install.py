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
) -> None:
    """Start recording a running cluster: registers the scheduler plugin (which registers
    the worker plugin).  A no-op if the cluster already records (e.g. via the preload).

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
