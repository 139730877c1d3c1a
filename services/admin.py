"""The server's admin commands of ``hindsight``: serve, db, tokens, reindex, retention.

They live with the server, not in the SDK (``hindsight/``, installed into every Dask
worker): ``hindsight.cli`` finds them through the ``hindsight.commands`` entry points
declared in pyproject.toml and loads one only when it is run.
"""

from __future__ import annotations

import contextlib
import gc
import ipaddress
import os
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import click
from sqlalchemy import Engine, func, select

from hindsight.schema import valid_name
from storage.core.blobs import blob_store_for
from storage.core.config import ConfigError, Settings, load_settings
from storage.core.db import current_revision, make_engine, make_sessionmaker
from storage.core.db import upgrade as do_upgrade
from storage.core.models import Tenant, Token
from storage.core.tokens import create_token, list_tokens, revoke_token
from storage.jobs import finish
from storage.jobs.reindex import move_detail
from storage.jobs.reindex import reindex as do_reindex
from storage.jobs.retention import apply


def _settings(**overrides: object) -> Settings:
    try:
        return load_settings({k: v for k, v in overrides.items() if v is not None})
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None


@contextlib.contextmanager
def _index(
    data_dir: str | None, *, upgrade: bool | None = True, existing: str = ""
) -> Iterator[tuple[Settings, Engine]]:
    """(settings, engine) for a command, the index migrated to head first (``upgrade=None``:
    as ``HINDSIGHT_AUTO_UPGRADE`` says). ``existing`` ("index", "blobs" or both): the
    command reads what a server wrote, so a local index or blob directory that is not
    there is a mistyped ``--data-dir`` (or the wrong working directory), not a new, empty
    one (it was created, and the command reported an empty success)."""
    settings = _settings(data_dir=data_dir)
    if existing:
        _must_exist(settings, existing)
    engine = make_engine(settings.database_url)
    try:
        if upgrade or (upgrade is None and settings.auto_upgrade):
            do_upgrade(engine)
        yield settings, engine
    finally:
        engine.dispose()


def _must_exist(settings: Settings, which: str) -> None:
    from urllib.parse import urlparse

    from sqlalchemy.engine import make_url

    url = make_url(settings.database_url)
    where = []
    if (
        "index" in which
        and url.get_backend_name() == "sqlite"
        and url.database not in (None, "", ":memory:")
    ):
        where.append(Path(url.database))
    if "blobs" in which and settings.blob_url.startswith("file://"):
        where.append(Path(urlparse(settings.blob_url).path))
    missing = [str(p) for p in where if not p.exists()]
    if missing:
        raise click.ClickException(
            f"nothing at {', '.join(missing)}: give the server's --data-dir "
            "(or HINDSIGHT_DATA_DIR, HINDSIGHT_DATABASE_URL, HINDSIGHT_BLOB_URL)"
        )


def _local_index(settings: Settings) -> Path | None:
    """The SQLite file of a local index (None for a server's database)."""
    from sqlalchemy.engine import make_url

    url = make_url(settings.database_url)
    if url.get_backend_name() != "sqlite" or url.database in (None, "", ":memory:"):
        return None
    return Path(url.database).resolve()


def _token_count(engine: Engine) -> int:
    with engine.connect() as conn:
        return conn.execute(select(func.count()).select_from(Token)).scalar() or 0


def _is_loopback(host: str) -> bool:
    try:
        infos = socket.getaddrinfo(host, None)
    except socket.gaierror:
        return False
    return all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)


@click.command()
@click.option(
    "--data-dir", type=click.Path(file_okay=False), help="Where the SQLite index and blobs live."
)
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8700, show_default=True, type=click.IntRange(0, 65535))
def serve(data_dir: str | None, host: str, port: int) -> None:
    """Run collector and query service in one process (embedded mode)."""
    # The web stack is loaded only to serve, not for every admin command.
    from werkzeug.serving import WSGIRequestHandler, make_server

    from services.embedded import create_app

    try:
        socket.getaddrinfo(host, None)
    except socket.gaierror as exc:  # it read as "no tokens exist" on a fresh data dir
        raise click.ClickException(f"cannot serve on {host}: {exc.strerror}") from None
    loopback = _is_loopback(host)
    auth = os.environ.get("HINDSIGHT_AUTH") or ("disabled" if loopback else "required")
    if not loopback and auth != "required":
        raise click.ClickException(
            f"refusing to serve on {host} without auth: unset HINDSIGHT_AUTH=disabled"
        )
    settings = _settings(data_dir=data_dir, auth=auth)
    app = create_app(settings=settings)
    if _local_index(settings) is not None:
        # Its own local index: no other process works its finish jobs, so a claim in it is
        # a previous run's of this server (killed mid-job): free it now, not at its lease's
        # end (a server killed with kill -9 while a run was being finished).
        finish.release_claims(app.extensions["hindsight"].sessions)
    if auth == "required":
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

    class Handler(WSGIRequestHandler):
        # each read of a connection waits at most this long: a body shorter than its
        # Content-Length is answered 408 (collector.body.read_body), an idle connection closed
        timeout = settings.body_timeout

    server = make_server(host, port, app, threaded=True, request_handler=Handler)
    gc.collect()
    # long-lived start-up objects out of the collector's reach (services/gunicorn_conf.py)
    gc.freeze()
    url = f"http://{host if ':' not in host else f'[{host}]'}:{server.port}"
    click.echo(f"Hindsight embedded server (collector + query) on {url}")
    click.echo(f"  data:       {settings.data_dir}")
    click.echo(f"  index:      {settings.database_url}")
    click.echo(f"  blob store: {settings.blob_url}")
    click.echo(f"  workers:    HINDSIGHT_URL={url}   (the collector: POST {url}/v1/batches)")
    click.echo(f"  dashboard:  {url}/")
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


@click.group()
def db() -> None:
    """Index database commands."""


@db.command()
@click.option("--data-dir", type=click.Path(file_okay=False))
def upgrade(data_dir: str | None) -> None:
    """Apply the index migrations (services also do this on start)."""
    with _index(data_dir) as (_, engine):
        click.echo(f"index at revision {current_revision(engine)}")


@click.group()
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
@click.option(
    "--url",
    default="http://127.0.0.1:8700",
    show_default=True,
    help="With --for ray: the collector's URL as Ray's nodes reach it.",
)
@click.option(
    "--cluster",
    default="ray",
    show_default=True,
    help="With --for ray: the cluster name the runs are filed under.",
)
@click.option("--name", default=None, help="A label to recognise the token by.")
@click.option("--data-dir", type=click.Path(file_okay=False))
def tokens_create(
    tenant: str,
    scopes: str | None,
    for_: str | None,
    url: str,
    cluster: str,
    name: str | None,
    data_dir: str | None,
) -> None:
    """Create a token and print it (it is stored hashed and cannot be shown again). With
    ``--for ray``, print the URL to give Ray's event exporter instead (docs/ray.md)."""
    if for_ == "ray" and scopes not in (None, "ray"):
        raise click.UsageError("--for ray makes a token with the ray scope only")
    if for_ == "ray" and not valid_name(cluster):
        raise click.UsageError(f"invalid cluster name {cluster!r}")
    scopes = scopes or ("ray" if for_ == "ray" else "ingest,read")
    local = _local_index(_settings(data_dir=data_dir))
    existed = local is not None and local.exists()
    with _index(data_dir, upgrade=None) as (settings, engine):
        first = local is not None and _token_count(engine) == 0
        try:
            with make_sessionmaker(engine).begin() as session:
                token = create_token(session, tenant, scopes, name)
        except ValueError as exc:
            raise click.ClickException(str(exc)) from None
    elsewhere = "a server with another HINDSIGHT_DATABASE_URL or --data-dir does not know it"
    if local is not None and not existed:
        # An operator's shell without the service's variables: the services would answer
        # 401 to the token.
        click.echo(f"note: created a new index at {local} for this token; {elsewhere}", err=True)
    elif first:
        # The first token of an embedded server that recorded without auth: with auth
        # on, its earlier runs are the tenant default's.
        other = (
            f"; runs recorded without auth belong to tenant 'default', not to {tenant!r}"
            if tenant != "default"
            else ""
        )
        click.echo(f"note: the first token of the index at {local}{other}; {elsewhere}", err=True)
    if for_ == "ray":
        click.echo(f"{url.rstrip('/')}/v1/ray/events?cluster={cluster}&token={token}")
    else:
        click.echo(token)


@tokens.command("list")
@click.option("--tenant", default=None, help="Only this tenant's tokens.")
@click.option("--data-dir", type=click.Path(file_okay=False))
def tokens_list(tenant: str | None, data_dir: str | None) -> None:
    """List tokens: id, tenant, scopes, name, created, revoked, and the first 8 hex digits
    of the token's SHA-256 (the token itself is not stored)."""
    with _index(data_dir, upgrade=None, existing="index") as (_, engine):
        with make_sessionmaker(engine).begin() as session:
            rows = list_tokens(session, tenant)
    click.echo("id\ttenant\tscopes\tname\tcreated\trevoked\tsha256")
    for r in rows:
        created, revoked = (
            time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t)) if t else "-"
            for t in (r["created_at"], r["revoked_at"])
        )
        click.echo(
            f"{r['id']}\t{r['tenant']}\t{r['scopes']}\t{r['name'] or '-'}\t{created}"
            f"\t{revoked}\t{r['hash']}"
        )


@tokens.command("revoke")
@click.argument("token_id", type=int, required=False)
@click.option(
    "--token",
    "token",
    default=None,
    help="Revoke this token itself (a leaked one in hand) rather than an id; "
    "'-' reads it from stdin (out of ps and shell history).",
)
@click.option("--data-dir", type=click.Path(file_okay=False))
def tokens_revoke(token_id: int | None, token: str | None, data_dir: str | None) -> None:
    """Revoke a token by its id (``hindsight tokens list``) or by the token itself. Services
    refuse it (401) once their token cache expires (HINDSIGHT_TOKEN_CACHE_SECONDS, 10 s)."""
    if (token_id is None) == (token is None):
        raise click.UsageError("give a token id or --token TOKEN (one of them)")
    if token == "-":
        token = sys.stdin.readline().strip()
    with _index(data_dir, upgrade=None, existing="index") as (_, engine):
        with make_sessionmaker(engine).begin() as session:
            done = revoke_token(session, token_id=token_id, token=token)
    if not done:
        raise click.ClickException("no such token, or it was revoked already")
    click.echo("revoked")


@click.command()
@click.option("--data-dir", type=click.Path(file_okay=False))
@click.option(
    "--skip-finish",
    is_flag=True,
    help="Only index; leave finished-run work (compacted copies...) to the collectors.",
)
@click.option(
    "--detail",
    "detail_only",
    is_flag=True,
    help="Only move finished runs' detail rows (replay samples, profiles) from the index "
    "into their detail objects and pack their histograms and fine metrics: the backfill "
    "after upgrading to revision 0017 or 0018.",
)
def reindex(data_dir: str | None, skip_finish: bool, detail_only: bool) -> None:
    """Rebuild the index from the blob store (idempotent; safe on a live index), then the
    finished-run work of every finished run (compacted copies and the like)."""
    with _index(data_dir, existing="blobs") as (settings, engine):
        blobs = blob_store_for(settings)
        if detail_only:
            counts = move_detail(blobs, make_sessionmaker(engine))
            click.echo(
                f"{counts['runs']} runs' detail moved into objects or packed "
                f"({counts['packed_rows']} rows packed), {counts['pruned']} old versions deleted"
            )
            return
        click.echo(f"listing {settings.blob_url} ...", err=True)
        total = sum(1 for _ in blobs.list("v1/"))
        with click.progressbar(length=total, label="reindexing", file=sys.stderr) as bar:
            sessions = make_sessionmaker(engine)
            counts = do_reindex(
                blobs,
                sessions,
                on_progress=bar.update,
                ray_settle=settings.ray_settle_seconds,
                ray_idle=settings.ray_idle_close_seconds,
            )
        click.echo(
            f"{counts['blobs']} blobs: {counts['indexed']} indexed, {counts['already']} already "
            f"indexed, {counts['skipped']} skipped"
        )
        if counts.get("ray_bodies"):
            click.echo(
                f"{counts['ray_bodies']} Ray exporter bodies: {counts['ray_merged']} merged, "
                f"{counts['ray_already']} already merged, {counts['ray_skipped']} skipped"
            )
        if not skip_finish:
            click.echo("finishing finished runs ...", err=True)
            click.echo(f"{finish.drain(sessions, blobs)} finished runs done")


@click.group()
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
    between is finished by the next run; reindex cannot resurrect what is removed)."""
    if max_age_days is None and max_runs is None:
        raise click.UsageError("give --max-age-days, --max-runs, or both")
    with _index(data_dir, existing="index,blobs") as (settings, engine):
        with make_sessionmaker(engine)() as session:
            known = session.scalar(select(Tenant.id).where(Tenant.name == tenant))
        if known is None:  # a typo in a cron job removed nothing, in silence
            raise click.ClickException(f"no tenant {tenant!r} in this index")
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
