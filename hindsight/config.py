"""SDK settings: the one place the agent reads its environment and Dask config.

Precedence, highest first: explicit arguments (``install(client, url=...)`` or the
preload's command-line options), Dask config keys ``hindsight.*`` (which Dask itself also
fills from ``DASK_HINDSIGHT__*`` variables and YAML files), the ``HINDSIGHT_*`` environment
variables, then the defaults below.  A bad value is logged and replaced by its default:
the agent never takes its host down over configuration.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hindsight.sender import ZSTD_LEVEL

logger = logging.getLogger(__name__)

DEFAULT_SPOOL_MAX_BYTES = 256 * 1024 * 1024


def _default_spool_dir() -> str:
    return os.path.join(tempfile.gettempdir(), "hindsight-spool")


@dataclass(frozen=True)
class Settings:
    """Everything the agent needs; picklable, so plugins can carry it to the cluster."""

    #: Collector base URL, e.g. ``http://collector:8080``; ``None`` disables the agent.
    url: str | None = None
    #: Bearer token; optional for a collector running without auth (embedded mode).
    token: str | None = None
    #: The long-lived name of this cluster, e.g. ``prod-etl``.
    cluster: str = "default"
    #: Directory for the on-disk spool; one sub-directory per agent instance.
    spool_dir: str = field(default_factory=_default_spool_dir)
    #: Upper bound of the spool on disk; the oldest batches are dropped (and counted) past it.
    spool_max_bytes: int = DEFAULT_SPOOL_MAX_BYTES
    #: Deliver the spool directories that agents which are gone left under ``spool_dir``
    #: for the same collector URL and token (hindsight/agent/adopt.py).
    adopt_spools: bool = True
    #: A batch is cut as soon as this many events are buffered.
    flush_events: int = 5000
    #: ... or at the latest this many seconds after the previous batch.
    flush_interval: float = 1.0
    #: Bound of the in-memory buffer, in events; further events are dropped and counted.
    buffer_events: int = 100_000
    #: Seconds ``close()`` (and interpreter exit) may spend delivering what is left.
    close_timeout: float = 10.0
    #: Seconds between worker metric samples.
    sample_interval: float = 1.0
    #: Worker log records at or above this level are recorded.
    log_level: str = "WARNING"
    #: Content-Encoding of request bodies: zstd, gzip or identity.
    encoding: str = "zstd"
    #: zstd level (default: hindsight.sender.ZSTD_LEVEL, 9).  The collector stores bodies
    #: as received, so this is also the size at rest: 23.7 bytes per task event at 9 vs 30.4
    #: at 3.  The cost is 3.3 vs 0.45 us of agent-thread CPU per event (zstd runs without
    #: the GIL), at most ~1.2% of the scheduler's own per-task cost; lower it on a
    #: scheduler with no core to spare.
    zstd_level: int = ZSTD_LEVEL
    #: Socket timeout of one HTTP request.
    request_timeout: float = 10.0
    #: Ship each worker's statistical profiles (Dask samples them anyway; this sends them).
    profiles: bool = True
    #: Seconds between shipping a worker's finished profile cycles (at most a quarter of the
    #: history Dask keeps: ``distributed.admin.low-level-log-length`` cycles).
    profile_interval: float = 5.0
    #: Client frames of submitting code Dask should send with each computation
    #: (``distributed.diagnostics.computations.nframes``), raised to this where Hindsight
    #: can: the client given to ``install()`` and clients in the scheduler's process (an
    #: in-process LocalCluster). 0 leaves Dask's setting alone.
    code_frames: int = 1

    @property
    def enabled(self) -> bool:
        return bool(self.url)

    def replace(self, **changes: Any) -> Settings:
        """A copy with ``changes`` applied (``None`` values are ignored)."""
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})


# (field, environment variable) pairs; dask config uses the field name with "-" for "_".
_ENV = {
    "url": "HINDSIGHT_URL",
    "token": "HINDSIGHT_TOKEN",
    "cluster": "HINDSIGHT_CLUSTER",
    "spool_dir": "HINDSIGHT_SPOOL_DIR",
    "spool_max_bytes": "HINDSIGHT_SPOOL_MAX_BYTES",
    "adopt_spools": "HINDSIGHT_ADOPT_SPOOLS",
    "flush_events": "HINDSIGHT_FLUSH_EVENTS",
    "flush_interval": "HINDSIGHT_FLUSH_INTERVAL",
    "buffer_events": "HINDSIGHT_BUFFER_EVENTS",
    "close_timeout": "HINDSIGHT_CLOSE_TIMEOUT",
    "sample_interval": "HINDSIGHT_SAMPLE_INTERVAL",
    # not HINDSIGHT_LOG_LEVEL: that is the services' own logging level (storage/core/config.py)
    "log_level": "HINDSIGHT_WORKER_LOG_LEVEL",
    "encoding": "HINDSIGHT_ENCODING",
    "zstd_level": "HINDSIGHT_ZSTD_LEVEL",
    "request_timeout": "HINDSIGHT_REQUEST_TIMEOUT",
    "profiles": "HINDSIGHT_PROFILES",
    "profile_interval": "HINDSIGHT_PROFILE_INTERVAL",
    "code_frames": "HINDSIGHT_CODE_FRAMES",
}

_TYPES = {f.name: f.type for f in dataclasses.fields(Settings)}


def _coerce(name: str, raw: Any) -> Any:
    kind = _TYPES[name]
    if kind == "bool":
        if isinstance(raw, bool):
            return raw
        text = str(raw).strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise ValueError(raw)
    if "int" in kind:
        return int(raw)
    if "float" in kind:
        return float(raw)
    return str(raw)


def _cluster_name(value: str, source: str) -> str:
    """A cluster name made valid (runs of other characters become ``-``), with a warning
    saying what it became: ``my cluster`` is recorded as ``my-cluster``, not under
    ``default``, where a user could not tell the run went."""
    name = re.sub(r"[^A-Za-z0-9_.\-]+", "-", value)
    name = re.sub(r"\.{2,}", ".", name).lstrip(".-")[:128]
    if name:
        logger.warning(
            "hindsight: %s cluster=%r is not a valid name (up to 128 of A-Z a-z 0-9 _ . -, "
            "not starting with . or -); recording as cluster %r",
            source,
            value,
            name,
        )
    return name


def _valid(name: str, value: Any) -> bool:
    if name in ("spool_max_bytes", "flush_events", "buffer_events"):
        return value > 0
    if name == "code_frames":
        return 0 <= value <= 64
    if name == "zstd_level":
        return 1 <= value <= 22
    if name in (
        "flush_interval",
        "close_timeout",
        "sample_interval",
        "request_timeout",
        "profile_interval",
    ):
        return value > 0
    if name == "encoding":
        return value in ("zstd", "gzip", "identity")
    if name == "log_level":
        return isinstance(logging.getLevelName(value.upper()), int)
    if name == "url":
        return value.startswith(("http://", "https://"))
    if name == "cluster":
        from hindsight.schema import valid_name

        return valid_name(value)
    return True


def _dask_config() -> Mapping[str, Any]:
    try:
        import dask.config
    except ImportError:  # the SDK works without Dask (emit from scripts, tests)
        return {}
    value = dask.config.get("hindsight", default={}) or {}
    return value if isinstance(value, Mapping) else {}


def load_settings(
    overrides: Mapping[str, Any] | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    dask_config: Mapping[str, Any] | None = None,
) -> Settings:
    """Resolve settings from ``overrides`` > Dask config > environment > defaults.

    ``environ`` and ``dask_config`` default to ``os.environ`` and ``dask.config``; tests
    pass dicts instead.
    """
    environ = os.environ if environ is None else environ
    dconf = _dask_config() if dask_config is None else dask_config
    values: dict[str, Any] = {}
    for name, env_name in _ENV.items():
        sources = (
            ("argument", (overrides or {}).get(name)),
            ("dask config", dconf.get(name.replace("_", "-"), dconf.get(name))),
            ("environment", environ.get(env_name)),
        )
        for source, raw in sources:
            if raw is None or raw == "":
                continue
            try:
                value = _coerce(name, raw)
                if name == "cluster" and not _valid(name, value):
                    value = _cluster_name(value, source)
                if not _valid(name, value):
                    raise ValueError(raw)
            except (TypeError, ValueError):
                logger.warning("hindsight: ignoring invalid %s %s=%r", source, name, raw)
                continue
            values[name] = value
            break
    if "url" in values:
        values["url"] = values["url"].rstrip("/")
    return Settings(**values)
