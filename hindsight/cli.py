"""The ``hindsight`` command. Server-side commands import the server packages lazily,
so the SDK stays importable in a Dask worker without them."""

from __future__ import annotations

import contextlib
import gc
import ipaddress
import os
import socket
import sys
from collections.abc import Iterator
from typing import Any

import click


def _settings(**overrides: object):  # -> storage.config.Settings
    from storage.config import ConfigError, load_settings

    try:
        return load_settings({k: v for k, v in overrides.items() if v is not None})
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None


@contextlib.contextmanager
def _index(data_dir: str | None, *, upgrade: bool | None = True) -> Iterator[tuple[Any, Any]]:
    """(settings, engine) for a command, the index migrated to head first (``upgrade=None``:
    as ``HINDSIGHT_AUTO_UPGRADE`` says)."""
    from storage.db import make_engine
    from storage.db import upgrade as do_upgrade

    settings = _settings(data_dir=data_dir)
    engine = make_engine(settings.database_url)
    try:
        if upgrade or (upgrade is None and settings.auto_upgrade):
            do_upgrade(engine)
        yield settings, engine
    finally:
        engine.dispose()


def _is_loopback(host: str) -> bool:
    try:
        infos = socket.getaddrinfo(host, None)
    except socket.gaierror:
        return False
    return all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)


@click.group()
@click.version_option(package_name="hindsight")
def main() -> None:
    """Hindsight: keep the history of every run of every Dask cluster."""


@main.command()
@click.option(
    "--data-dir", type=click.Path(file_okay=False), help="Where the SQLite index and blobs live."
)
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8700, show_default=True, type=int)
def serve(data_dir: str | None, host: str, port: int) -> None:
    """Run collector and query service in one process (embedded mode)."""
    from werkzeug.serving import make_server

    from services.embedded import create_app
    from storage.db import make_engine
    from storage.models import Token

    loopback = _is_loopback(host)
    auth = os.environ.get("HINDSIGHT_AUTH") or ("disabled" if loopback else "required")
    if not loopback and auth != "required":
        raise click.ClickException(
            f"refusing to serve on {host} without auth: unset HINDSIGHT_AUTH=disabled"
        )
    settings = _settings(data_dir=data_dir, auth=auth)
    app = create_app(settings=settings)
    if auth == "required":
        from sqlalchemy import func, select

        engine = make_engine(settings.database_url)
        with engine.connect() as conn:
            tokens = conn.execute(select(func.count()).select_from(Token)).scalar_one()
        engine.dispose()
        if not tokens and not loopback:
            raise click.ClickException(
                f"refusing to serve on {host}: no tokens exist. Create one first:\n"
                f"  hindsight tokens create --tenant NAME --scopes ingest,read"
                + (f" --data-dir {data_dir}" if data_dir else "")
            )
    server = make_server(host, port, app, threaded=True)
    gc.collect()
    gc.freeze()  # long-lived start-up objects out of the collector's reach (services/gunicorn_conf.py)
    url = f"http://{host if ':' not in host else f'[{host}]'}:{server.port}"
    click.echo(f"Hindsight embedded server (collector + query) on {url}")
    click.echo(f"  data:       {settings.data_dir}")
    click.echo(f"  index:      {settings.database_url}")
    click.echo(f"  blob store: {settings.blob_url}")
    click.echo(f"  collector:  {url}/v1/batches   (point workers here: HINDSIGHT_URL={url})")
    click.echo(f"  runs:       {url}/v1/runs")
    click.echo(f"  API:        {url}/v1/openapi.json")
    if auth == "disabled":
        click.echo("  auth:       DISABLED (loopback only; every request acts as tenant 'default')")
    else:
        click.echo("  auth:       bearer tokens required (hindsight tokens create ...)")
    sys.stdout.flush()
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


@main.group()
def db() -> None:
    """Index database commands."""


@db.command()
@click.option("--data-dir", type=click.Path(file_okay=False))
def upgrade(data_dir: str | None) -> None:
    """Apply the index migrations (services also do this on start)."""
    from storage.db import current_revision

    with _index(data_dir) as (_, engine):
        click.echo(f"index at revision {current_revision(engine)}")


@main.group()
def tokens() -> None:
    """API token commands."""


@tokens.command("create")
@click.option("--tenant", required=True)
@click.option(
    "--scopes",
    default=None,
    help="Comma-separated: ingest, read, admin, ray.  [default: ingest,read; ray with --for ray]",
)
@click.option(
    "--for",
    "for_",
    type=click.Choice(["ray"]),
    default=None,
    help="ray: a token for Ray's event exporter (scope ray only); prints the export URL.",
)
@click.option("--url", default="http://127.0.0.1:8700", show_default=True,
              help="With --for ray: the collector's URL as Ray's nodes reach it.")  # fmt: skip
@click.option("--cluster", default="ray", show_default=True,
              help="With --for ray: the cluster name the runs are filed under.")  # fmt: skip
@click.option("--name", default=None, help="A label to recognise the token by.")
@click.option("--data-dir", type=click.Path(file_okay=False))
def tokens_create(
    tenant: str, scopes: str | None, for_: str | None, url: str, cluster: str,
    name: str | None, data_dir: str | None,
) -> None:  # fmt: skip
    """Create a token and print it (it is stored hashed and cannot be shown again). With
    ``--for ray``, print the URL to give Ray's event exporter instead (docs/ray.md)."""
    from hindsight.schema import valid_name
    from storage.db import make_sessionmaker
    from storage.tokens import create_token

    if for_ == "ray" and scopes not in (None, "ray"):
        raise click.UsageError("--for ray makes a token with the ray scope only")
    if for_ == "ray" and not valid_name(cluster):
        raise click.UsageError(f"invalid cluster name {cluster!r}")
    scopes = scopes or ("ray" if for_ == "ray" else "ingest,read")
    with _index(data_dir, upgrade=None) as (_, engine):
        try:
            with make_sessionmaker(engine).begin() as session:
                token = create_token(session, tenant, scopes, name)
        except ValueError as exc:
            raise click.ClickException(str(exc)) from None
    if for_ == "ray":
        click.echo(f"{url.rstrip('/')}/v1/ray/events?cluster={cluster}&token={token}")
    else:
        click.echo(token)


@main.command()
@click.option("--data-dir", type=click.Path(file_okay=False))
def reindex(data_dir: str | None) -> None:
    """Rebuild the index from the blob store (idempotent; safe on a live index)."""
    from storage.blobs import blob_store_for
    from storage.db import make_sessionmaker
    from storage.reindex import reindex as do_reindex

    with _index(data_dir) as (settings, engine):
        blobs = blob_store_for(settings)
        click.echo(f"listing {settings.blob_url} ...", err=True)
        total = sum(1 for _ in blobs.list("v1/"))
        with click.progressbar(length=total, label="reindexing", file=sys.stderr) as bar:
            counts = do_reindex(blobs, make_sessionmaker(engine), on_progress=bar.update)
    click.echo(
        f"{counts['blobs']} blobs: {counts['indexed']} indexed, {counts['already']} already indexed, "
        f"{counts['skipped']} skipped"
    )
    if counts.get("ray_bodies"):
        click.echo(
            f"{counts['ray_bodies']} Ray exporter bodies: {counts['ray_merged']} merged, "
            f"{counts['ray_already']} already merged, {counts['ray_skipped']} skipped"
        )


@main.group()
def retention() -> None:
    """Retention: remove old history (blobs and index rows) per tenant."""


@retention.command("apply")
@click.option("--tenant", required=True)
@click.option(
    "--max-age-days",
    type=click.FloatRange(min=0),
    default=None,
    help="Remove sessions nothing arrived for in this many days.",
)
@click.option(
    "--max-runs",
    type=click.IntRange(min=0),
    default=None,
    help="Keep the sessions of the tenant's newest N runs; remove the others.",
)
@click.option("--dry-run", is_flag=True, help="Print what would be removed; change nothing.")
@click.option("--data-dir", type=click.Path(file_okay=False))
def retention_apply(
    tenant: str,
    max_age_days: float | None,
    max_runs: int | None,
    dry_run: bool,
    data_dir: str | None,
) -> None:
    """Remove a tenant's sessions past retention: blobs first, then index rows (a crash in
    between is finished by the next run; reindex cannot resurrect what is removed)."""  # fmt: skip
    from storage.blobs import blob_store_for
    from storage.db import make_sessionmaker
    from storage.retention import apply

    if max_age_days is None and max_runs is None:
        raise click.UsageError("give --max-age-days, --max-runs, or both")
    with _index(data_dir) as (settings, engine):
        done = apply(
            blob_store_for(settings),
            make_sessionmaker(engine),
            tenant,
            max_age=None if max_age_days is None else max_age_days * 86400,
            max_runs=max_runs,
            dry_run=dry_run,
        )
    verb = "would remove" if dry_run else "removed"
    for s in done.sessions:
        click.echo(f"  {s.prefix.rstrip('/')}: {s.runs} runs, {s.batches} batches, {s.bytes} bytes")
    click.echo(
        f"{verb} {len(done.sessions)} sessions of tenant {tenant!r}: {done.runs} runs, "
        f"{done.batches} batches, {done.bytes} bytes"
        + ("" if dry_run else f" ({done.blobs_deleted} blobs deleted)")
    )


@main.group()
def spool() -> None:
    """The agent's on-disk spool: batches that waited for the collector."""


#: `spool push` exit status when batches are still on disk (collector unavailable or a
#: directory in use): try again later (EX_TEMPFAIL).
EXIT_RETRY_LATER = 75


@spool.command("push")
@click.argument("directory", required=False, type=click.Path(file_okay=False))
@click.option("--url", default=None, help="Collector URL (else HINDSIGHT_URL).")
@click.option("--token", default=None, help="Bearer token (else HINDSIGHT_TOKEN).")
@click.option(
    "--timeout",
    type=click.FloatRange(min=0),
    default=60.0,
    show_default=True,
    help="Seconds to keep retrying while the collector is unavailable.",
)
def spool_push(directory: str | None, url: str | None, token: str | None, timeout: float) -> None:
    """Deliver spooled batches by hand, e.g. from a volume kept after a batch job.

    DIRECTORY is a spool root (one sub-directory per agent; default HINDSIGHT_SPOOL_DIR) or
    one agent's directory.  Batches go out byte for byte under their original cluster,
    session, agent and sequence numbers, in order; each is removed once the collector has
    acknowledged it, so running this again is safe.  A directory whose agent is still
    running is left alone.  Exit status: 0 everything was delivered; 1 some batches were
    corrupted or refused and are lost; 75 some are still on disk (run it again).
    """
    import time

    from hindsight.agent.adopt import deliver, read_meta, spool_directories, spooled, try_lock
    from hindsight.agent.transport import Transport
    from hindsight.config import load_settings

    settings = load_settings({"url": url, "token": token})
    if not settings.url:
        raise click.UsageError("give --url or set HINDSIGHT_URL")
    root = directory or settings.spool_dir
    if not os.path.isdir(root):
        raise click.ClickException(f"{root} is not a directory")
    directories = spool_directories(root)
    counts = {path: spooled(path) for path in directories}
    total = sum(n for n, _ in counts.values())
    click.echo(
        f"{root}: {len(directories)} agent directories, {total} batches "
        f"({sum(e for _, e in counts.values())} events) -> {settings.url}"
    )
    deadline = time.monotonic() + timeout
    transport = Transport(settings.url, settings.token, settings.request_timeout)
    sums = dict.fromkeys(("batches", "events", "corrupt", "rejected", "left", "busy"), 0)
    try:
        with click.progressbar(length=total, label="pushing", file=sys.stderr) as bar:
            for path in directories:
                name = os.path.basename(path)
                meta = read_meta(path) or {}
                try:
                    lock = try_lock(path)
                except OSError as exc:
                    click.echo(f"  {name}: cannot lock ({exc}); pushing anyway", err=True)
                    lock = None
                else:
                    if lock is None:
                        click.echo(f"  {name}: in use by a running agent; left alone")
                        sums["busy"] += counts[path][0]
                        bar.update(counts[path][0])
                        continue
                try:
                    done = deliver(path, transport, deadline=deadline, on_batch=bar.update)
                finally:
                    if lock is not None:
                        lock.release()
                recorded = meta.get("collector")
                where = (
                    f" (spooled for {recorded})" if recorded and recorded != settings.url else ""
                )
                line = f"  {name}: {done.batches} batches ({done.events} events) delivered{where}"
                if done.corrupt_files:
                    line += f"; {done.corrupt_files} corrupted files skipped ({done.corrupt_events} events)"
                if done.rejected:
                    line += f"; {done.rejected} refused ({done.rejected_events} events)"
                if done.left:
                    line += f"; {done.left} left on disk: {done.error or 'stopped'}"
                click.echo(line)
                sums["batches"] += done.batches
                sums["events"] += done.events
                sums["corrupt"] += done.corrupt_files
                sums["rejected"] += done.rejected
                sums["left"] += done.left
    finally:
        transport.close()
    click.echo(
        f"delivered {sums['batches']} of {total} batches ({sums['events']} events); "
        f"{sums['corrupt']} corrupted files skipped, {sums['rejected']} refused, "
        f"{sums['left'] + sums['busy']} left on disk"
    )
    if sums["left"] or sums["busy"]:
        sys.exit(EXIT_RETRY_LATER)
    if sums["corrupt"] or sums["rejected"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
