"""The collector service: ``gunicorn 'collector.app:create_app()'``."""

from __future__ import annotations

from typing import Any

from flask import Flask

from collector.keepalive import RecycleConnections
from collector.openapi import OPENAPI
from collector.ratelimit import RateLimiter
from collector.ray import bp as ray_bp
from collector.ray import init_ray
from collector.views import bp
from services.common.web import make_app
from storage.core.config import Settings
from storage.jobs import workers


def create_app(config: dict[str, Any] | None = None, *, settings: Settings | None = None) -> Flask:
    """Build the collector app. ``config`` overrides environment settings (tests pass a dict)."""
    app = make_app(__name__, config, [bp, ray_bp], OPENAPI, settings=settings)
    init_collector(app)
    return app


def init_collector(app: Flask) -> None:
    """Per-process collector state (also used by the embedded server)."""
    s = app.config["SETTINGS"]
    app.extensions["hindsight.ratelimit"] = RateLimiter(s.rate_limit_events, s.rate_limit_burst)
    app.wsgi_app = RecycleConnections(app.wsgi_app, s.keepalive_requests)  # type: ignore[method-assign]
    init_ray(app)
    sweeper = workers.start(app, app.extensions["hindsight"])
    if sweeper is not None:
        app.extensions["hindsight.ray_sweeper"] = sweeper
