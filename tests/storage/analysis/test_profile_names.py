"""Functions a script defines reach the workers by value (cloudpickle), their file renamed
``<dynamic-code>``: a profile names them by the file the run's submitting code holds them
in, at the line they start, not ``<dynamic-code>:36``."""

from __future__ import annotations

from storage.analysis import flame
from storage.analysis.profile import DYNAMIC_FILE, Profile, add_flat, name_dynamic_frames

SCRIPT = """import time

import dask


def parse(i):
    return i


class Enricher:
    def enrich(self, x):
        return x * 2


async def call_api(x):
    time.sleep(1)
    return x
"""


def test_frames_shipped_by_value_are_named_by_the_submitting_script():
    p = Profile()
    frames = [
        ("call_api", DYNAMIC_FILE, 15, 16, "time.sleep(1)"),
        ("parse", DYNAMIC_FILE, 6, 7, "return i"),
        ("enrich", DYNAMIC_FILE, 11, 12, "return x * 2"),  # a method: its own def's line
        ("parse", DYNAMIC_FILE, 40, 41, ""),  # another function of that name, elsewhere
        ("sleep", "time.py", 1, 1, ""),
    ]
    assert add_flat(p, frames, [(-1, 0, 5), (0, 4, 5), (-1, 1, 2), (-1, 2, 1), (-1, 3, 1)])
    named = name_dynamic_frames(p, [("/home/me/pipeline.py", SCRIPT, 1)])
    assert named == 3
    where = {flame.where(f, first) for _n, f, first in p.keys.values()}
    assert where == {
        "/home/me/pipeline.py:15",
        "/home/me/pipeline.py:6",
        "/home/me/pipeline.py:11",
        f"{DYNAMIC_FILE}:40",
        "time.py:1",
    }
    assert p.samples == 9  # nothing lost or merged away


def test_code_captured_from_inside_a_function_counts_from_its_first_line():
    p = Profile()
    add_flat(p, [("inner", DYNAMIC_FILE, 103, 104, "")], [(-1, 0, 1)])
    body = "def main():\n    def inner():\n        pass\n"
    assert name_dynamic_frames(p, [("job.py", body, 102)]) == 1
    assert p.keys[0] == ("inner", "job.py", 103)
