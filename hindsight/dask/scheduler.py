"""The scheduler plugin: records graphs, task records, runs, workers joining and leaving,
periodic samples and the session."""

from __future__ import annotations

import asyncio
import functools
import logging
import sys
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass
from inspect import iscoroutinefunction
from typing import Any

from distributed.diagnostics.plugin import SchedulerPlugin
from tornado.ioloop import PeriodicCallback

from hindsight.agent import Agent
from hindsight.config import Settings, load_settings
from hindsight.dask.logs import SCHEDULER_LOGGERS, LogHandler, json_safe
from hindsight.dask.perf import RunPerf, enable_code_capture
from hindsight.dask.records import (
    GRAPH_CHUNK,
    LABEL_MAX,
    PLUGIN_NAME,
    SESSION_CONFIG_KEYS,
    WORKER_PLUGIN_NAME,
    departure_reason,
    graph_event,
    key_text,
    killed_worker_text,
    label,
    log_record_event,
    received_at,
    session_name,
    task_event,
    unstamp,
)
from hindsight.dask.state import RunStates, worker_state
from hindsight.dask.values import scheduler_values, worker_values
from hindsight.dask.worker import WorkerAgentPlugin
from hindsight.schema import (
    MAX_LEFT_KEYS,
    MetricEvent,
    RunEvent,
    SessionEvent,
    WorkerEvent,
)

logger = logging.getLogger(__name__)


@dataclass
class OpenRun:
    name: str
    erred: int = 0
    # the latest stop of an erred task's phases: Dask's Span.stop counts only tasks that
    # succeeded, so a run whose last task erred ended, by Span.stop, before that task did
    erred_stop: float = 0.0


class SchedulerAgentPlugin(SchedulerPlugin):
    """Records runs, graphs, task records, workers and samples from the scheduler.

    ``__init__`` keeps only picklable overrides (``url``, ``token``, ``cluster``, any
    :class:`~hindsight.config.Settings` field); they are resolved against the
    scheduler's environment and Dask config in :meth:`start`.
    """

    name = PLUGIN_NAME
    idempotent = True

    def __init__(self, **overrides: Any) -> None:
        unknown = set(overrides) - set(Settings.__dataclass_fields__)
        if unknown:
            raise TypeError(f"unknown Hindsight settings: {sorted(unknown)}")
        self.overrides = {k: v for k, v in overrides.items() if v is not None}
        self._init_runtime()

    def _init_runtime(self) -> None:
        self.agent: Agent | None = None
        self.settings: Settings | None = None
        self.scheduler: Any = None
        self._final_recorded = False
        self._tasks: dict[Any, Any] = {}
        self._spans: Any = None
        self._span_runs: dict[str, str] = {}
        self._open_runs: dict[str, OpenRun] = {}
        # [keys, next position, client, received] per submission still being walked
        self._pending_graphs: deque[list[Any]] = deque()
        # key -> weak reference to the task state whose submission was stamped: a graph
        # also lists the tasks it touches that the scheduler already had (a persisted key
        # still queued), which were not submitted then
        self._stamped: dict[Any, Any] = {}
        self._pump_scheduled = False
        self._workers: dict[str, str] = {}
        # what the scheduler's own events said about workers: the last status each reported,
        # and the "remove-worker" event of a worker being removed (read by remove_worker)
        self._worker_status: dict[str, str] = {}
        self._removing: dict[str, dict[str, Any]] = {}
        self._log_handler: LogHandler | None = None
        self._sampler: PeriodicCallback | None = None
        self._perf: RunPerf | None = None
        self._states: RunStates | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"overrides": self.overrides}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.overrides = state["overrides"]
        self._init_runtime()

    # -- lifecycle ---------------------------------------------------------------------
    async def start(self, scheduler: Any) -> None:
        """Create the agent, record the session and workers, start sampling."""
        try:
            if self.agent is None:
                self._start(scheduler)
            if self.agent is not None:
                await self._register_worker_plugin(scheduler)
        except Exception:
            logger.exception("hindsight: could not start the scheduler agent; recording is off")

    def _start(self, scheduler: Any) -> None:
        settings = load_settings(self.overrides)
        if not settings.enabled:
            logger.warning(
                "hindsight: no collector URL (set HINDSIGHT_URL or hindsight.url); "
                "this cluster is not recorded"
            )
            return
        self.settings = settings
        self.scheduler = scheduler
        self._tasks = scheduler.tasks
        self._spans = scheduler.extensions.get("spans")
        self.session = session_name(str(scheduler.id))
        self.agent = Agent(settings, session=self.session, name="scheduler")
        self.agent.before_exit.append(self._at_exit)
        self.agent.add(self._session_event(scheduler))
        self._perf = RunPerf(self.agent, scheduler)
        self._states = RunStates(self.agent, scheduler, settings.sample_interval)
        # Clients in this process (an in-process LocalCluster's) send their code.
        enable_code_capture(settings.code_frames)
        for address in list(scheduler.workers):
            self.add_worker(scheduler, address)
        self._watch_retries(scheduler)
        self._log_handler = LogHandler(
            self.agent, None, logging.getLevelName(settings.log_level.upper()), SCHEDULER_LOGGERS
        )
        logging.getLogger("distributed").addHandler(self._log_handler)
        self._sampler = PeriodicCallback(self._sample, settings.sample_interval * 1000)
        scheduler.periodic_callbacks["hindsight-sample"] = self._sampler
        self._sampler.start()
        logger.info(
            "hindsight: recording cluster %r session %s to %s",
            settings.cluster,
            self.session,
            settings.url,
        )

    def _watch_retries(self, scheduler: Any) -> None:
        """Record the attempts Dask's ``retries=`` runs again. Dask passes nothing of such
        an attempt to plugins (``stimulus_task_erred`` sends the task back to ``waiting``
        without its times or error), so it was in no record, nor in Dask's task stream:
        its thread's seconds would read as idle. The worker's ``task-erred``
        message has it all: its handler is wrapped to look at the message and then hand it
        on unchanged."""
        handlers = getattr(scheduler, "stream_handlers", None)
        original = handlers.get("task-erred") if isinstance(handlers, dict) else None
        if original is None:
            return
        if getattr(original, "_hindsight_plugin", None) is not None:
            # installed by an earlier instance of this plugin (removed since, or replaced):
            # it records for this one now
            original._hindsight_plugin = self
            return
        if iscoroutinefunction(original):
            return  # not the Dask this was written for: leave its handler alone
        tasks = scheduler.tasks

        def task_erred(*args: Any, **msg: Any) -> Any:
            ts = retries = None
            try:
                ts = tasks.get(msg.get("key"))
                if ts is not None and ts.state == "processing" and ts.retries > 0:
                    retries = ts.retries
            except Exception:
                ts = None
            out = original(*args, **msg)
            if retries is not None and getattr(ts, "retries", None) == retries - 1:
                task_erred._hindsight_plugin._retried(ts, msg)  # type: ignore[attr-defined]
            return out

        task_erred._hindsight_plugin = self  # type: ignore[attr-defined]
        handlers["task-erred"] = task_erred

    def _retried(self, ts: Any, msg: dict[str, Any]) -> None:
        """A task record of an attempt that erred and that Dask runs again (``retries=``):
        ``erred``, with ``attrs.retried``; the run's status does not count it."""
        agent = self.agent
        if agent is None:
            return
        try:
            group = ts.group
            get = msg.get
            record = (
                ts.key,
                group.prefix.name,
                group.name,
                self._run_of(group),
                "erred",
                get("worker"),
            )
            agent.add(
                (
                    task_event,
                    *record,
                    get("thread"),
                    None,
                    None,
                    get("startstops"),
                    get("exception_text"),
                    get("traceback_text"),
                    {"retried": True},
                )
            )
        except Exception:
            logger.debug("hindsight: recording a retried attempt failed", exc_info=True)

    async def _register_worker_plugin(self, scheduler: Any) -> None:
        from distributed.protocol.pickle import dumps

        assert self.settings is not None
        plugin = WorkerAgentPlugin(self.settings, self.session)
        await scheduler.register_worker_plugin(
            None, dumps(plugin), name=WORKER_PLUGIN_NAME, idempotent=True
        )

    def _session_event(self, scheduler: Any) -> SessionEvent:
        import dask

        versions: dict[str, str] = {"python": sys.version.split()[0]}
        for module in ("dask", "distributed", "hindsight", "msgspec", "numpy", "pandas"):
            mod = sys.modules.get(module)
            if mod is not None and getattr(mod, "__version__", None):
                versions[module] = str(mod.__version__)
        config: dict[str, Any] = {}
        for key in SESSION_CONFIG_KEYS:
            try:
                config[key] = json_safe(dask.config.get(key))
            except (KeyError, ValueError):
                pass
        assert self.settings is not None
        config["scheduler.id"] = str(scheduler.id)
        config["hindsight.cluster"] = self.settings.cluster
        config["hindsight.sample-interval"] = self.settings.sample_interval
        return SessionEvent(
            time=time.time(), versions=versions, config=config, address=label(scheduler.address)
        )

    def _record_final(self) -> None:
        """What the scheduler still knows as it goes, once: the graph queue pumped, the
        open runs finished (or erred), the last activity sample."""
        if self._final_recorded:
            return
        self._final_recorded = True
        try:
            if self._sampler is not None:
                self._sampler.stop()
            if self._log_handler is not None:
                logging.getLogger("distributed").removeHandler(self._log_handler)
            self._pump_graph(limit=None)
            self._check_runs(closing=True)
            if self._perf is not None:
                self._perf.sample((), closing=True)
        except Exception:
            logger.exception("hindsight: error while closing")

    def _at_exit(self) -> None:
        """The interpreter is exiting with the scheduler up (a script that never closed its
        cluster): the agent closes before distributed closes the scheduler, so record the
        final state now, on the scheduler's loop while its thread runs (waiting up to 2 s;
        the loop alone touches the plugin's state then), else here."""
        if self.agent is None or self.scheduler is None or self._final_recorded:
            return
        loop = self.scheduler.loop
        running = getattr(getattr(loop, "asyncio_loop", None), "is_running", lambda: False)()
        if not running:
            self._record_final()
            return
        done = threading.Event()

        def record() -> None:
            try:
                self._record_final()
            finally:
                done.set()

        loop.add_callback(record)
        if not done.wait(2.0):
            logger.warning("hindsight: the scheduler's loop did not record the runs at exit")

    async def close(self) -> None:
        """Record what finished, then flush within the close budget off the event loop."""
        agent = self.agent
        if agent is None:
            return
        self._record_final()
        self.agent = None
        if not agent.closed:  # closed already by the interpreter's exit (no executor then)
            await asyncio.get_running_loop().run_in_executor(None, agent.close)

    # -- graph -------------------------------------------------------------------------
    def update_graph(
        self, scheduler: Any, *, client: str | None = None, tasks: Any = (), **kw: Any
    ) -> None:
        """Queue the submitted tasks for graph events; the first chunk is walked now."""
        if self.agent is None:
            return
        try:
            self._pending_graphs.append(
                [
                    list(tasks),
                    0,
                    str(client) if client else None,
                    received_at(kw.get("stimulus_id")),
                ]
            )
            self._pump_graph(limit=GRAPH_CHUNK)
        except Exception:
            logger.exception("hindsight: update_graph failed")

    def _pump_graph(self, limit: int | None = GRAPH_CHUNK) -> None:
        self._pump_scheduled = False
        agent = self.agent
        if agent is None:
            self._pending_graphs.clear()
            return
        budget = limit if limit is not None else sys.maxsize
        tasks = self._tasks
        stamped = self._stamped
        add = agent.add
        while self._pending_graphs and budget > 0:
            if limit is not None and len(agent._buffer) > agent.settings.buffer_events // 2:
                break  # the agent is behind: wait rather than drop graph events
            entry = self._pending_graphs[0]
            keys, pos, client, submitted = entry
            n = min(budget, len(keys) - pos)
            chunk = keys[pos : pos + n]
            if pos + n < len(keys):
                entry[1] = pos + n
            else:
                self._pending_graphs.popleft()
            budget -= n
            last_group = None
            run = prefix = gname = None
            forgotten = 0
            for key in chunk:
                ts = tasks.get(key)
                if ts is None:
                    forgotten += 1
                    continue
                group = ts.group
                if group is not last_group:
                    last_group = group
                    run = self._run_of(group, client)
                    prefix = group.prefix.name
                    gname = group.name
                ref = stamped.get(key)
                if ref is None or ref() is not ts:  # first seen in this task state
                    stamped[key] = weakref.ref(ts, functools.partial(unstamp, stamped, key))
                    when = submitted
                else:
                    when = None
                add((graph_event, key, prefix, gname, run, [d.key for d in ts.dependencies], when))
            if forgotten:
                agent.drop("graph_forgotten", forgotten)
        if self._pending_graphs and not self._pump_scheduled and self.scheduler is not None:
            self._pump_scheduled = True
            delay = 0.0 if len(agent._buffer) <= agent.settings.buffer_events // 2 else 0.05
            self.scheduler.loop.call_later(delay, self._safe_pump)

    def _safe_pump(self) -> None:
        try:
            self._pump_graph()
        except Exception:
            logger.exception("hindsight: graph pump failed")

    def _run_of(self, group: Any, client: str | None = None) -> str | None:
        """The run of a task group: the outermost span of the group's span."""
        span_id = group.span_id
        run = self._span_runs.get(span_id) if span_id else None
        if run is not None and run in self._open_runs:
            return run
        span = self._spans.spans.get(span_id) if self._spans is not None and span_id else None
        if span is None:
            # No spans extension (very old Dask): one run per scheduler computation.
            comps = getattr(self.scheduler, "computations", None)
            run = str(comps[-1].id) if comps else "default"
            name, path, started = "default", ["default"], time.time()
        else:
            root = span
            while root.parent is not None:
                root = root.parent
            run = str(root.id)
            name, path, started = str(root.name[0]), [str(n) for n in root.name], root.enqueued
        if span_id:
            self._span_runs[span_id] = run
        if run not in self._open_runs and self.agent is not None:
            self._open_runs[run] = OpenRun(name)
            if self._perf is not None:
                self._perf.watch(run)
            self.agent.add(
                RunEvent(
                    event="started",
                    id=run,
                    time=started,
                    name=label(name),
                    span=[p[:LABEL_MAX] for p in path],
                    client=label(client),
                )
            )
        return run

    # -- tasks -------------------------------------------------------------------------
    def transition(self, key: Any, start: str, finish: str, *args: Any, **kwargs: Any) -> None:
        """Queue a task record when a task finishes (``processing -> memory | erred``), or
        errs without running (its dependency erred: ``released | queued | no-worker ->
        erred``; Dask's futures of those tasks raise, its task stream has no entry)."""
        # Hot path: called for every transition of every task; most return here.
        if finish != "erred" and (finish != "memory" or start != "processing"):
            return
        agent = self.agent
        if agent is None:
            return
        try:
            ts = self._tasks.get(key)
            if ts is None:
                return
            group = ts.group
            run = self._span_runs.get(group.span_id)
            if run is None or run not in self._open_runs:
                run = self._run_of(group)
            get = kwargs.get
            exception_text = get("exception_text")
            traceback_text = get("traceback_text")
            attrs = None
            if finish == "erred":
                state = self._open_runs.get(run)
                if state is not None:
                    state.erred += 1
                    phases = get("startstops")
                    # A task that erred without times (a KilledWorker; a dependent of a
                    # failed task) erred now: the run closed at the last success before it.
                    last = max(p["stop"] for p in phases) if phases else time.time()
                    if last > state.erred_stop:
                        state.erred_stop = last
                blame = ts.exception_blame
                if start != "processing" and blame is not None and blame is not ts:
                    # erred because ``blame`` did: its error, and which task it was
                    attrs = {"blame": key_text(blame.key)}
                    if exception_text is None:
                        exception_text = blame.exception_text
                        traceback_text = blame.traceback_text
                elif exception_text is None:
                    exception_text = killed_worker_text(key, ts, get("exception"), get("worker"))
            # Keep only what the record needs: the pickled type bytes and the exception
            # objects in kwargs are dropped here rather than held until the batch is cut.
            agent.add(
                (
                    task_event,
                    key,
                    group.prefix.name,
                    group.name,
                    run,
                    finish,
                    get("worker"),
                    get("thread"),
                    get("nbytes"),
                    get("typename"),
                    get("startstops"),
                    exception_text,
                    traceback_text,
                    attrs,
                )
            )
        except Exception:
            logger.debug("hindsight: transition hook failed", exc_info=True)

    # -- runs --------------------------------------------------------------------------
    def _check_runs(self, closing: bool = False, workers: list[Any] | None = None) -> None:
        if self.agent is None or not self._open_runs:
            return
        for run_id, state in list(self._open_runs.items()):
            span = self._spans.spans.get(run_id) if self._spans is not None else None
            done = span.done if span is not None else closing
            if not done and not closing:
                continue
            stop = span.stop if span is not None and done else time.time()
            if done and state.erred_stop > stop:
                stop = state.erred_stop
            erred = state.erred > 0 or not done
            if self._states is not None:
                if workers is None:
                    workers = self._worker_states()
                self._states.final(run_id, stop, workers)
            self.agent.add(
                RunEvent(
                    event="erred" if erred else "finished",
                    id=run_id,
                    time=stop,
                    name=label(state.name),
                )
            )
            del self._open_runs[run_id]

    def restart(self, scheduler: Any) -> None:
        """``client.restart()``: Dask logs it at INFO, below what is recorded by default, and
        the runs it cut short would read as finished with most of their tasks never run.
        Recorded as a scheduler record in each run it cut short."""
        agent = self.agent
        if agent is None:
            return
        try:
            now = time.time()
            message = (
                "Restarting workers and releasing all keys (client.restart()): "
                "tasks not finished then, if any, were cancelled"
            )
            name = "distributed.scheduler"
            for run in list(self._open_runs) or [None]:
                agent.add((log_record_event, now, "WARNING", message, name, "scheduler", None, run))
        except Exception:
            logger.debug("hindsight: recording a restart failed", exc_info=True)

    # -- workers -----------------------------------------------------------------------
    def add_worker(self, scheduler: Any, worker: str) -> None:
        """Record a worker joining."""
        if self.agent is None:
            return
        try:
            ws = scheduler.workers.get(worker)
            name = label(ws.name) if ws is not None else None
            self._workers[worker] = name or worker
            self.agent.add(
                WorkerEvent(
                    event="joined",
                    address=label(worker) or "",
                    time=time.time(),
                    name=name,
                    nthreads=ws.nthreads if ws is not None else None,
                    memory_limit=(ws.memory_limit or None) if ws is not None else None,
                )
            )
        except Exception:
            logger.debug("hindsight: add_worker hook failed", exc_info=True)

    def log_event(self, topic: str, msg: Any) -> None:
        """Keep what the scheduler's events say about workers: a worker's status changes
        (closing, paused...) and the ``remove-worker`` event, which lists the tasks the
        worker was processing and the results only it held (``remove_worker`` reads it)."""
        if self.agent is None or type(msg) is not dict:
            return
        try:
            action = msg.get("action")
            if action == "worker-status-change":
                self._worker_status[str(topic)] = str(msg.get("status"))
            elif action == "remove-worker" and topic == "all":
                self._removing[str(msg.get("worker"))] = msg
        except Exception:
            logger.debug("hindsight: log_event hook failed", exc_info=True)

    def remove_worker(
        self, scheduler: Any, worker: str, *, stimulus_id: str | None = None, **kwargs: Any
    ) -> None:
        """Record a worker leaving: the scheduler's reason (its stimulus), whether it was
        expected, and the tasks its leaving took down. Runs after the scheduler has
        transitioned them, so a processing task that is now ``erred`` failed because of it."""
        if self.agent is None:
            return
        try:
            if self._states is not None:
                self._states.left(label(worker) or "", time.time())
            status = self._worker_status.pop(worker, None)
            removing = self._removing.pop(worker, None) or {}
            processing = list(removing.get("processing-tasks") or ())
            tasks = scheduler.tasks
            erred = [k for k in processing if getattr(tasks.get(k), "state", None) == "erred"]
            lost = list(removing.get("lost-computed-tasks") or ()) + list(
                removing.get("lost-scattered-tasks") or ()
            )
            counts = {"processing": len(processing), "erred": len(erred), "lost": len(lost)}
            expected = removing.get("expected")
            self.agent.add(
                WorkerEvent(
                    event="left",
                    address=label(worker) or "",
                    time=time.time(),
                    name=self._workers.pop(worker, None),
                    reason=departure_reason(stimulus_id),
                    expected=bool(expected) if expected is not None else None,
                    status=status[:64] if status else None,
                    processing=[key_text(k) for k in processing[:MAX_LEFT_KEYS]],
                    erred=[key_text(k) for k in erred[:MAX_LEFT_KEYS]],
                    lost=[key_text(k) for k in lost[:MAX_LEFT_KEYS]],
                    counts={k: v for k, v in counts.items() if v},
                )
            )
        except Exception:
            logger.debug("hindsight: remove_worker hook failed", exc_info=True)

    # -- samples -----------------------------------------------------------------------
    def _sample(self) -> None:
        agent = self.agent
        if agent is None:
            return
        try:
            now = time.time()
            workers = []
            for ws in list(self.scheduler.workers.values()):
                address = label(ws.address) or ""
                values = worker_values(ws)
                agent.add(MetricEvent(worker=address, time=now, values=values))
                workers.append(worker_state(address, values))
            agent.add(
                MetricEvent(worker="scheduler", time=now, values=scheduler_values(self.scheduler))
            )
            if self._states is not None and self._open_runs:
                self._states.sample(self._open_runs, workers, now)
            self._check_runs(workers=workers)
            if self._perf is not None:
                self._perf.sample(self._open_runs)
        except Exception:
            logger.debug("hindsight: sampling failed", exc_info=True)

    def _worker_states(self) -> list[Any]:
        return [
            worker_state(label(ws.address) or "", worker_values(ws))
            for ws in list(self.scheduler.workers.values())
        ]
