"""A Ray job with every kind of task: plain, nested, failing, retried, and an actor.

Run as a driver against the test cluster (``RAY_ADDRESS``); prints one JSON line."""

import json
import time

import ray


@ray.remote
def square(i):
    time.sleep(0.005)
    return i * i


@ray.remote
def fan_out(n):
    return sum(ray.get([square.remote(i) for i in range(n)]))


@ray.remote(max_retries=0)
def fail(i):
    raise ValueError(f"boom {i}")


@ray.remote(max_retries=2, retry_exceptions=True)
def flaky():
    raise RuntimeError("flaky every time")


@ray.remote
class Counter:
    def __init__(self):
        self.n = 0

    def incr(self, k):
        self.n += k
        return self.n


ray.init()
job = ray.get_runtime_context().get_job_id()
assert sum(ray.get([square.remote(i) for i in range(40)])) == sum(i * i for i in range(40))
assert ray.get(fan_out.remote(4)) == 14
failures = 0
for ref in [fail.remote(i) for i in range(3)] + [flaky.remote()]:
    try:
        ray.get(ref)
    except Exception:
        failures += 1
counter = Counter.remote()
assert ray.get([counter.incr.remote(k) for k in range(5)])[-1] == 10
ray.shutdown()
print(json.dumps({"job": job, "failures": failures}))
