"""A Ray job with every kind of task: plain, nested, failing, retried, an actor, an actor
killed with calls queued, and functions and a class defined inside others.

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


@ray.remote(max_retries=0)
def multiline():
    raise RuntimeError("line one\nline two\n\nline four")


@ray.remote(max_concurrency=1)
class Slow:
    def ping(self):
        return True

    def wait(self, s):
        time.sleep(s)


def make_inner():
    @ray.remote
    def inner_fn():
        return 1

    return inner_fn


class Outer:
    @ray.remote
    class Inner:
        def m(self):
            return 2


ray.init()
job = ray.get_runtime_context().get_job_id()
assert sum(ray.get([square.remote(i) for i in range(40)])) == sum(i * i for i in range(40))
assert ray.get(fan_out.remote(4)) == 14
failures = 0
for ref in [fail.remote(i) for i in range(3)] + [flaky.remote(), multiline.remote()]:
    try:
        ray.get(ref)
    except Exception:
        failures += 1
counter = Counter.remote()
assert ray.get([counter.incr.remote(k) for k in range(5)])[-1] == 10
assert ray.get(make_inner().remote()) == 1
assert ray.get(Outer.Inner.remote().m.remote()) == 2
slow = Slow.remote()
assert ray.get(slow.ping.remote())
# Pushed to the actor's queue (max_concurrency=1), then the actor dies: the second call
# never runs.
queued = [slow.wait.remote(30), slow.wait.remote(0)]
ray.kill(slow)
for ref in queued:
    try:
        ray.get(ref)
    except ray.exceptions.RayActorError:
        pass
ray.shutdown()
print(json.dumps({"job": job, "failures": failures}))
