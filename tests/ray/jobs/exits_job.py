"""A driver that exits while its tasks are still running: Ray force-exits their workers
and its State API lists the tasks FAILED when the workers died.

Run as a driver against the test cluster (``RAY_ADDRESS``); prints one JSON line. Each task
writes a file once it runs (under this driver's working directory, which the workers
share on one node); the driver waits for all of them, then until Ray's State API lists
them RUNNING (their workers have reported it: what a worker has not reported when it is
killed is lost), then exits."""

import json
import os
import sys
import time
from pathlib import Path

import ray
from ray.util.state import list_tasks

N = 3


@ray.remote(num_cpus=0)
def hang(flag):
    Path(flag).write_text(str(os.getpid()))
    time.sleep(600)


ray.init()
job = ray.get_runtime_context().get_job_id()
flags = [Path.cwd() / f"running-{job}-{i}" for i in range(N)]
refs = [hang.remote(str(f)) for f in flags]
deadline = time.monotonic() + 120
while not all(f.exists() for f in flags):  # every task is RUNNING in its worker
    if time.monotonic() > deadline:
        sys.exit("the tasks did not start")
    time.sleep(0.05)
while len(list_tasks(filters=[("job_id", "=", job), ("state", "=", "RUNNING")])) < N:
    if time.monotonic() > deadline:
        sys.exit("the tasks' RUNNING was not reported")
    time.sleep(0.05)
print(json.dumps({"job": job, "tasks": N}))
