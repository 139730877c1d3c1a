"""Hindsight client SDK: the wire schema, senders, and (in hindsight.dask) the Dask agent.

Importing this package never imports flask, sqlalchemy, boto3 or psycopg: it is installed
into every Dask worker.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"


def emit(stream: str, value: Any = None) -> bool:
    """Record ``value`` on a custom stream from inside a Dask task (see hindsight.streams).

    Returns False (and does nothing) where no Hindsight worker agent runs.
    """
    from hindsight.streams import emit as _emit

    return _emit(stream, value)


def __getattr__(name: str) -> Any:
    # hindsight.Client is imported on first use: the agent in workers never loads it.
    if name == "Client":
        from hindsight.client import Client

        return Client
    raise AttributeError(f"module 'hindsight' has no attribute {name!r}")
