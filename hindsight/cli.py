"""The ``hindsight`` command.

The SDK's own commands are defined here; the server's admin commands (serve, db, tokens,
reindex, retention) live with the server (``services/admin.py``) and are found through
the ``hindsight.commands`` entry points, loaded only when one is run. So this package, which
every Dask worker installs, imports nothing server-side, and a worker without the server
extra gets a clear message instead of an ImportError.
"""

from __future__ import annotations

import json
import os
import sys
from importlib.metadata import EntryPoint, entry_points
from typing import Any

import click

ENTRY_POINT_GROUP = "hindsight.commands"


class _Unavailable(click.Command):
    """A server command whose packages are not installed here."""

    def __init__(self, name: str, reason: str) -> None:
        super().__init__(name, help=f"(not installed here: {reason})", add_help_option=False)
        self.reason = reason

    def invoke(self, ctx: click.Context) -> None:
        raise click.ClickException(
            f"`hindsight {self.name}` is a server command and needs the server packages "
            f"({self.reason}): pip install 'hindsight[server]'"
        )


class _Commands(click.Group):
    """A group that adds the commands other installed packages declare, lazily."""

    def _entry_points(self) -> dict[str, EntryPoint]:
        return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *self._entry_points()})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        command = super().get_command(ctx, cmd_name)
        if command is not None:
            return command
        ep = self._entry_points().get(cmd_name)
        if ep is None:
            return None
        try:
            return ep.load()
        except ImportError as exc:
            return _Unavailable(cmd_name, f"{exc.name or exc} is missing")


@click.group(cls=_Commands)
@click.version_option(package_name="hindsight")
def main() -> None:
    """Hindsight: keep the history of every run of every Dask cluster."""


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
    running is left alone.  Exit status: 0 everything was delivered (or no spool was ever
    written at the default place); 1 some batches were corrupted or refused and are lost;
    2 a wrong argument (DIRECTORY, or HINDSIGHT_SPOOL_DIR, is not a directory); 75 some are
    still on disk (run it again).
    """
    import time

    from hindsight.agent.adopt import deliver, read_meta, spool_directories, spooled, try_lock
    from hindsight.agent.transport import Transport
    from hindsight.config import load_settings

    if url and not url.startswith(("http://", "https://")):  # settings would drop it quietly
        raise click.UsageError(f"--url must start with http:// or https://, not {url!r}")
    settings = load_settings({"url": url, "token": token})
    if not settings.url:
        raise click.UsageError("give --url or set HINDSIGHT_URL")
    root = directory or settings.spool_dir
    if directory is None and not os.environ.get("HINDSIGHT_SPOOL_DIR") and not os.path.exists(root):
        # No agent ever spooled here: nothing to push, not a failure (exit 1 says batches
        # were lost).
        click.echo(f"{root}: no spool here, nothing to push")
        return
    if not os.path.isdir(root):
        raise click.UsageError(f"{root} is not a directory")
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
                    line += (
                        f"; {done.corrupt_files} corrupted files skipped"
                        f" ({done.corrupt_events} events)"
                    )
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


@main.group()
def alerts() -> None:
    """Alert rules and their deliveries, over the query service's REST API (docs/alerts.md).
    URL and token from --url/--token or HINDSIGHT_QUERY_URL (then HINDSIGHT_URL) and
    HINDSIGHT_TOKEN."""


def _client(url: str | None, token: str | None) -> Any:
    from hindsight.client import Client

    # `hindsight serve` answers both APIs on one address: its collector URL is the query URL
    url = (
        url
        or os.environ.get("HINDSIGHT_QUERY_URL")
        or os.environ.get("HINDSIGHT_URL")
        or "http://127.0.0.1:8700"
    )
    try:
        return Client(url, token or os.environ.get("HINDSIGHT_TOKEN"))
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None


def _calling(fn: Any, *args: Any, **kwargs: Any) -> Any:
    from hindsight.client import HindsightError

    try:
        return fn(*args, **kwargs)
    except HindsightError as exc:
        raise click.ClickException(str(exc)) from None  # "404 not_found: no run ..."


_url = click.option(
    "--url",
    default=None,
    help="Query service URL (else HINDSIGHT_QUERY_URL, then HINDSIGHT_URL, then "
    "http://127.0.0.1:8700).",
)
_token = click.option("--token", default=None, help="Bearer token (else HINDSIGHT_TOKEN).")


@alerts.command("add")
@click.argument("name")
@click.option("--webhook", required=True, help="The http(s) URL alerts are posted to.")
@click.option("--job", default=None, help="Runs of this name (a trailing * matches a prefix).")
@click.option("--cluster", default=None, help="Runs of this cluster.")
@click.option(
    "--min-change",
    type=float,
    default=0.2,
    show_default=True,
    help="Alert on a run judged slower by at least this much (0.2: 20%).",
)
@click.option("--no-slower", is_flag=True, help="Do not alert on slower runs.")
@click.option("--failures", is_flag=True, help="Alert on runs with failed tasks.")
@click.option("--format", "fmt", type=click.Choice(["json", "slack"]), default="json")
@_url
@_token
def alerts_add(
    name: str,
    webhook: str,
    job: str | None,
    cluster: str | None,
    min_change: float,
    no_slower: bool,
    failures: bool,
    fmt: str,
    url: str | None,
    token: str | None,
) -> None:
    """Make an alert rule; prints it as JSON, with the signing secret (shown this once)."""
    spec = {
        "job": job,
        "cluster": cluster,
        "min_change": min_change,
        "on_slower": not no_slower,
        "on_failures": failures,
        "format": fmt,
    }
    spec = {k: v for k, v in spec.items() if v is not None}
    rule = _calling(_client(url, token).add_alert_rule, name, webhook, **spec)
    click.echo(json.dumps(rule, indent=2))


@alerts.command("list")
@_url
@_token
def alerts_list(url: str | None, token: str | None) -> None:
    """The tenant's alert rules, one JSON object a line."""
    for rule in _calling(_client(url, token).alert_rules):
        click.echo(json.dumps(rule))


@alerts.command("rm")
@click.argument("rule_id", type=int)
@_url
@_token
def alerts_rm(rule_id: int, url: str | None, token: str | None) -> None:
    """Remove an alert rule and its deliveries."""
    _calling(_client(url, token).remove_alert_rule, rule_id)
    click.echo(f"removed rule {rule_id}")


@alerts.command("deliveries")
@click.option("--rule", type=int, default=None)
@click.option("--run", default=None)
@click.option("--status", type=click.Choice(["pending", "delivered", "failed"]), default=None)
@click.option("--limit", type=int, default=20, show_default=True)
@_url
@_token
def alerts_deliveries(
    rule: int | None,
    run: str | None,
    status: str | None,
    limit: int,
    url: str | None,
    token: str | None,
) -> None:
    """Alerts posted or being retried, newest first: id, rule, run, status, attempts, last
    answer."""
    client = _client(url, token)
    rows = _calling(client.alert_deliveries, rule=rule, run=run, status=status, limit=limit)
    click.echo("id\trule\trun\tstatus\tattempts\tlast")
    for d in rows:
        last = d["last_status"] or d["last_error"] or "-"
        click.echo(
            f"{d['id']}\t{d['rule']['name']}\t{d['run']}\t{d['status']}\t{d['attempts']}\t{last}"
        )


@main.command("explain")
@click.argument("run")
@_url
@click.option("--token", default=None, help="Bearer token with read (else HINDSIGHT_TOKEN).")
@click.option("--baseline", default=None, help="Compare with this run, not the job's usual.")
@click.option("--json", "as_json", is_flag=True, help="Print the answer as JSON.")
def explain(
    run: str, url: str | None, token: str | None, baseline: str | None, as_json: bool
) -> None:
    """Why RUN was slower or faster than its job's usual runs (docs/explain.md)."""
    out = _calling(_client(url, token).explain, run, baseline=baseline)
    click.echo(json.dumps(out, indent=2) if as_json else str(out))


if __name__ == "__main__":
    main()
