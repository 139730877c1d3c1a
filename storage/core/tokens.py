"""Tenants' API tokens: created once, shown once, stored only as a SHA-256 hash.

Tokens are 256-bit random strings, so a plain SHA-256 (not a slow password hash) is the
right tool: nothing to brute-force, and verifying stays cheap on the ingest path.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from hindsight.schema import valid_name
from storage.core import models as m
from storage.core.statements import statements

# "ray": may only POST Ray exporter bodies (a token that rides in a URL: docs/ray.md).
SCOPES = ("ingest", "read", "admin", "ray")
TOKEN_PREFIX = "hs_"


@dataclass(frozen=True)
class Principal:
    """Who is calling: a tenant and the scopes its token grants."""

    tenant_id: int
    tenant: str
    scopes: frozenset[str]


def ensure_tenant(db: Session, name: str, now: float) -> int:
    """The id of tenant ``name``, created if new."""
    st = statements(db.get_bind().dialect.name)
    return st.tenant.id(db, {"name": name}, {"created_at": now})


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def parse_scopes(text: str) -> frozenset[str]:
    scopes = frozenset(s.strip() for s in text.split(",") if s.strip())
    unknown = scopes - set(SCOPES)
    if not scopes or unknown:
        raise ValueError(f"scopes must be a comma-separated subset of {', '.join(SCOPES)}")
    return scopes


def create_token(db: Session, tenant: str, scopes: str, name: str | None = None) -> str:
    """Create a token for ``tenant`` (created if new) and return it; only its hash is kept."""
    if not valid_name(tenant) or len(tenant) > 64:
        raise ValueError(f"invalid tenant name {tenant!r}: use up to 64 of A-Z a-z 0-9 _ . -")
    parsed = parse_scopes(scopes)
    now = time.time()
    tenant_id = ensure_tenant(db, tenant, now)
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    db.add(
        m.Token(
            tenant_id=tenant_id,
            token_hash=hash_token(token),
            scopes=",".join(sorted(parsed)),
            name=name,
            created_at=now,
        )
    )
    return token


def list_tokens(db: Session, tenant: str | None = None) -> list[dict[str, Any]]:
    """Every token (of ``tenant``), oldest first: id, tenant, scopes, name, times, and the
    first 8 hex digits of its hash (``hash_token`` of a token in hand tells which it is)."""
    q = (
        select(m.Token, m.Tenant.name)
        .join(m.Tenant, m.Tenant.id == m.Token.tenant_id)
        .order_by(m.Token.id)
    )
    if tenant is not None:
        q = q.where(m.Tenant.name == tenant)
    return [
        {
            "id": t.id,
            "tenant": name,
            "scopes": t.scopes,
            "name": t.name,
            "created_at": t.created_at,
            "revoked_at": t.revoked_at,
            "hash": t.token_hash[:8],
        }
        for t, name in db.execute(q)
    ]


def revoke_token(
    db: Session, *, token_id: int | None = None, token: str | None = None, now: float | None = None
) -> bool:
    """Revoke the token with id ``token_id``, or the token ``token`` itself (a leaked one in
    hand); False if there is no such token or it was revoked already. Services stop taking
    it within their cache's lifetime (``HINDSIGHT_TOKEN_CACHE_SECONDS``)."""
    q = update(m.Token).where(m.Token.revoked_at.is_(None))
    if token_id is not None:
        q = q.where(m.Token.id == token_id)
    elif token is not None:
        q = q.where(m.Token.token_hash == hash_token(token))
    else:
        raise ValueError("revoke_token needs a token id or a token")
    return db.execute(q.values(revoked_at=now or time.time())).rowcount == 1


def verify_token(db: Session, token: str) -> Principal | None:
    """The principal a token stands for, or None if it is unknown or revoked."""
    digest = hash_token(token)
    row = db.execute(
        select(m.Token.token_hash, m.Token.scopes, m.Tenant.id, m.Tenant.name)
        .join(m.Tenant, m.Tenant.id == m.Token.tenant_id)
        .where(m.Token.token_hash == digest, m.Token.revoked_at.is_(None))
    ).first()
    if row is None or not hmac.compare_digest(row.token_hash, digest):
        return None
    return Principal(row.id, row.name, frozenset(row.scopes.split(",")))
