"""Overload at scale (slow): bench/flood.py measures the collector's capacity, floods it at
twice that for five minutes, and fails unless every answer was 202/429/503 and memory did
not grow. The fast check of the in-flight bound is in test_operations.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent


@pytest.mark.slow
def test_flood_at_twice_capacity_for_five_minutes_keeps_memory_bounded():
    proc = subprocess.run(
        [sys.executable, "-m", "bench.flood", "--duration", "300"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
