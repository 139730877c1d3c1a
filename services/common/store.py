"""The storage a service process holds: settings, one engine, one blob store."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from storage.core.blobs import BlobStore, blob_store_for
from storage.core.config import ConfigError, Settings
from storage.core.db import make_engine, make_sessionmaker, upgrade
from storage.core.idcache import IdCache
from storage.core.tokens import SCOPES, Principal, ensure_tenant, verify_token

logger = logging.getLogger(__name__)

DEFAULT_TENANT = "default"


@dataclass
class Store:
    settings: Settings
    engine: Engine
    sessions: sessionmaker[Session]
    blobs: BlobStore
    open_principal: Principal | None = None
    ids: IdCache = field(default_factory=IdCache)
    _token_cache: dict[str, tuple[float, Principal | None]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def open(cls, settings: Settings) -> Store:
        from sqlalchemy.engine import make_url
        from sqlalchemy.exc import OperationalError

        engine = make_engine(settings.database_url)
        try:
            if settings.auto_upgrade:
                upgrade(engine)
            store = cls(settings, engine, make_sessionmaker(engine), blob_store_for(settings))
            if not settings.auth_required:
                with store.sessions.begin() as db:
                    tenant_id = ensure_tenant(db, DEFAULT_TENANT, time.time())
                store.open_principal = Principal(tenant_id, DEFAULT_TENANT, frozenset(SCOPES))
        except OperationalError as exc:
            # The start-up's own work needs the index: say which setting names it, not
            # sixty lines of driver traceback.
            url = make_url(settings.database_url).render_as_string(hide_password=True)
            raise ConfigError(
                f"HINDSIGHT_DATABASE_URL ({url}): the index cannot be reached at start "
                f"({str(exc.orig).strip().splitlines()[0] if exc.orig else exc})"
            ) from None
        return store

    def principal_for(self, token: str) -> Principal | None:
        """Verify a token, caching the answer for ``token_cache_seconds``."""
        now = time.monotonic()
        hit = self._token_cache.get(token)
        if hit is not None and hit[0] > now:
            return hit[1]
        with self.sessions() as db:
            principal = verify_token(db, token)
        with self._lock:
            if len(self._token_cache) > 10_000:
                self._token_cache.clear()
            self._token_cache[token] = (now + self.settings.token_cache_seconds, principal)
        return principal

    def close(self) -> None:
        self.engine.dispose()
