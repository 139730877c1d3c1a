"""Flask plumbing shared by the collector and the query service: one error body
everywhere, a database session per request, bearer-token auth, health and OpenAPI."""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Iterable
from typing import Any

from flask import Blueprint, Flask, current_app, g, request
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from sqlalchemy.orm import Session
from werkzeug.exceptions import HTTPException

from services.common import ops
from services.common.errors import ApiError, error_response, unavailable
from services.common.params import only_args
from services.common.store import Store
from storage.core.config import Settings, load_settings
from storage.core.tokens import Principal

logger = logging.getLogger(__name__)


def _wants_a_page() -> bool:
    """A browser asking for a page (not the API, not a probe): it gets the dashboard's error
    page rather than the API's JSON error, where the app serves the dashboard."""
    if request.path.startswith(("/v1/", "/metrics", "/healthz", "/readyz")):
        return False
    return request.accept_mimetypes.best_match(["application/json", "text/html"]) == "text/html"


def _no_route(app: Flask) -> str:
    """A 404 for a path no route serves, saying which service answered: an agent pointed
    at the query service, or a reader at the collector, gets where to go instead."""
    rules = {r.rule for r in app.url_map.iter_rules()}
    path = request.path.rstrip("/")
    if path in ("/v1/batches", "/v1/ray/events") and path not in rules:
        return (
            "this is Hindsight's query service: batches go to the collector, a service of "
            "its own (port 8700 in docker compose; `hindsight serve` runs both on one)"
        )
    if path.startswith("/v1/") and "/v1/runs" not in rules and path != "/v1/openapi.json":
        return (
            "this is Hindsight's collector: runs are read from the query service, a service "
            "of its own (port 8701 in docker compose; `hindsight serve` runs both on one)"
        )
    return f"no route {request.method} {request.path} here: the API is at /v1/openapi.json"


def _register_errors(app: Flask) -> None:
    @app.errorhandler(ApiError)
    def _api_error(exc: ApiError) -> Any:
        return error_response(exc.status, exc.code, exc.message, exc.headers)

    @app.errorhandler(HTTPException)
    def _http_error(exc: HTTPException) -> Any:
        headers = (
            {"Allow": ", ".join(exc.valid_methods)} if getattr(exc, "valid_methods", None) else {}
        )
        page = app.extensions.get("hindsight.error_page")
        if page is not None and _wants_a_page():
            return page(exc, headers)
        code = (exc.name or "error").lower().replace(" ", "_")
        message = exc.description or exc.name
        if exc.code == 404 and request.url_rule is None:
            message = _no_route(app)
        cap = app.config.get("MAX_CONTENT_LENGTH")
        if exc.code == 413 and cap and (request.content_length or 0) >= cap:
            # Refused by its Content-Length, before a byte was read: say the cap, as the
            # refusal after reading does (werkzeug's text names no number).
            code, message = "batch_too_large", f"batch exceeds {cap - 1} bytes"
        elif exc.code == 413:  # a form past Flask's own limits (the sign-in page's)
            code = "request_too_large"
        return error_response(exc.code or 500, code, message, headers)

    @app.errorhandler(ConnectionError)
    @app.errorhandler(TimeoutError)
    def _store_down(exc: Exception) -> Any:
        logger.warning("blob store unavailable: %s", exc)
        err = unavailable("the blob store is unavailable; retry later")
        return error_response(err.status, err.code, err.message, err.headers)

    @app.errorhandler(OperationalError)
    @app.errorhandler(DBAPIError)
    def _db_down(exc: Exception) -> Any:
        logger.warning("index unavailable: %s", exc)
        err = unavailable("the index database is unavailable; retry later")
        return error_response(err.status, err.code, err.message, err.headers)

    @app.errorhandler(PoolTimeout)
    def _db_busy(exc: Exception) -> Any:
        # Every connection of the process's pool was busy (a slow index, more threads than
        # connections): a 500 made agents drop batches already stored.
        logger.warning("index busy: %s", exc)
        err = unavailable("the index database is busy; retry later")
        return error_response(err.status, err.code, err.message, err.headers)

    @app.errorhandler(Exception)
    def _unexpected(exc: Exception) -> Any:
        logger.exception("unhandled error")
        return error_response(500, "internal_error", "internal server error")


@functools.cache
def _schema_heads() -> tuple[str, ...]:
    from storage.core.db import head_revisions

    return tuple(head_revisions())


def db() -> Session:
    """This request's database session (closed at teardown; the view commits)."""
    if "db" not in g:
        g.db = store().sessions()
    return g.db


def store() -> Store:
    return current_app.extensions["hindsight"]


#: The dashboard's login cookie: the token pasted once at /login (HttpOnly, SameSite=Strict).
LOGIN_COOKIE = "hindsight_token"


def require(scope: str) -> Principal:
    """The caller's principal, if its token carries ``scope``; else 401/403. The token comes
    from an ``Authorization: Bearer`` header or, for reading (GET), from the dashboard's
    login cookie: the pages' own requests (replay, live refresh) and their data and export
    links answered 401 to a signed-in user. SameSite=Strict keeps other sites' pages from
    sending it, and a GET changes nothing."""
    st = store()
    if st.open_principal is not None:
        g.principal = st.open_principal
        _refuse_unknown_parameters()
        return st.open_principal
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    if not header and scope == "read" and request.method in ("GET", "HEAD"):
        scheme, token = "bearer", request.cookies.get(LOGIN_COOKIE, "")
    if scheme.lower() != "bearer" or not token.strip():
        raise ApiError(401, "unauthorized", "missing bearer token", {"WWW-Authenticate": "Bearer"})
    principal = st.principal_for(token.strip())
    if principal is None:
        raise ApiError(
            401, "unauthorized", "unknown or revoked token", {"WWW-Authenticate": "Bearer"}
        )
    g.principal = principal  # for the access log
    if scope not in principal.scopes:
        raise ApiError(403, "forbidden", f"token lacks the {scope!r} scope")
    _refuse_unknown_parameters()
    return principal


def _refuse_unknown_parameters() -> None:
    """400 for a parameter the route does not take (after the caller is known: a stranger
    gets 401 whatever it sends). A misspelled one (``clusters=``, ``treshold=``) ignored
    would give an answer that looks like an answer.
    Every JSON route takes what its OpenAPI operation lists; the lake's query route checks
    its own (its filters are the table's columns), and pages are not API routes."""
    rule = request.url_rule
    if rule is None or request.method not in ("GET", "HEAD") or rule.rule == "/v1/lake/<table>":
        return
    names = current_app.extensions["hindsight.parameters"].get(openapi_path(rule.rule))
    if names is not None:
        only_args(*names)


def health_blueprint(openapi: dict[str, Any], metrics: bool = True, service: str = "") -> Blueprint:
    bp = Blueprint("health", __name__)
    hide = ops.INGEST_ONLY if service == "query" else frozenset()

    if metrics:

        @bp.get("/metrics")
        def metrics_text() -> Any:
            # Unauthenticated, like every Prometheus scrape target: no metric names a tenant.
            return ops.metrics_response(hide)

    @bp.get("/healthz")
    def healthz() -> Any:
        return {"status": "ok"}

    @bp.get("/readyz")
    def readyz() -> Any:
        checks: dict[str, str] = {}
        st = store()
        try:
            st.blobs.ping()
            checks["blob_store"] = "ok"
        except Exception as exc:  # any failure means not ready
            checks["blob_store"] = f"error: {exc}"
        try:
            # The index at this code's schema: on one never migrated (HINDSIGHT_AUTO_UPGRADE
            # off, `db upgrade` not run) every request failed while /readyz said ready.
            from storage.core.db import current_revision

            revision = current_revision(st.engine)
            heads = _schema_heads()
            checks["index"] = (
                "ok"
                if revision in heads
                else f"error: schema at {revision or 'none'}, this "
                f"code needs {', '.join(heads)}: run `hindsight db upgrade`"
            )
        except Exception as exc:
            checks["index"] = f"error: {type(exc).__name__}"
        ready = all(v == "ok" for v in checks.values())
        return {
            "status": "ready" if ready else "unavailable",
            "checks": checks,
        }, 200 if ready else 503

    @bp.get("/v1/openapi.json")
    def openapi_json() -> Any:
        return openapi

    return bp


_SERVICE_NAMES = {"collector.app": "collector", "services.query.app": "query"}


def _query_parameters(openapi: dict[str, Any]) -> dict[str, tuple[str, ...]]:
    """The query parameters each documented GET route takes, by OpenAPI path."""
    return {
        path: tuple(p["name"] for p in ops_["get"].get("parameters", []) if p.get("in") == "query")
        for path, ops_ in openapi["paths"].items()
        if "get" in ops_
    }


@functools.lru_cache(maxsize=256)
def openapi_path(rule: str) -> str:
    """A Flask rule as an OpenAPI path: ``/v1/runs/<run_id>`` -> ``/v1/runs/{run_id}``."""
    return re.sub(r"<(?:\w+:)?(\w+)>", r"{\1}", rule)


def make_app(
    name: str,
    config: dict[str, Any] | None,
    blueprints: Iterable[Blueprint],
    openapi: dict[str, Any],
    settings: Settings | None = None,
) -> Flask:
    """An app with the shared plumbing: settings, store, errors, health, teardown."""
    settings = settings or load_settings(config)
    ops.configure_logging(settings.log_level, settings.log_format)
    app = Flask(name)
    app.config["SETTINGS"] = settings
    # One byte past the cap: a chunked body (no Content-Length; gunicorn marks its input
    # terminated) is then read to cap + 1 and refused 413 by ``collector.body``, rather than
    # cut at the cap without a word and refused 400 as truncated JSON.
    app.config["MAX_CONTENT_LENGTH"] = settings.max_batch_bytes + 1
    app.json.sort_keys = False
    app.extensions["hindsight"] = Store.open(settings)
    _register_errors(app)
    service = _SERVICE_NAMES.get(name, name)
    ops.install(app, service)
    app.register_blueprint(health_blueprint(openapi, settings.metrics, service))
    for bp in blueprints:
        app.register_blueprint(bp)

    @app.before_request
    def _refuse_nul() -> None:
        # A NUL can never be part of a name, id or cursor, and Postgres refuses it in a
        # string literal (psycopg2 raises ValueError: a 500). Refuse it before any route.
        values = [*request.args.values(), *(request.view_args or {}).values()]
        if any("\x00" in str(v) for v in values):
            raise ApiError(400, "invalid_parameter", "parameters must not contain NUL")

    app.extensions["hindsight.parameters"] = _query_parameters(openapi)

    @app.teardown_appcontext
    def _close_db(exc: BaseException | None) -> None:
        session = g.pop("db", None)
        if session is not None:
            session.close()

    return app
