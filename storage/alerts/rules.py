"""A tenant's alert rules: made, listed, removed, and matched against a finished run.

A rule's URL must be http(s) and, unless the operator allows it
(``HINDSIGHT_ALERTS_ALLOW_PRIVATE``), must not reach a loopback, private, link-local or
otherwise internal address: a tenant's webhook would otherwise make the collector post to
services on its own network. The address is checked when the rule is made and again at
every delivery (a name can be pointed elsewhere later)."""

from __future__ import annotations

import ipaddress
import math
import secrets
import socket
import time
import urllib.parse
from typing import Any

from sqlalchemy import delete, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from storage.core import models as m

FORMATS = ("json", "slack")
MAX_NAME = 256


class RuleError(ValueError):
    """A rule cannot be made as asked; the message says why."""


def internal_address(url: str) -> str | None:
    """The first internal address ``url``'s host resolves to, or None if it reaches only
    public ones. A host that does not resolve is an error."""
    host = urllib.parse.urlsplit(url).hostname or ""
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (socket.gaierror, UnicodeError) as exc:
        raise RuleError(f"the webhook's host {host!r} does not resolve: {exc}") from None
    for info in infos:
        addr = ipaddress.ip_address(str(info[4][0]).split("%")[0])
        if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped:
            addr = addr.ipv4_mapped
        if not addr.is_global or addr.is_multicast:
            return str(addr)
    return None


def check_url(url: str, allow_private: bool) -> None:
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise RuleError("url must be an http:// or https:// URL with a host")
    if parts.username or parts.password:
        raise RuleError("url must not hold credentials (put a token in its path or query)")
    if not allow_private:
        internal = internal_address(url)
        if internal is not None:
            raise RuleError(
                f"url reaches an internal address ({internal}); the operator allows that "
                "with HINDSIGHT_ALERTS_ALLOW_PRIVATE=true"
            )


def create_rule(
    db: Session,
    tenant_id: int,
    spec: dict[str, Any],
    *,
    allow_private: bool = False,
    now: float | None = None,
) -> dict[str, Any]:
    """Make a rule from ``spec`` (the REST body); returns it with its ``secret``, which is
    shown this once. Raises :class:`RuleError` naming what is wrong."""
    known = {"name", "url", "format", "cluster", "job", "on_slower", "min_change", "on_failures"}
    unknown = sorted(set(spec) - known)
    if unknown:
        raise RuleError(f"unknown field(s): {', '.join(unknown)}")
    name = spec.get("name")
    if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME:
        raise RuleError(f"name must be a string of 1 to {MAX_NAME} characters")
    url = spec.get("url")
    if not isinstance(url, str) or len(url) > 2048:
        raise RuleError("url must be a string of at most 2048 characters")
    fmt = spec.get("format", "json")
    if fmt not in FORMATS:
        raise RuleError(f"format must be one of {', '.join(FORMATS)}")
    cluster, job = spec.get("cluster"), spec.get("job")
    for field, value, limit in (("cluster", cluster, 256), ("job", job, 1024)):
        if value is not None and (not isinstance(value, str) or not 0 < len(value) <= limit):
            raise RuleError(f"{field} must be a string of 1 to {limit} characters, or absent")
    on_slower, on_failures = spec.get("on_slower", True), spec.get("on_failures", False)
    if not isinstance(on_slower, bool) or not isinstance(on_failures, bool):
        raise RuleError("on_slower and on_failures must be true or false")
    if not (on_slower or on_failures):
        raise RuleError("a rule alerts on something: on_slower, on_failures or both")
    min_change = spec.get("min_change", 0.2)
    if (
        isinstance(min_change, bool)
        or not isinstance(min_change, int | float)
        or not math.isfinite(min_change)
        or min_change < 0
    ):
        raise RuleError("min_change must be a number >= 0 (0.2: 20% slower than usual)")
    check_url(url, allow_private)
    rule = m.AlertRule(
        tenant_id=tenant_id,
        name=name,
        cluster=cluster,
        job=job,
        on_slower=on_slower,
        min_change=float(min_change),
        on_failures=on_failures,
        url=url,
        format=fmt,
        secret=secrets.token_hex(32),
        created_at=time.time() if now is None else now,
    )
    db.add(rule)
    try:
        db.flush()
    except IntegrityError:
        db.rollback()
        raise RuleError(f"a rule named {name!r} exists") from None
    return {**rule_view(rule), "secret": rule.secret}


def rule_view(rule: m.AlertRule) -> dict[str, Any]:
    """A rule as the API shows it (without its secret)."""
    return {
        "id": rule.id,
        "name": rule.name,
        "cluster": rule.cluster,
        "job": rule.job,
        "on_slower": rule.on_slower,
        "min_change": rule.min_change,
        "on_failures": rule.on_failures,
        "url": rule.url,
        "format": rule.format,
        "created_at": rule.created_at,
    }


def list_rules(db: Session, tenant_id: int) -> list[dict[str, Any]]:
    rows = db.scalars(
        select(m.AlertRule).where(m.AlertRule.tenant_id == tenant_id).order_by(m.AlertRule.id)
    )
    return [rule_view(r) for r in rows]


def delete_rule(db: Session, tenant_id: int, rule_id: int) -> bool:
    """Remove a rule of the tenant (and its deliveries); False if it has none by that id."""
    gone = db.execute(
        delete(m.AlertRule).where(m.AlertRule.id == rule_id, m.AlertRule.tenant_id == tenant_id)
    )
    return bool(gone.rowcount)


def job_matches(pattern: str | None, name: str | None) -> bool:
    """A rule's ``job`` against a run's name: exact, or a prefix with a trailing ``*``."""
    if pattern is None:
        return True
    if name is None:
        return False
    if pattern.endswith("*"):
        return name.startswith(pattern[:-1])
    return name == pattern


def reasons_for(rule: m.AlertRule, run: m.Run, explanation: dict[str, Any] | None) -> list[str]:
    """Why ``rule`` alerts on ``run`` ("slower", "failures"), empty if it does not."""
    out = []
    if rule.on_slower and explanation and explanation.get("verdict") == "slower":
        change = explanation.get("change")
        if isinstance(change, int | float) and change >= rule.min_change:
            out.append("slower")
    if rule.on_failures and (run.status == "erred" or (run.error_count or 0) > 0):
        out.append("failures")
    return out
