"""The query service: ``gunicorn 'services.query.app:create_app()'``."""

from __future__ import annotations

from typing import Any

from flask import Flask

from services.common.web import make_app
from services.dashboard.views import bp as dashboard_bp
from services.query.alerts import bp as alerts_bp
from services.query.lake import bp as lake_bp
from services.query.openapi import OPENAPI
from services.query.views import bp
from storage.core.config import Settings

#: The query service's routes, in the query service and in the embedded server alike.
BLUEPRINTS = (bp, lake_bp, alerts_bp, dashboard_bp)


def create_app(config: dict[str, Any] | None = None, *, settings: Settings | None = None) -> Flask:
    """Build the query service app. ``config`` overrides environment settings."""
    return make_app(__name__, config, list(BLUEPRINTS), OPENAPI, settings=settings)
