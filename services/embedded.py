"""The embedded server: collector and query service in one process on one port
(``hindsight serve``), with SQLite and a local blob directory by default."""

from __future__ import annotations

from typing import Any

from flask import Flask

from collector.app import init_collector
from collector.openapi import OPENAPI as COLLECTOR_OPENAPI
from collector.openapi import PATHS as COLLECTOR_PATHS
from collector.ray import bp as ray_bp
from collector.views import bp as collector_bp
from services.common.openapi import document
from services.common.web import make_app
from services.query.app import BLUEPRINTS as QUERY_BLUEPRINTS
from services.query.openapi import OPENAPI as QUERY_OPENAPI
from services.query.openapi import PATHS as QUERY_PATHS
from storage.core.config import Settings

OPENAPI = document(
    "Hindsight (embedded: collector + query)",
    {**COLLECTOR_PATHS, **QUERY_PATHS},
    {**COLLECTOR_OPENAPI["components"]["schemas"], **QUERY_OPENAPI["components"]["schemas"]},
)


def create_app(config: dict[str, Any] | None = None, *, settings: Settings | None = None) -> Flask:
    app = make_app(
        __name__,
        config,
        [collector_bp, ray_bp, *QUERY_BLUEPRINTS],
        OPENAPI,
        settings=settings,
    )
    init_collector(app)
    return app
