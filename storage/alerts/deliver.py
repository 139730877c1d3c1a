"""Alerts of finished runs, posted to their rules' webhooks at least once.

:func:`enqueue` runs when a run's finished-run work has judged it (``storage.jobs``): each
rule of the run's tenant that matches it gets one delivery row, keyed by (rule, run), so a
run finished again (a late batch, a reindex) is not alerted twice. :func:`deliver_due`
posts due deliveries: a 2xx takes it; a timeout, a refused connection, 408, 429 or a 5xx
is retried with exponential backoff (``BACKOFF_S`` doubling, at most ``MAX_BACKOFF_S``)
up to ``MAX_ATTEMPTS``; another 4xx fails it at once (the receiver refuses it). The
delivery is claimed for ``LEASE_S`` before the post, so two processes do not post it at
once, and a process killed mid-post leaves it to be posted again: receivers dedupe on the
``X-Hindsight-Delivery`` header, the same on every attempt.

The "json" format is signed: ``X-Hindsight-Signature: sha256=HEX``, the HMAC-SHA256 of the
body with the rule's secret. The "slack" format is what Slack's incoming webhooks take."""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import time
import urllib.error
import urllib.request
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from storage.alerts.rules import RuleError, internal_address, job_matches, reasons_for
from storage.core import models as m
from storage.query import explain
from storage.runs.context import FinishedRun

logger = logging.getLogger(__name__)

MAX_ATTEMPTS = 10
BACKOFF_S = 2.0
MAX_BACKOFF_S = 3600.0
LEASE_S = 60.0
TIMEOUT_S = 10.0
USER_AGENT = "hindsight-alerts/1"


def _summary(run: m.Run, cluster: str) -> dict[str, Any]:
    makespan = (
        run.task_stop - run.task_start
        if run.task_stop is not None and run.task_start is not None
        else None
    )
    return {
        "id": run.public_id,
        "name": run.name,
        "cluster": cluster,
        "status": run.status,
        "started_at": run.started_at,
        "finished_at": run.finished_at,
        "makespan": makespan,
        "task_count": run.task_count,
        "error_count": run.error_count,
        "page": f"/runs/{run.public_id}",
    }


def body_for(
    rule: m.AlertRule,
    run: m.Run,
    cluster: str,
    reasons: list[str],
    explanation: dict[str, Any] | None,
) -> dict[str, Any]:
    """What is posted for one alert, in the rule's format."""
    summary = _summary(run, cluster)
    exp = explanation or {}
    what = run.name or run.public_id
    head = []
    if "slower" in reasons:
        head.append(f"{what} on {cluster} was {exp.get('change', 0):.0%} slower than usual")
    if "failures" in reasons:
        head.append(f"{what} on {cluster} had {run.error_count or 0} failed task(s)")
    text = "; ".join(head) + "."
    if exp.get("text"):
        text += " " + str(exp["text"])
    if rule.format == "slack":
        return {
            "text": text,
            "blocks": [
                {"type": "section", "text": {"type": "mrkdwn", "text": text[:2900]}},
                {
                    "type": "context",
                    "elements": [
                        {
                            "type": "mrkdwn",
                            "text": f"rule {rule.name} · run {run.public_id} · {summary['page']}",
                        }
                    ],
                },
            ],
        }
    return {
        "event": "run.alert",
        "rule": {"id": rule.id, "name": rule.name},
        "reasons": reasons,
        "run": summary,
        "verdict": exp.get("verdict"),
        "change": exp.get("change"),
        "findings": list(exp.get("findings") or [])[:5],
        "text": text,
    }


def enqueue(
    db: Session,
    run: m.Run,
    cluster: str,
    explanation: dict[str, Any] | None,
    now: float | None = None,
) -> int:
    """Queue the alerts ``run`` (finished or erred) raises under its tenant's rules made
    before it was last heard from; returns how many are new. The caller commits."""
    now = time.time() if now is None else now
    # By the collector's clock (the run's times are its scheduler's): a rule made after
    # the run was last heard from does not alert on it when it is finished again.
    heard = run.last_seen if run.last_seen is not None else now
    rules = db.scalars(
        select(m.AlertRule).where(
            m.AlertRule.tenant_id == run.tenant_id, m.AlertRule.created_at <= heard
        )
    ).all()
    new = 0
    for rule in rules:
        if rule.cluster is not None and rule.cluster != cluster:
            continue
        if not job_matches(rule.job, run.name):
            continue
        reasons = reasons_for(rule, run, explanation)
        if not reasons:
            continue
        exists = db.scalar(
            select(m.AlertDelivery.id).where(
                m.AlertDelivery.rule_id == rule.id, m.AlertDelivery.run == run.public_id
            )
        )
        if exists is not None:
            continue
        try:
            with db.begin_nested():
                db.add(
                    m.AlertDelivery(
                        rule_id=rule.id,
                        run=run.public_id,
                        idempotency_key=f"{rule.id}:{run.public_id}",
                        reasons=reasons,
                        body=body_for(rule, run, cluster, reasons, explanation),
                        status="pending",
                        attempts=0,
                        next_at=now,
                        created_at=now,
                    )
                )
        except IntegrityError:  # another process queued it first
            continue
        new += 1
    return new


def finish(fr: FinishedRun) -> None:
    """Finisher, after the explanation's: queue the alerts the run raises, judged by its
    stored explanation (posted by the alert sender thread)."""
    enqueue(fr.db, fr.run, fr.cluster, explain.explanation(fr.db, fr.blobs, fr.run))


def sign(secret: str, body: bytes) -> str:
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


def _post(rule: m.AlertRule, delivery: m.AlertDelivery, allow_private: bool) -> tuple[int, str]:
    """(HTTP status, error text): status 0 for no answer."""
    if not allow_private:
        try:
            internal = internal_address(rule.url)
        except RuleError as exc:
            return 0, str(exc)
        if internal is not None:
            return -1, f"the webhook's host now resolves to an internal address ({internal})"
    body = json.dumps(delivery.body, separators=(",", ":"), sort_keys=True).encode()
    headers = {
        "Content-Type": "application/json",
        "User-Agent": USER_AGENT,
        "X-Hindsight-Delivery": delivery.idempotency_key,
        "X-Hindsight-Attempt": str(delivery.attempts + 1),
    }
    if rule.format == "json":
        headers["X-Hindsight-Signature"] = sign(rule.secret, body)
    req = urllib.request.Request(rule.url, data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT_S) as resp:  # noqa: S310 (checked)
            return resp.status, ""
    except urllib.error.HTTPError as exc:
        return exc.code, f"HTTP {exc.code} {exc.reason}"
    except (urllib.error.URLError, OSError, ValueError) as exc:
        return 0, f"no answer: {exc}"


def _retryable(status: int) -> bool:
    return status == 0 or status in (408, 429) or status >= 500


def deliver_due(
    sessions: sessionmaker[Session],
    *,
    allow_private: bool = False,
    limit: int = 20,
    now: float | None = None,
    backoff: float = BACKOFF_S,
) -> int:
    """Post up to ``limit`` due deliveries; returns how many were attempted."""
    now = time.time() if now is None else now
    with sessions() as db:
        due = db.execute(
            select(m.AlertDelivery.id, m.AlertDelivery.next_at)
            .where(m.AlertDelivery.status == "pending", m.AlertDelivery.next_at <= now)
            .order_by(m.AlertDelivery.next_at)
            .limit(limit)
        ).all()
    attempted = 0
    for delivery_id, next_at in due:
        with sessions() as db:
            # Claimed only if no other process moved it since it was read.
            claimed = db.execute(
                update(m.AlertDelivery)
                .where(
                    m.AlertDelivery.id == delivery_id,
                    m.AlertDelivery.status == "pending",
                    m.AlertDelivery.next_at == next_at,
                )
                .values(next_at=time.time() + LEASE_S)
            ).rowcount
            db.commit()
            delivery = db.get(m.AlertDelivery, delivery_id) if claimed else None
            rule = db.get(m.AlertRule, delivery.rule_id) if delivery else None
            if delivery is None or rule is None:
                continue
            db.expunge_all()  # posted with no transaction open: a receiver may be slow
        status, error = _post(rule, delivery, allow_private)
        attempted += 1
        attempts = delivery.attempts + 1
        values: dict[str, Any] = {
            "attempts": attempts,
            "last_status": status if status > 0 else None,
            "last_error": error or None,
        }
        if 200 <= status < 300:
            values.update(status="delivered", delivered_at=time.time())
        elif _retryable(status) and attempts < MAX_ATTEMPTS:
            values["next_at"] = time.time() + min(backoff * 2 ** (attempts - 1), MAX_BACKOFF_S)
        else:
            values["status"] = "failed"
            logger.warning(
                "alert %s of rule %s failed after %d attempt(s): %s",
                delivery.idempotency_key,
                rule.name,
                attempts,
                error,
            )
        with sessions.begin() as db:
            db.execute(
                update(m.AlertDelivery).where(m.AlertDelivery.id == delivery_id).values(**values)
            )
    return attempted


def list_deliveries(
    db: Session,
    tenant_id: int,
    *,
    rule_id: int | None = None,
    run: str | None = None,
    status: str | None = None,
    limit: int = 100,
) -> list[dict[str, Any]]:
    q = (
        select(m.AlertDelivery, m.AlertRule.name)
        .join(m.AlertRule, m.AlertRule.id == m.AlertDelivery.rule_id)
        .where(m.AlertRule.tenant_id == tenant_id)
        .order_by(m.AlertDelivery.id.desc())
        .limit(limit)
    )
    if rule_id is not None:
        q = q.where(m.AlertDelivery.rule_id == rule_id)
    if run is not None:
        q = q.where(m.AlertDelivery.run == run)
    if status is not None:
        q = q.where(m.AlertDelivery.status == status)
    return [
        {
            "id": d.id,
            "rule": {"id": d.rule_id, "name": name},
            "run": d.run,
            "idempotency_key": d.idempotency_key,
            "reasons": d.reasons,
            "status": d.status,
            "attempts": d.attempts,
            "next_at": d.next_at if d.status == "pending" else None,
            "last_status": d.last_status,
            "last_error": d.last_error,
            "created_at": d.created_at,
            "delivered_at": d.delivered_at,
            "body": d.body,
        }
        for d, name in db.execute(q)
    ]
