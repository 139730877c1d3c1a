"""The Ray job of bench/ray_overhead.py (a driver script, not a bench): TASKS tasks of
TASK_MS milliseconds of CPU each (some nested, 1% failing), a few actor calls; prints the
wall time from the first submission to the last result.

    python ray_overhead_job.py TASKS TASK_MS"""

import json
import sys
import time

import ray

TASKS = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
TASK_S = float(sys.argv[2]) / 1000 if len(sys.argv) > 2 else 0.02


@ray.remote
def work(i):
    # busy for TASK_S of this thread's CPU time, like real work: on a busy core it takes
    # longer (a wall-clock loop would not, and would hide what else takes the core)
    end = time.thread_time() + TASK_S
    while time.thread_time() < end:
        pass
    if i % 100 == 99:
        raise ValueError(f"boom {i}")
    return i


@ray.remote
def fan_out(n):
    return len(ray.get([work.remote(i * 100) for i in range(n)]))


@ray.remote
class Counter:
    def __init__(self):
        self.n = 0

    def incr(self):
        self.n += 1
        return self.n


ray.init()
job = ray.get_runtime_context().get_job_id()
counter = Counter.remote()
ray.get(counter.incr.remote())  # the actor is up before the clock starts
t0 = time.perf_counter()
refs = [work.remote(i) for i in range(TASKS)] + [fan_out.remote(10) for _ in range(TASKS // 100)]
refs += [counter.incr.remote() for _ in range(TASKS // 20)]
done = 0
for ref in refs:
    try:
        ray.get(ref)
    except ray.exceptions.RayTaskError:
        pass
    done += 1
wall = time.perf_counter() - t0
n = TASKS + TASKS // 100 * 11 + TASKS // 20 + 2  # tasks, fan-outs and theirs, actor calls
ray.shutdown()
print(json.dumps({"job": job, "wall": wall, "tasks": n}))
