"""Synthetic bodies of Ray's event exporter, shaped like the ones Ray 2.60 sends
(research/ray/ samples): for tests that need orders, losses and duplicates a real cluster
will not produce on demand, and for the Ray ingest benchmark.

A task attempt is three events, as Ray sends them: its definition and the submitter's
lifecycle event (PENDING_ARGS_AVAIL, PENDING_NODE_ASSIGNMENT, SUBMITTED_TO_WORKER, then
FINISHED or FAILED with ``rayErrorInfo``), and the executing worker's RUNNING.
"""

from __future__ import annotations

import base64
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

SESSION_TIME = 1795383774.270620  # a session's start, to the microsecond as Ray names it


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def stamp(t: float) -> str:
    """RFC 3339 with nanoseconds, as protobuf's JSON encoding writes a Timestamp."""
    whole = int(t)
    ns = int(round((t - whole) * 1e9))
    if ns >= 1_000_000_000:
        whole, ns = whole + 1, ns - 1_000_000_000
    return datetime.fromtimestamp(whole, UTC).strftime("%Y-%m-%dT%H:%M:%S") + f".{ns:09d}Z"


def job_bytes(job: int) -> bytes:
    return job.to_bytes(4, "little")


@dataclass
class Task:
    """One attempt of a synthetic task and what Ray will say about it."""

    task_id: bytes
    attempt: int
    job: int
    name: str
    func: str
    start: float
    stop: float
    failed: bool = False
    actor: bytes | None = None
    parent: bytes | None = None

    @property
    def hex(self) -> str:
        return self.task_id.hex()


@dataclass
class RaySim:
    """A Ray session's worth of events: one node (``ip``), a few worker processes, jobs."""

    seed: int = 0
    ip: str = "10.0.0.7"
    session_time: float = SESSION_TIME
    workers: int = 2
    session_id: int | None = None  # nodes of one cluster share it (default: the seed)
    rng: random.Random = field(init=False)
    node: bytes = field(init=False)
    worker_ids: list[bytes] = field(init=False)
    pids: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.node = self._id(28)
        self.worker_ids = [self._id(28) for _ in range(self.workers)]
        self.pids = [20000 + self.seed * 100 + i for i in range(self.workers)]

    @property
    def session(self) -> str:
        d = datetime.fromtimestamp(self.session_time, UTC)
        n = self.seed if self.session_id is None else self.session_id
        return d.strftime("session_%Y-%m-%d_%H-%M-%S_") + f"{d.microsecond:06d}_{4000 + n}"

    def _id(self, n: int) -> bytes:
        return bytes(self.rng.getrandbits(8) for _ in range(n))

    def _event(
        self, etype: str, source: str, t: float, payload_name: str, payload: dict[str, Any]
    ) -> dict[str, Any]:
        return {
            "eventId": b64(self._id(28)),
            "sourceType": source,
            "eventType": etype,
            "timestamp": stamp(t),
            "severity": "INFO",
            "sessionName": self.session,
            payload_name: payload,
            "nodeId": b64(self.node),
            "message": "",
        }

    # -------------------------------------------------------------- cluster, workers, jobs

    def node_events(self, t: float) -> list[dict[str, Any]]:
        node = b64(self.node)
        return [
            self._event(
                "NODE_DEFINITION_EVENT",
                "GCS",
                t,
                "nodeDefinitionEvent",
                {
                    "nodeId": node,
                    "nodeIpAddress": self.ip,
                    "labels": {"ray.io/node-id": self.node.hex()},
                    "startTimestamp": stamp(t),
                    "hostname": "sim",
                    "nodeName": self.ip,
                    "instanceId": "",
                    "instanceTypeName": "",
                },
            ),
            self._event(
                "NODE_LIFECYCLE_EVENT",
                "GCS",
                t,
                "nodeLifecycleEvent",
                {
                    "nodeId": node,
                    "stateTransitions": [
                        {
                            "timestamp": stamp(t),
                            "resources": {"CPU": float(self.workers), "memory": 17089489716.0},
                            "state": "ALIVE",
                            "aliveSubState": "UNSPECIFIED",
                        }
                    ],
                },
            ),
        ]

    def worker_events(self, t: float, ended: float | None = None) -> list[dict[str, Any]]:
        out = []
        for wid, pid in zip(self.worker_ids, self.pids, strict=True):
            out.append(
                self._event(
                    "WORKER_DEFINITION_EVENT",
                    "GCS",
                    t,
                    "workerDefinitionEvent",
                    {
                        "workerId": b64(wid),
                        "nodeId": b64(self.node),
                        "pid": pid,
                        "workerType": "WORKER",
                    },
                )
            )
            out.append(
                self._event(
                    "WORKER_LIFECYCLE_EVENT",
                    "GCS",
                    t,
                    "workerLifecycleEvent",
                    {
                        "workerId": b64(wid),
                        "stateTransitions": [
                            {
                                "timestamp": stamp(t),
                                "workerLaunchTimeMs": str(int(t * 1000) - 300),
                                "workerLaunchedTimeMs": str(int(t * 1000) - 20),
                                "startTimeMs": str(int(t * 1000)),
                                "state": "ALIVE",
                                "endTimeMs": "0",
                            }
                        ],
                        "jobId": "",
                    },
                )
            )
            if ended is not None:
                out.append(
                    self._event(
                        "WORKER_LIFECYCLE_EVENT",
                        "GCS",
                        ended,
                        "workerLifecycleEvent",
                        {
                            "workerId": b64(wid),
                            "jobId": "",
                            "stateTransitions": [
                                {
                                    "state": "DEAD",
                                    "timestamp": stamp(ended),
                                    "endTimeMs": str(int(ended * 1000)),
                                    "deathInfo": {
                                        "exitType": "INTENDED_USER_EXIT",
                                        "exitDetail": "Worker force exited because its job "
                                        "has finished",
                                    },
                                    "workerLaunchTimeMs": "0",
                                    "workerLaunchedTimeMs": "0",
                                    "startTimeMs": "0",
                                }
                            ],
                        },
                    )
                )
        return out

    def job_start(
        self, job: int, t: float, entrypoint: str = "python job.py"
    ) -> list[dict[str, Any]]:
        jid = b64(job_bytes(job))
        driver = b64(b"\xff" * 20 + job_bytes(job))
        return [
            self._event(
                "DRIVER_JOB_DEFINITION_EVENT",
                "GCS",
                t,
                "driverJobDefinitionEvent",
                {
                    "jobId": jid,
                    "driverPid": str(30000 + job),
                    "driverNodeId": b64(self.node),
                    "entrypoint": entrypoint,
                    "config": {"serializedRuntimeEnv": "{}", "metadata": {}},
                },
            ),
            self._event(
                "DRIVER_JOB_LIFECYCLE_EVENT",
                "GCS",
                t,
                "driverJobLifecycleEvent",
                {"jobId": jid, "stateTransitions": [{"state": "CREATED", "timestamp": stamp(t)}]},
            ),
            self._event(
                "TASK_DEFINITION_EVENT",
                "CORE_WORKER",
                t,
                "taskDefinitionEvent",
                {
                    "taskId": driver,
                    "taskType": "DRIVER_TASK",
                    "taskFunc": {},
                    "jobId": jid,
                    "parentTaskId": b64(b"\xff" * 24),
                    "taskAttempt": 0,
                    "language": "PYTHON",
                    "taskName": "",
                },
            ),
            self._event(
                "TASK_LIFECYCLE_EVENT",
                "CORE_WORKER",
                t,
                "taskLifecycleEvent",
                {
                    "taskId": driver,
                    "stateTransitions": [{"state": "RUNNING", "timestamp": stamp(t)}],
                    "jobId": jid,
                    "taskAttempt": 0,
                    "nodeId": "",
                    "workerId": "",
                    "workerPid": 0,
                },
            ),
        ]

    def job_end(self, job: int, t: float) -> list[dict[str, Any]]:
        jid = b64(job_bytes(job))
        driver = b64(b"\xff" * 20 + job_bytes(job))
        return [
            self._event(
                "TASK_LIFECYCLE_EVENT",
                "CORE_WORKER",
                t,
                "taskLifecycleEvent",
                {
                    "taskId": driver,
                    "stateTransitions": [{"state": "FINISHED", "timestamp": stamp(t)}],
                    "jobId": jid,
                    "taskAttempt": 0,
                    "nodeId": "",
                    "workerId": "",
                    "workerPid": 0,
                },
            ),
            self._event(
                "DRIVER_JOB_LIFECYCLE_EVENT",
                "GCS",
                t + 0.003,
                "driverJobLifecycleEvent",
                {
                    "jobId": jid,
                    "stateTransitions": [{"state": "FINISHED", "timestamp": stamp(t + 0.003)}],
                },
            ),
        ]

    # -------------------------------------------------------------- tasks

    def task(
        self,
        job: int,
        name: str,
        start: float,
        duration: float,
        *,
        func: str | None = None,
        failed: bool = False,
        attempt: int = 0,
        task_id: bytes | None = None,
        actor: bytes | None = None,
        parent: bytes | None = None,
    ) -> Task:
        tid = task_id or (self._id(8) + b"\xff" * 12 + job_bytes(job))
        return Task(
            tid,
            attempt,
            job,
            name,
            func or name.split("-")[0],
            start,
            start + duration,
            failed,
            actor,
            parent,
        )

    def definition(self, t: Task) -> dict[str, Any]:
        jid = b64(job_bytes(t.job))
        parent = b64(t.parent or b"\xff" * 20 + job_bytes(t.job))
        created = t.start - 0.02
        if t.actor is not None:
            cls, _, fn = t.func.rpartition(".")
            return self._event(
                "ACTOR_TASK_DEFINITION_EVENT",
                "CORE_WORKER",
                created,
                "actorTaskDefinitionEvent",
                {
                    "taskId": b64(t.task_id),
                    "actorFunc": {
                        "pythonFunctionDescriptor": {
                            "moduleName": "job",
                            "className": cls,
                            "functionName": fn,
                            "functionHash": "",
                        }
                    },
                    "actorTaskName": t.name,
                    "requiredResources": {"CPU": 1.0},
                    "jobId": jid,
                    "actorId": b64(t.actor),
                    "parentTaskId": parent,
                    "placementGroupId": b64(b"\xff" * 18),
                    "serializedRuntimeEnv": "{}",
                    "taskAttempt": t.attempt,
                    "language": "PYTHON",
                    "refIds": {},
                    "labelSelector": {},
                    "isDetachedActor": False,
                },
            )
        return self._event(
            "TASK_DEFINITION_EVENT",
            "CORE_WORKER",
            created,
            "taskDefinitionEvent",
            {
                "taskId": b64(t.task_id),
                "taskFunc": {
                    "pythonFunctionDescriptor": {
                        "moduleName": "job",
                        "functionName": t.func,
                        "functionHash": "ed36c6959b604314a55e49d737f210f5",
                        "className": "",
                    }
                },
                "taskName": t.name,
                "requiredResources": {"CPU": 1.0},
                "jobId": jid,
                "parentTaskId": parent,
                "placementGroupId": b64(b"\xff" * 18),
                "serializedRuntimeEnv": "{}",
                "taskAttempt": t.attempt,
                "taskType": "NORMAL_TASK",
                "language": "PYTHON",
                "refIds": {},
                "labelSelector": {},
                "isDetachedActor": False,
            },
        )

    def worker_of(self, t: Task) -> int:
        return t.task_id[0] % self.workers

    def submitter(self, t: Task) -> dict[str, Any]:
        """The owner's lifecycle event: pending, submitted, then the end."""
        w = self.worker_of(t)
        created = t.start - 0.02
        states = [
            {"state": "PENDING_ARGS_AVAIL", "timestamp": stamp(created)},
            {"state": "PENDING_NODE_ASSIGNMENT", "timestamp": stamp(created + 0.001)},
            {"state": "SUBMITTED_TO_WORKER", "timestamp": stamp(t.start - 0.0005)},
            {"state": "FAILED" if t.failed else "FINISHED", "timestamp": stamp(t.stop)},
        ]
        payload: dict[str, Any] = {
            "taskId": b64(t.task_id),
            "stateTransitions": states,
            "nodeId": b64(self.node),
            "workerId": b64(self.worker_ids[w]),
            "jobId": b64(job_bytes(t.job)),
            "taskAttempt": t.attempt,
            "workerPid": 0,
        }
        if t.failed:
            payload["rayErrorInfo"] = {
                "errorMessage": f"User exception:\n\x1b[36mray::{t.name}()\x1b[39m "
                f"(pid={self.pids[w]}, ip={self.ip})\n"
                f'  File "/home/user/job.py", line 12, in {t.func}\n'
                f'    raise ValueError("boom")\nValueError: boom from {t.name}',
                "errorType": "TASK_EXECUTION_EXCEPTION",
            }
        return self._event(
            "TASK_LIFECYCLE_EVENT", "CORE_WORKER", t.stop, "taskLifecycleEvent", payload
        )

    def running(self, t: Task) -> dict[str, Any]:
        """The executing worker's lifecycle event: RUNNING, with its pid."""
        w = self.worker_of(t)
        worker_id = self.worker_ids[w].hex()
        log = f"/tmp/ray/{self.session}/logs/worker-{worker_id}-ffffffff-{self.pids[w]}"
        return self._event(
            "TASK_LIFECYCLE_EVENT",
            "CORE_WORKER",
            t.start,
            "taskLifecycleEvent",
            {
                "taskId": b64(t.task_id),
                "stateTransitions": [{"state": "RUNNING", "timestamp": stamp(t.start)}],
                "workerPid": self.pids[w],
                "jobId": b64(job_bytes(t.job)),
                "taskLogInfo": {
                    "stdoutFile": log + ".out",
                    "stderrFile": log + ".err",
                    "stdoutStart": "1326",
                    "stdoutEnd": "1326",
                    "stderrStart": "1326",
                    "stderrEnd": "1326",
                },
                "taskAttempt": t.attempt,
                "nodeId": "",
                "workerId": "",
            },
        )

    def task_events(self, t: Task) -> list[dict[str, Any]]:
        return [self.definition(t), self.running(t), self.submitter(t)]

    def job(
        self,
        job: int,
        n: int,
        t0: float,
        *,
        fail_every: int = 0,
        duration: float = 0.01,
        entrypoint: str = "python job.py",
        finish: bool = True,
    ) -> tuple[list[Task], list[dict[str, Any]]]:
        """A whole job: its start, ``n`` tasks spread over the workers, its end."""
        tasks = []
        events = self.job_start(job, t0, entrypoint)
        for i in range(n):
            start = t0 + 0.05 + (i // self.workers) * duration
            t = self.task(
                job,
                f"work-{i}",
                start,
                duration * 0.9,
                func="work",
                failed=bool(fail_every) and i % fail_every == fail_every - 1,
            )
            tasks.append(t)
            events += self.task_events(t)
        if finish:
            end = max((t.stop for t in tasks), default=t0) + 0.01
            events += self.job_end(job, end)
        return tasks, events


def bodies(events: list[dict[str, Any]], size: int = 1000) -> list[bytes]:
    """Events cut into exporter bodies (JSON arrays, as aiohttp's ``json=`` writes them)."""
    return [json.dumps(events[i : i + size]).encode() for i in range(0, len(events), size)]


# ------------------------------------------------------------------ a real local Ray node


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def exporter_env(
    export_url: str | None,
    report_ms: int | None = 100,
    publish_s: float | None = 1.0,
    proto_names: bool = True,
) -> dict[str, str]:
    """The variables docs/ray.md asks for on a node (``ray start``), which its workers and
    its aggregator agent inherit (none: export off). ``report_ms``: how often workers
    report task events (100 ms, not Ray's default second: Ray force-kills a job's workers
    when the job ends, and what they had not reported goes with them; None keeps Ray's
    default). ``publish_s``: how often the agent POSTs what it gathered (Ray's default 0.1
    s; None keeps it): a second, the agent's JSON and the collector's per-body work for ten
    POSTs done once. ``proto_names``: the agent writes the events' field names as in the
    .proto (snake_case) rather than converting them to camelCase, which is most of its JSON
    work; Hindsight reads both spellings."""
    if export_url is None:
        return {}
    env = {
        "RAY_enable_ray_event": "1",
        "RAY_enable_core_worker_ray_event_to_aggregator": "1",
        "RAY_DASHBOARD_AGGREGATOR_AGENT_EVENTS_EXPORT_ADDR": export_url,
    }
    if report_ms is not None:
        env["RAY_task_events_report_interval_ms"] = str(report_ms)
    if publish_s is not None:
        env["RAY_DASHBOARD_AGGREGATOR_AGENT_PUBLISHER_MAX_BUFFER_SEND_INTERVAL_SECONDS"] = str(
            publish_s
        )
    if proto_names:
        env["RAY_DASHBOARD_AGGREGATOR_AGENT_PRESERVE_PROTO_FIELD_NAME"] = "1"
    return env


class RayHead:
    """``ray start --head`` on 127.0.0.1 in a throwaway HOME and temp dir, its own process
    session (stopped by killing that group: ``ray stop`` would stop every Ray on the
    machine), and drivers run against it."""

    def __init__(
        self,
        export_url: str | None,
        *,
        dashboard: bool = False,
        cpus: int = 2,
        report_ms: int | None = 100,
        publish_s: float | None = 1.0,
        proto_names: bool = True,
        env: dict[str, str] | None = None,
        driver_env: dict[str, str] | None = None,
    ) -> None:
        """``env``: more variables for the node and its drivers; ``driver_env``: for the
        drivers only (an empty value unsets the variable there)."""
        # Short: Ray puts unix sockets under the temp dir (107-byte path limit).
        self.root = Path(tempfile.mkdtemp(prefix="hsray", dir="/tmp"))
        self.bin = Path(sys.executable).parent
        self.gcs_port = _free_port()
        self.dashboard_port = _free_port() if dashboard else None
        self.dashboard = f"http://127.0.0.1:{self.dashboard_port}" if dashboard else None
        self.cpus = cpus
        self.env = {
            **os.environ,
            "HOME": str(self.root / "home"),
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # stay on loopback
            "RAY_AUTH_MODE": "disabled",
            "RAY_USAGE_STATS_ENABLED": "0",
            "PYTHONWARNINGS": "ignore",
            **exporter_env(export_url, report_ms, publish_s, proto_names),
            **(env or {}),
        }
        self.driver_env = driver_env or {}
        (self.root / "home").mkdir()
        self.proc: Any = None

    def start(self, timeout: float = 180) -> None:
        args = [
            str(self.bin / "ray"),
            "start",
            "--head",
            "--block",
            "--node-ip-address=127.0.0.1",
            f"--port={self.gcs_port}",
            f"--temp-dir={self.root / 'ray'}",
            f"--num-cpus={self.cpus}",
            "--disable-usage-stats",
            f"--dashboard-agent-listen-port={_free_port()}",
            f"--ray-client-server-port={_free_port()}",
        ]
        if self.dashboard_port:
            args += [
                "--include-dashboard=true",
                "--dashboard-host=127.0.0.1",
                f"--dashboard-port={self.dashboard_port}",
            ]
        else:
            args += ["--include-dashboard=false"]
        with open(self.root / "ray-start.log", "wb") as log:
            self.proc = subprocess.Popen(
                args, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + timeout
        while not self._up():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the Ray head did not come up:\n{self.log_tail()}")
            time.sleep(0.2)

    def _up(self) -> bool:
        if self.dashboard:
            try:
                with urllib.request.urlopen(f"{self.dashboard}/api/version", timeout=2) as r:
                    return r.status == 200
            except OSError:
                return False
        # Without a dashboard: up once a driver can connect (``ray status`` asks the GCS).
        out = subprocess.run(
            [str(self.bin / "ray"), "status", f"--address=127.0.0.1:{self.gcs_port}"],
            env=self.env,
            capture_output=True,
            timeout=60,
        )
        return out.returncode == 0

    def log_tail(self) -> str:
        return (self.root / "ray-start.log").read_text(errors="replace")[-3000:]

    def driver(self, script: str, *args: str, timeout: float = 300) -> Any:
        """Run a driver script against the node; its last output line is JSON."""
        env = {**self.env, **self.driver_env, "RAY_ADDRESS": f"127.0.0.1:{self.gcs_port}"}
        env = {k: v for k, v in env.items() if v != ""}
        out = subprocess.run(
            [sys.executable, script, *args],
            env=env,
            capture_output=True,
            timeout=timeout,
            text=True,
            cwd=self.root,
        )
        if out.returncode != 0:
            raise RuntimeError(f"{script} failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
        return json.loads(out.stdout.strip().splitlines()[-1])

    def pids(self) -> list[int]:
        """Every process of this node (its session)."""
        if self.proc is None:
            return []
        out = []
        for d in Path("/proc").iterdir():
            if d.name.isdigit():
                try:
                    fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                if int(fields[3]) == self.proc.pid:  # field 6, the session id
                    out.append(int(d.name))
        return out

    def stop(self) -> None:
        if self.proc is not None:
            group = self.proc.pid  # its own session: every Ray process of this node
            for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
                try:
                    os.killpg(group, sig)
                except ProcessLookupError:
                    break
                try:
                    self.proc.wait(wait)
                    os.killpg(group, signal.SIGKILL)  # stragglers of the group, if any
                except (subprocess.TimeoutExpired, ProcessLookupError):
                    continue
                break
            self.proc = None
        shutil.rmtree(self.root, ignore_errors=True)


#: A loopback HTTP server that answers every POST 200 and keeps nothing: what Ray's
#: exporter costs Ray with a receiver that costs nothing.
_NULL_SINK = """
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

class Sink(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as aiohttp's session uses it

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args):
        pass

server = ThreadingHTTPServer(("127.0.0.1", 0), Sink)
print(server.server_address[1], flush=True)
server.serve_forever()
"""


class NullSink:
    """:data:`_NULL_SINK` in its own process; ``url`` once started."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _NULL_SINK], stdout=subprocess.PIPE, start_new_session=True
        )
        assert self.proc.stdout is not None
        self.url = f"http://127.0.0.1:{int(self.proc.stdout.readline())}/"

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()
