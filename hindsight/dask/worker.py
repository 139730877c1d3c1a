"""The worker plugin: what only a worker sees (``hindsight.emit`` streams, log records, spill
and disk detail, profiles)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from distributed.diagnostics.plugin import WorkerPlugin
from tornado.ioloop import PeriodicCallback

from hindsight.agent import Agent
from hindsight.config import Settings
from hindsight.dask.logs import LogHandler
from hindsight.dask.perf import ProfileShipper
from hindsight.dask.records import WORKER_PLUGIN_NAME, label
from hindsight.dask.values import spill_values
from hindsight.schema import (
    MetricEvent,
)
from hindsight.streams import (
    scheduler_time,
)

logger = logging.getLogger(__name__)


class WorkerAgentPlugin(WorkerPlugin):
    """The worker-side agent: ``hindsight.emit`` streams, log records, spill/disk detail.

    Registered by :class:`SchedulerAgentPlugin`; carries the resolved settings and the
    scheduler's session so its events join the same session and runs.
    """

    name = WORKER_PLUGIN_NAME
    idempotent = True

    def __init__(self, settings: Settings, session: str) -> None:
        self.settings = settings
        self.session = session
        self._runtime: dict[str, Any] = {}

    def __getstate__(self) -> dict[str, Any]:
        return {"settings": self.settings, "session": self.session}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["settings"], state["session"])

    def setup(self, worker: Any) -> None:
        """Start the worker's agent, its log handler and its spill/disk sampler."""
        try:
            from hindsight.streams import set_worker_context

            agent = Agent(self.settings, session=self.session, name=f"worker-{worker.name}")
            level = logging.getLevelName(self.settings.log_level.upper())
            handler = LogHandler(agent, worker, level)
            # "distributed" does not propagate to the root logger (Dask's logging
            # config), so both need the handler, and no record reaches it twice.
            loggers = [logging.getLogger(), logging.getLogger("distributed")]
            for lg in loggers:
                lg.addHandler(handler)
            set_worker_context(agent, worker)
            sampler = PeriodicCallback(
                lambda: self._sample(worker, agent), self.settings.sample_interval * 1000
            )
            worker.periodic_callbacks["hindsight-sample"] = sampler
            sampler.start()
            self._runtime = {
                "agent": agent,
                "handler": handler,
                "loggers": loggers,
                "sampler": sampler,
            }
            if self.settings.profiles:
                self._start_profiles(worker, agent)
        except Exception:
            logger.exception("hindsight: could not start the worker agent")

    async def teardown(self, worker: Any) -> None:
        """Stop sampling and log capture; flush the worker agent within its budget."""
        runtime, self._runtime = self._runtime, {}
        agent = runtime.get("agent")
        if agent is None:
            return
        try:
            from hindsight.streams import clear_worker_context

            runtime["sampler"].stop()
            worker.periodic_callbacks.pop("hindsight-sample", None)
            profiles = runtime.get("profiles")
            if profiles is not None:
                runtime["profiles_pc"].stop()
                worker.periodic_callbacks.pop("hindsight-profiles", None)
                profiles.final()
            for lg in runtime["loggers"]:
                lg.removeHandler(runtime["handler"])
            clear_worker_context(agent)
            self._sample(worker, agent)
        except Exception:
            logger.debug("hindsight: worker teardown failed", exc_info=True)
        await last_heartbeat(worker)
        await asyncio.get_running_loop().run_in_executor(None, agent.close)

    def _start_profiles(self, worker: Any, agent: Agent) -> None:
        shipper = ProfileShipper(worker, agent, self.settings.profile_interval)

        def poll() -> None:
            try:
                shipper.poll()
            except Exception:
                logger.debug("hindsight: profile shipping failed", exc_info=True)

        pc = PeriodicCallback(poll, max(shipper.every, 0.1) * 1000)
        worker.periodic_callbacks["hindsight-profiles"] = pc
        pc.start()
        self._runtime["profiles"] = shipper
        self._runtime["profiles_pc"] = pc

    def _sample(self, worker: Any, agent: Agent) -> None:
        try:
            agent.add(
                MetricEvent(
                    worker=label(worker.address) or "",
                    time=scheduler_time(worker),
                    values=spill_values(worker),
                )
            )
        except Exception:
            logger.debug("hindsight: worker sampling failed", exc_info=True)


#: The longest the worker's last heartbeat may hold up its close.
LAST_HEARTBEAT_S = 1.0


async def last_heartbeat(worker: Any) -> None:
    """Send the scheduler the worker's fine performance metrics of its last tasks now.

    Dask ships a task's metrics with the worker's next heartbeat (every 0.5-2 s), and a
    script that closes its cluster at once (``compute()``, then ``client.close();
    cluster.close()``) closes the worker before it: the scheduler's spans, from which the
    scheduler's agent records each run's activity, would miss the last wave of tasks. One
    heartbeat more, bounded, while the worker is closing and its scheduler still there."""
    try:
        await asyncio.wait_for(worker.heartbeat(), LAST_HEARTBEAT_S)
    except Exception:  # the scheduler is gone, or slow: the close goes on
        logger.debug("hindsight: last heartbeat not sent", exc_info=True)
