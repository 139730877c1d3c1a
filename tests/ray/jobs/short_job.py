"""A short script that exits as soon as its results are in (the exporter pitfall:
without a short RAY_task_events_report_interval_ms its last events are lost)."""

import json

import ray


@ray.remote
def add(a, b):
    return a + b


ray.init()
job = ray.get_runtime_context().get_job_id()
print(json.dumps({"job": job, "total": sum(ray.get([add.remote(i, 1) for i in range(20)]))}))
