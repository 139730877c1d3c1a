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

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
import math
import re
import shutil
import sys
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass
from inspect import iscoroutinefunction
from typing import Any

import click
from distributed.diagnostics.plugin import SchedulerPlugin, WorkerPlugin
from tornado.ioloop import PeriodicCallback

from hindsight.agent import Agent
from hindsight.config import Settings, load_settings
from hindsight.dask_perf import ProfileShipper, RunPerf, enable_code_capture
from hindsight.dask_state import RunStates, worker_state
from hindsight.schema import (
    MAX_INT,
    MAX_LEFT_KEYS,
    GraphEvent,
    LogEvent,
    MetricEvent,
    RunEvent,
    SessionEvent,
    StartStop,
    TaskEvent,
    WorkerEvent,
    valid_name,
)
from hindsight.streams import (
    current_task,
    owns_record,
    running_worker,
    scheduler_time,
    task_and_run,
    task_owner,
)

logger = logging.getLogger(__name__)

PLUGIN_NAME = "hindsight"
WORKER_PLUGIN_NAME = "hindsight-worker"
#: Tasks of a submitted graph turned into graph events per event-loop tick; a larger
#: graph is walked over several ticks so the scheduler never stalls on us.
GRAPH_CHUNK = 5000

LABEL_MAX = 1024
KEY_MAX = 4096
TEXT_MAX = 65536

# Configuration recorded with the session: what changes how a run behaves.
SESSION_CONFIG_KEYS = (
    "distributed.scheduler.worker-saturation",
    "distributed.scheduler.work-stealing",
    "distributed.scheduler.allowed-failures",
    "distributed.worker.memory.target",
    "distributed.worker.memory.spill",
    "distributed.worker.memory.pause",
    "distributed.worker.memory.terminate",
    "distributed.admin.tick.interval",
    "distributed.comm.compression",
)


def _label(value: Any) -> str | None:
    if value is None:
        return None
    s = value if type(value) is str else str(value)
    return s if len(s) <= LABEL_MAX else s[:LABEL_MAX]


def _key(key: Any) -> str:
    s = key if type(key) is str else str(key)
    return s if len(s) <= KEY_MAX else _long_key(s)


def _long_key(s: str) -> str:
    """A key past the protocol's 4,096 characters: its start, ``#`` and 32 hex digits of its
    hash, so distinct keys stay distinct (cut alone, keys sharing their first 4,096
    characters became one task) and the same key always gives the same text (edges)."""
    digest = hashlib.blake2b(s.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()
    return f"{s[: KEY_MAX - 33]}#{digest}"


def _text(value: Any) -> str | None:
    if not value:
        return None
    s = str(value)
    return s if len(s) <= TEXT_MAX else s[-TEXT_MAX:]


# -- deferred event builders (run on the agent thread) ------------------------------
def _task_event(
    key: Any,
    prefix: str,
    group: str,
    run: str | None,
    status: str,
    worker: Any,
    thread: Any,
    nbytes: Any,
    typename: Any,
    startstops: Any,
    exception_text: Any,
    traceback_text: Any,
    attrs: dict[str, Any] | None = None,
) -> TaskEvent:
    ev = TaskEvent(
        key=_key(key),
        prefix=_label(prefix) or "",
        status=status,
        group=_label(group),
        run=run,
        worker=_label(worker),
        thread=thread if type(thread) is int and abs(thread) <= MAX_INT else None,
        # the protocol's integers end at 2**53: a lazy table's sizeof (10 PB) had the
        # collector refuse the whole batch, and the agent drop it
        nbytes=nbytes if type(nbytes) is int and 0 <= nbytes <= MAX_INT else None,
        typename=_label(typename),
        startstops=[
            StartStop(
                action=s["action"], start=s["start"], stop=s["stop"], source=_label(s.get("source"))
            )
            for s in startstops or ()
        ],
        exception=_text(exception_text),
        traceback=_text(traceback_text),
    )
    if attrs:
        ev.attrs = attrs
    return ev


def _unstamp(stamped: dict[Any, Any], key: Any, ref: Any) -> None:
    """A stamped task state was collected: forget it (unless the key was stamped anew)."""
    if stamped.get(key) is ref:
        stamped.pop(key, None)


def _received(stimulus_id: Any) -> float:
    """When the scheduler received a graph: Dask stamps ``update-graph-{time}`` on arrival,
    before it deserialises, materialises and orders the graph (which can take seconds, and
    runs before this plugin's hook); else now."""
    if type(stimulus_id) is str and stimulus_id.startswith("update-graph-"):
        try:
            t = float(stimulus_id[13:])
        except ValueError:
            pass
        else:
            if 0 < t <= time.time() + 1:
                return t
    return time.time()


def _graph_event(
    key: Any, prefix: str, group: str, run: str | None, deps: list[Any], submitted: float | None
) -> GraphEvent:
    return GraphEvent(
        key=_key(key),
        prefix=_label(prefix) or "",
        dependencies=[_key(d) for d in deps],
        group=_label(group),
        run=run,
        time=submitted,
    )


def _log_event(
    created: float,
    level: str,
    message: str,
    name: str,
    worker: str | None,
    key: str | None = None,
    run: str | None = None,
) -> LogEvent:
    return LogEvent(
        time=created,
        level=level,
        message=_text(message) or "",
        logger=_label(name),
        worker=worker,
        key=_key(key) if key is not None else None,
        run=_label(run),
    )


def _killed_worker_text(key: Any, ts: Any, exception: Any, worker: Any) -> str | None:
    """The text of the ``KilledWorker`` the scheduler raises itself when a task's worker
    dies once too often (it passes the pickled exception and no text): Dask's own message,
    from the scheduler's task state, without unpickling anything."""
    if not isinstance(exception, bytes) or b"KilledWorker" not in exception:
        return None
    return (
        f"KilledWorker: Attempted to run task {key!r} on {getattr(ts, 'suspicious', '?')} "
        "different workers, but all those workers died while running it. The last worker "
        f"that attempt to run the task was {worker}."
    )


def _session_name(value: str) -> str:
    if valid_name(value):
        return value
    safe = re.sub(r"[^A-Za-z0-9_.\-]", "-", value).strip(".-")[:128]
    return safe if valid_name(safe) else "session"


def _reason(stimulus_id: str | None) -> str | None:
    if not stimulus_id:
        return None
    # "handle-worker-cleanup-1795295401.78" -> "handle-worker-cleanup"
    return re.sub(r"-\d+(\.\d+)?$", "", str(stimulus_id))[:LABEL_MAX]


@dataclass
class _Run:
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
        self._open_runs: dict[str, _Run] = {}
        # [keys, next position, client, received] per submission still being walked
        self._pending_graphs: deque[list[Any]] = deque()
        # key -> weak reference to the task state whose submission was stamped: a graph
        # also lists the tasks it touches that the scheduler already had (a persisted key
        # still queued), which were not submitted then (found by a held-out check)
        self._stamped: dict[Any, Any] = {}
        self._pump_scheduled = False
        self._workers: dict[str, str] = {}
        # what the scheduler's own events said about workers: the last status each reported,
        # and the "remove-worker" event of a worker being removed (read by remove_worker)
        self._worker_status: dict[str, str] = {}
        self._removing: dict[str, dict[str, Any]] = {}
        self._log_handler: _LogHandler | None = None
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
        self.session = _session_name(str(scheduler.id))
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
        self._log_handler = _LogHandler(
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
        its thread's seconds read as idle (found by a trial). The worker's ``task-erred``
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
                    _task_event,
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
                config[key] = _json_safe(dask.config.get(key))
            except (KeyError, ValueError):
                pass
        assert self.settings is not None
        config["scheduler.id"] = str(scheduler.id)
        config["hindsight.cluster"] = self.settings.cluster
        config["hindsight.sample-interval"] = self.settings.sample_interval
        return SessionEvent(
            time=time.time(), versions=versions, config=config, address=_label(scheduler.address)
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
                [list(tasks), 0, str(client) if client else None, _received(kw.get("stimulus_id"))]
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
                    stamped[key] = weakref.ref(ts, functools.partial(_unstamp, stamped, key))
                    when = submitted
                else:
                    when = None
                add((_graph_event, key, prefix, gname, run, [d.key for d in ts.dependencies], when))
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
            self._open_runs[run] = _Run(name)
            if self._perf is not None:
                self._perf.watch(run)
            self.agent.add(
                RunEvent(
                    event="started",
                    id=run,
                    time=started,
                    name=_label(name),
                    span=[p[:LABEL_MAX] for p in path],
                    client=_label(client),
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
                    attrs = {"blame": _key(blame.key)}
                    if exception_text is None:
                        exception_text = blame.exception_text
                        traceback_text = blame.traceback_text
                elif exception_text is None:
                    exception_text = _killed_worker_text(key, ts, get("exception"), get("worker"))
            # Keep only what the record needs: the pickled type bytes and the exception
            # objects in kwargs are dropped here rather than held until the batch is cut.
            agent.add(
                (
                    _task_event,
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
                    name=_label(state.name),
                )
            )
            del self._open_runs[run_id]

    def restart(self, scheduler: Any) -> None:
        """``client.restart()``: Dask logs it at INFO, below what is recorded by default, and
        the runs it cut short read as finished with most of their tasks never run (found by
        a trial). Recorded as a scheduler record in each run it cut short."""
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
                agent.add((_log_event, now, "WARNING", message, name, "scheduler", None, run))
        except Exception:
            logger.debug("hindsight: recording a restart failed", exc_info=True)

    # -- workers -----------------------------------------------------------------------
    def add_worker(self, scheduler: Any, worker: str) -> None:
        """Record a worker joining."""
        if self.agent is None:
            return
        try:
            ws = scheduler.workers.get(worker)
            name = _label(ws.name) if ws is not None else None
            self._workers[worker] = name or worker
            self.agent.add(
                WorkerEvent(
                    event="joined",
                    address=_label(worker) or "",
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
                self._states.left(_label(worker) or "", time.time())
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
                    address=_label(worker) or "",
                    time=time.time(),
                    name=self._workers.pop(worker, None),
                    reason=_reason(stimulus_id),
                    expected=bool(expected) if expected is not None else None,
                    status=status[:64] if status else None,
                    processing=[_key(k) for k in processing[:MAX_LEFT_KEYS]],
                    erred=[_key(k) for k in erred[:MAX_LEFT_KEYS]],
                    lost=[_key(k) for k in lost[:MAX_LEFT_KEYS]],
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
                address = _label(ws.address) or ""
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
            worker_state(_label(ws.address) or "", worker_values(ws))
            for ws in list(self.scheduler.workers.values())
        ]


def _number(values: dict[str, float], name: str, value: Any) -> None:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        values[name] = float(value)  # inf was encoded as null: the batch refused


def worker_values(ws: Any) -> dict[str, float]:
    """One sample of a worker as the scheduler sees it (memory, cpu, tasks, transfers)."""
    values: dict[str, float] = {}
    mem = ws.memory
    _number(values, "memory.managed", mem.managed)
    _number(values, "memory.unmanaged", mem.unmanaged)
    _number(values, "memory.unmanaged_old", mem.unmanaged_old)
    _number(values, "memory.unmanaged_recent", mem.unmanaged_recent)
    _number(values, "memory.spilled", mem.spilled)
    _number(values, "memory.process", mem.process)
    _number(values, "memory.limit", ws.memory_limit or 0)
    _number(values, "tasks.processing", len(ws.processing))
    _number(values, "nthreads", ws.nthreads)
    m = ws.metrics or {}
    _number(values, "cpu", m.get("cpu"))
    _number(values, "event_loop_interval", m.get("event_loop_interval"))
    _number(values, "num_fds", m.get("num_fds"))
    for state, count in (m.get("task_counts") or {}).items():
        _number(values, f"tasks.{state}", count)
    transfer = m.get("transfer") or {}
    for name in (
        "incoming_bytes",
        "outgoing_bytes",
        "incoming_count_total",
        "outgoing_count_total",
    ):
        _number(values, f"transfer.{name}", transfer.get(name))
    spilled = m.get("spilled_bytes") or {}
    _number(values, "spilled.memory", spilled.get("memory"))
    _number(values, "spilled.disk", spilled.get("disk"))
    for io in ("host_net_io", "host_disk_io"):
        for name, v in (m.get(io) or {}).items():
            _number(values, f"{io}.{name}", v)
    return values


def scheduler_values(scheduler: Any) -> dict[str, float]:
    """One sample of the scheduler process itself."""
    values: dict[str, float] = {}
    try:
        last = scheduler.monitor.recent()
    except Exception:
        last = {}
    _number(values, "cpu", last.get("cpu"))
    _number(values, "memory.process", last.get("memory"))
    _number(values, "tasks", len(scheduler.tasks))
    _number(values, "workers", len(scheduler.workers))
    _number(values, "event_loop_interval", getattr(scheduler, "_tick_interval_observed", None))
    return values


#: The scheduler's own loggers (its process may also hold a client, or workers in-process,
#: whose records are not the scheduler's).
SCHEDULER_LOGGERS = (
    "distributed.scheduler",
    "distributed.active_memory_manager",
    "distributed.stealing",
    "distributed.shuffle._scheduler_plugin",
)


def _json_safe(value: Any) -> Any:
    """A config value as JSON can hold it: infinities and NaN as text (``inf``), which JSON
    has no number for. ``worker-saturation: inf`` (root-task queuing off) was recorded as
    null, as if it were not set (found by a trial)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


def _compute_failed(record: logging.LogRecord) -> bool:
    """Whether ``record`` is Dask's worker's "Compute Failed" of a task (key first)."""
    msg, args = record.msg, record.args
    return (
        isinstance(msg, str)
        and msg.startswith("Compute Failed\nKey:")
        and isinstance(args, tuple)
        and len(args) > 0
    )


class _LogHandler(logging.Handler):
    """Copies log records at or above the configured level into an agent: a worker's
    (``worker``; a record logged by a task names the task and its run) or the scheduler's
    (``worker`` None: records of ``only`` loggers, as worker ``scheduler``)."""

    def __init__(
        self, agent: Agent, worker: Any, level: int, only: tuple[str, ...] | None = None
    ) -> None:
        super().__init__(level)
        self.agent = agent
        self.worker = worker
        self.address = str(worker.address) if worker is not None else "scheduler"
        self.only = only
        self._last: logging.LogRecord | None = None

    def emit(self, record: logging.LogRecord) -> None:
        # Our own warnings about delivery problems must not feed back into delivery.
        if record.name.startswith("hindsight"):
            return
        # On both loggers, this handler sees a record of "distributed" twice where it
        # propagates to the root logger (Dask's logging config stops it; a host
        # application's may not: found by a review)
        if record is self._last:
            return
        self._last = record
        if self.only is not None and not record.name.startswith(self.only):
            return
        if self.only is None and record.name.startswith(SCHEDULER_LOGGERS):
            return  # workers in the scheduler's process: the scheduler's handler has it
        try:
            message = record.getMessage()
            if record.exc_info:
                message = f"{message}\n{logging.Formatter().formatException(record.exc_info)}"
            if self.worker is None:
                at, key, run = record.created, None, None
            elif _compute_failed(record) and running_worker() is None:
                # Dask logs a task's failure on the event loop, after its thread let go of
                # it: the key is the record's first argument. Placed by time alone, a
                # failure could land in the next run (found by a trial). Of workers that
                # share a process, the one with the task keeps it (found by a review).
                owner = task_owner(record.args[0])
                if not (owner is self.worker if owner is not None else owns_record(self.worker)):
                    return
                at = scheduler_time(self.worker, record.created)
                key, run = task_and_run(self.worker, record.args[0])
            elif not owns_record(self.worker):
                return  # another worker's in this process (processes=False): its own handler
            else:
                at = scheduler_time(self.worker, record.created)
                key, run = current_task(self.worker)
            self.agent.add(
                (_log_event, at, record.levelname, message, record.name, self.address, key, run)
            )
        except Exception:
            pass


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
            handler = _LogHandler(agent, worker, level)
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
                    worker=_label(worker.address) or "",
                    time=scheduler_time(worker),
                    values=spill_values(worker),
                )
            )
        except Exception:
            logger.debug("hindsight: worker sampling failed", exc_info=True)


def spill_values(worker: Any) -> dict[str, float]:
    """Spill and disk detail only the worker has (the scheduler sees only totals)."""
    values: dict[str, float] = {}
    data = worker.data
    spilled = getattr(data, "spilled_total", None)
    if spilled is not None:
        _number(values, "spill.disk_bytes", spilled.disk)
        _number(values, "spill.disk_memory_bytes", spilled.memory)
    slow = getattr(data, "slow", None)
    if slow is not None:
        _number(values, "spill.disk_keys", len(slow))
    fast = getattr(data, "fast", None)
    if fast is not None:
        _number(values, "spill.memory_keys", len(fast))
    for (label, unit), v in list(getattr(data, "cumulative_metrics", {}).items()):
        _number(values, f"spill.{label}.{unit}", v)
    try:
        usage = shutil.disk_usage(worker.local_directory)
        _number(values, "disk.free_bytes", usage.free)
        _number(values, "disk.total_bytes", usage.total)
    except (OSError, AttributeError):
        pass
    return values


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
