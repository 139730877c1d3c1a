"""Hindsight client SDK: the wire schema, senders, and (in hindsight.dask) the Dask agent.

Importing this package never imports flask, sqlalchemy, boto3 or psycopg: it is installed
into every Dask worker.
"""

from __future__ import annotations

__version__ = "0.1.0"
