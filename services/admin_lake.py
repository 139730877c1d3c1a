"""``hindsight lake``: the history lake's Iceberg catalog for other engines, and moving a
lake of the earlier format into it (docs/lake.md)."""

from __future__ import annotations

import json
import sys

import click

from hindsight import lake as layout
from services.admin import _index
from storage.core.blobs import blob_store_for
from storage.core.db import make_sessionmaker
from storage.lake import write
from storage.lake.migrate import migrate as do_migrate


@click.group()
def lake() -> None:
    """The history lake: Apache Iceberg tables any engine reads."""


@lake.command("catalog")
@click.option("--data-dir", type=click.Path(file_okay=False))
def catalog(data_dir: str | None) -> None:
    """Print the lake's Iceberg catalog as one JSON object: name, namespace, type, uri,
    warehouse and the S3 endpoint settings where used; never a secret (the database
    password comes from PGPASSWORD or ~/.pgpass, S3 credentials from the usual AWS
    variables). ``pyiceberg.catalog.load_catalog(props.pop("name"), **props)`` opens it."""
    with _index(data_dir, existing="index") as (settings, _engine):
        loc = write.location_from_settings(settings)
        write.catalog(loc)  # the namespace and tables exist before anyone looks
        props = {"name": loc.name, "namespace": layout.NAMESPACE, **loc.properties(secrets=False)}
    click.echo(json.dumps(props))


@lake.command("migrate")
@click.option("--data-dir", type=click.Path(file_okay=False))
@click.option("--keep", is_flag=True, help="Keep the old lake's files after moving them.")
def migrate(data_dir: str | None, keep: bool) -> None:
    """Move a lake of the earlier format (lake/v1/ with JSON manifests) into the Iceberg
    tables, partition by partition, checking every row count before the old files go.
    Safe to run again."""
    with _index(data_dir, existing="blobs") as (settings, engine):
        blobs = blob_store_for(settings)

        def progress(part: str, rows: dict[str, int]) -> None:
            click.echo(f"  {part}: " + ", ".join(f"{n} {t}" for t, n in rows.items()), err=True)

        counts = do_migrate(blobs, make_sessionmaker(engine), keep=keep, on_partition=progress)
    click.echo(
        f"{counts['partitions']} partitions moved: "
        + ", ".join(f"{counts[t]} {t} rows" for t in layout.TABLES)
    )
    sys.stdout.flush()
