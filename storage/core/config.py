"""Server-side settings: every environment variable the services read, in one place.

Services call :func:`load_settings` with an optional mapping of overrides (tests pass a
dict instead of touching ``os.environ``). Bad values fail fast with a clear message.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Environment variable -> (field, type, default). Documented in docs/deploy.md;
# tests check docker-compose.yml against this table.
ENVIRONMENT: dict[str, tuple[str, type, Any]] = {
    "HINDSIGHT_DATA_DIR": ("data_dir", str, "./hindsight-data"),
    "HINDSIGHT_DATABASE_URL": ("database_url", str, ""),
    "HINDSIGHT_BLOB_URL": ("blob_url", str, ""),
    "HINDSIGHT_S3_ENDPOINT_URL": ("s3_endpoint_url", str, ""),
    "HINDSIGHT_S3_REGION": ("s3_region", str, "us-east-1"),
    "HINDSIGHT_AUTH": ("auth", str, "required"),
    "HINDSIGHT_MAX_BATCH_BYTES": ("max_batch_bytes", int, 32 * 1024 * 1024),
    "HINDSIGHT_RATE_LIMIT_EVENTS": ("rate_limit_events", float, 0.0),
    "HINDSIGHT_RATE_LIMIT_BURST": ("rate_limit_burst", float, 0.0),
    "HINDSIGHT_RETRY_AFTER": ("retry_after", int, 5),
    "HINDSIGHT_BODY_TIMEOUT": ("body_timeout", float, 60.0),
    "HINDSIGHT_AUTO_UPGRADE": ("auto_upgrade", bool, True),
    "HINDSIGHT_TOKEN_CACHE_SECONDS": ("token_cache_seconds", float, 10.0),
    "HINDSIGHT_LOG_LEVEL": ("log_level", str, "INFO"),
    "HINDSIGHT_LOG_FORMAT": ("log_format", str, "text"),
    "HINDSIGHT_ACCESS_LOG": ("access_log", bool, True),
    "HINDSIGHT_METRICS": ("metrics", bool, True),
    "HINDSIGHT_MAX_IN_FLIGHT": ("max_in_flight", int, 64),
    "HINDSIGHT_MAX_IN_FLIGHT_BYTES": ("max_in_flight_bytes", int, 256 * 1024 * 1024),
    "HINDSIGHT_KEEPALIVE_REQUESTS": ("keepalive_requests", int, 20),
    "HINDSIGHT_RAY_SETTLE_SECONDS": ("ray_settle_seconds", float, 5.0),
    "HINDSIGHT_RAY_IDLE_CLOSE_SECONDS": ("ray_idle_close_seconds", float, 900.0),
    "HINDSIGHT_RAY_SWEEPER": ("ray_sweeper", bool, True),
    "HINDSIGHT_RAY_HOLD_SECONDS": ("ray_hold_seconds", float, 0.5),
    "HINDSIGHT_FINISH_WORKER": ("finish_worker", bool, True),
    "HINDSIGHT_FINISH_SETTLE_SECONDS": ("finish_settle_seconds", float, 5.0),
    "HINDSIGHT_SILENT_CLOSE_SECONDS": ("silent_close_seconds", float, 1800.0),
    "HINDSIGHT_SILENT_AGENTS_SECONDS": ("silent_agents_seconds", float, 60.0),
    "HINDSIGHT_MANIFEST_COLLAPSE_SECONDS": ("manifest_collapse_seconds", float, 3600.0),
    "HINDSIGHT_ALERTS_ALLOW_PRIVATE": ("alerts_allow_private", bool, False),
    "HINDSIGHT_ALERTS_RETRY_SECONDS": ("alerts_retry_seconds", float, 2.0),
    "HINDSIGHT_PAGE_STREAM_RECTS": ("page_stream_rects", int, 50_000),
}


class ConfigError(ValueError):
    """A setting has a value the services cannot run with."""


@dataclass(frozen=True)
class Settings:
    data_dir: str
    database_url: str
    blob_url: str
    s3_endpoint_url: str
    s3_region: str
    auth: str
    max_batch_bytes: int
    rate_limit_events: float
    rate_limit_burst: float
    retry_after: int
    body_timeout: float
    auto_upgrade: bool
    token_cache_seconds: float
    log_level: str
    log_format: str
    access_log: bool
    metrics: bool
    max_in_flight: int
    max_in_flight_bytes: int
    keepalive_requests: int
    ray_settle_seconds: float
    ray_idle_close_seconds: float
    ray_sweeper: bool
    ray_hold_seconds: float
    finish_worker: bool
    finish_settle_seconds: float
    silent_close_seconds: float
    silent_agents_seconds: float
    #: Manifest rows older than this are packed into their agent's chunk (0: never).
    manifest_collapse_seconds: float
    alerts_allow_private: bool
    alerts_retry_seconds: float
    #: A finished run's page embeds its task stream up to this many start/stops; past it
    #: the page fetches windows of it (bins, exact start/stops as the user zooms in).
    page_stream_rects: int

    @property
    def auth_required(self) -> bool:
        return self.auth == "required"


def _convert(name: str, kind: type, value: Any) -> Any:
    if isinstance(value, kind) and not (kind is int and isinstance(value, bool)):
        return value
    text = str(value).strip()
    try:
        if kind is bool:
            if text.lower() in ("1", "true", "yes", "on"):
                return True
            if text.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(text)
        return kind(text)
    except ValueError:
        raise ConfigError(f"{name}={value!r} is not a valid {kind.__name__}") from None


def load_settings(
    overrides: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None
) -> Settings:
    """Settings from the environment, then ``overrides`` (keyed by field or variable name)."""
    environ = os.environ if environ is None else environ
    overrides = dict(overrides or {})
    by_field = {f: (var, kind, default) for var, (f, kind, default) in ENVIRONMENT.items()}
    values: dict[str, Any] = {}
    for field_name, (var, kind, default) in by_field.items():
        raw: Any = default
        if var in environ and environ[var] != "":
            raw = environ[var]
        if var in overrides:
            raw = overrides.pop(var)
        if field_name in overrides:
            raw = overrides.pop(field_name)
        values[field_name] = _convert(var, kind, raw)
    if overrides:
        raise ConfigError(f"unknown settings: {', '.join(sorted(overrides))}")

    data_dir = Path(values["data_dir"]).expanduser().resolve()
    values["data_dir"] = str(data_dir)
    if not values["database_url"]:
        values["database_url"] = f"sqlite:///{data_dir / 'index.db'}"
    if not values["blob_url"]:
        values["blob_url"] = (data_dir / "blobs").as_uri()
    if values["auth"] not in ("required", "disabled"):
        raise ConfigError(
            f"HINDSIGHT_AUTH must be 'required' or 'disabled', not {values['auth']!r}"
        )
    if values["max_batch_bytes"] < 1024:
        raise ConfigError("HINDSIGHT_MAX_BATCH_BYTES must be at least 1024")
    if values["log_format"] not in ("text", "json"):
        raise ConfigError(
            f"HINDSIGHT_LOG_FORMAT must be 'text' or 'json', not {values['log_format']!r}"
        )
    if values["max_in_flight"] < 0 or values["max_in_flight_bytes"] < 0:
        raise ConfigError("HINDSIGHT_MAX_IN_FLIGHT and ..._BYTES must not be negative (0: no cap)")
    if values["keepalive_requests"] < 0:
        raise ConfigError("HINDSIGHT_KEEPALIVE_REQUESTS must not be negative (0: never close)")
    if not 0 < values["body_timeout"] < 1e6:  # NaN fails too
        raise ConfigError("HINDSIGHT_BODY_TIMEOUT must be a positive number of seconds")
    if values["finish_settle_seconds"] < 0:
        raise ConfigError("HINDSIGHT_FINISH_SETTLE_SECONDS must not be negative")
    if not values["silent_close_seconds"] >= 0:  # NaN fails too
        raise ConfigError("HINDSIGHT_SILENT_CLOSE_SECONDS must not be negative (0: never)")
    if not values["manifest_collapse_seconds"] >= 0:  # NaN fails too
        raise ConfigError("HINDSIGHT_MANIFEST_COLLAPSE_SECONDS must not be negative (0: never)")
    if not 0 < values["alerts_retry_seconds"] < 1e6:
        raise ConfigError("HINDSIGHT_ALERTS_RETRY_SECONDS must be a positive number of seconds")
    if not values["silent_agents_seconds"] > 0:
        raise ConfigError("HINDSIGHT_SILENT_AGENTS_SECONDS must be a positive number of seconds")
    if values["page_stream_rects"] < 0:
        raise ConfigError("HINDSIGHT_PAGE_STREAM_RECTS must not be negative")
    if values["rate_limit_events"] < 0 or values["rate_limit_burst"] < 0:
        raise ConfigError("rate limits must not be negative")
    if not values["ray_hold_seconds"] >= 0:  # NaN fails too
        raise ConfigError("HINDSIGHT_RAY_HOLD_SECONDS must not be negative (0: no hold)")
    if values["ray_settle_seconds"] < 0 or values["ray_idle_close_seconds"] <= 0:
        raise ConfigError(
            "HINDSIGHT_RAY_SETTLE_SECONDS must not be negative and "
            "HINDSIGHT_RAY_IDLE_CLOSE_SECONDS must be positive"
        )
    if not values["blob_url"].startswith(("s3://", "file://")):
        raise ConfigError(
            "HINDSIGHT_BLOB_URL must be s3://bucket/prefix or file:///path,"
            f" not {values['blob_url']!r}"
        )
    return Settings(**values)


__all__ = ["ENVIRONMENT", "ConfigError", "Settings", "load_settings"]
