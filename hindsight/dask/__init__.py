"""The Dask agent: record every run of a Dask cluster in Hindsight.

Four ways to turn it on (see docs/dask.md):

* ``dask scheduler --preload hindsight.dask [--hindsight-url URL --hindsight-cluster NAME]``
* ``LocalCluster(scheduler_kwargs={"preload": ["hindsight.dask"]})``
* environment ``HINDSIGHT_URL`` / ``HINDSIGHT_TOKEN`` / ``HINDSIGHT_CLUSTER`` (or Dask config
  ``hindsight.url`` / ``hindsight.token`` / ``hindsight.cluster``) with either of the above;
* ``hindsight.dask.install(client, url=..., cluster=...)`` for a cluster already running.

The scheduler plugin records graphs, task records, runs, workers joining and leaving,
periodic worker samples and the session; it registers the worker plugin, which records
what only a worker sees: ``hindsight.emit`` streams, log records and spill/disk detail.

Every hook is cheap and guarded: the hot ones (``transition``, ``update_graph``) append
compact tuples to the agent's bounded buffer and the agent thread builds the protocol
events.  Nothing here raises into Dask or holds a TaskState.
"""

from hindsight.dask.install import dask_setup, dask_teardown, install
from hindsight.dask.records import PLUGIN_NAME, WORKER_PLUGIN_NAME
from hindsight.dask.scheduler import SchedulerAgentPlugin
from hindsight.dask.worker import WorkerAgentPlugin

__all__ = [
    "PLUGIN_NAME",
    "WORKER_PLUGIN_NAME",
    "SchedulerAgentPlugin",
    "WorkerAgentPlugin",
    "dask_setup",
    "dask_teardown",
    "install",
]
