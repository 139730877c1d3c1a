"""Ray's own State API for one job: ``python state_tasks.py DASHBOARD_URL JOB_ID``
prints every task attempt ``ray.util.state.list_tasks`` knows, as JSON."""

import json
import sys

from ray.util.state import list_tasks

fields = (
    "task_id",
    "attempt_number",
    "name",
    "func_or_class_name",
    "state",
    "type",
    "start_time_ms",
    "end_time_ms",
    "error_type",
    "parent_task_id",
    "actor_id",
    "worker_pid",
    "node_id",
    "job_id",
)
tasks = list_tasks(
    address=sys.argv[1],
    filters=[("job_id", "=", sys.argv[2])],
    detail=True,
    limit=10_000,
    raise_on_missing_output=False,
)
print(json.dumps([{f: getattr(t, f, None) for f in fields} for t in tasks]))
