"""``/v1/alerts/...``: a tenant's alert rules and what they delivered.

- ``POST /v1/alerts/rules`` (scope ``admin``): make a rule; the answer holds its signing
  ``secret``, shown this once.
- ``GET /v1/alerts/rules``, ``DELETE /v1/alerts/rules/{id}`` (``admin`` to delete).
- ``GET /v1/alerts/deliveries``: the alerts posted or still being tried, newest first.
"""

from __future__ import annotations

from typing import Any

from flask import Blueprint, request

from services.common.params import arg, choice_arg, int_arg
from services.common.web import ApiError, db, require, store
from storage.alerts import deliver, rules

bp = Blueprint("alerts", __name__)

DELIVERY_STATUSES = ("pending", "delivered", "failed")


@bp.post("/v1/alerts/rules")
def create_rule() -> Any:
    principal = require("admin")
    spec = request.get_json(silent=True)
    if not isinstance(spec, dict):
        raise ApiError(400, "invalid_rule", "the body must be a JSON object")
    try:
        made = rules.create_rule(
            db(),
            principal.tenant_id,
            spec,
            allow_private=store().settings.alerts_allow_private,
        )
    except rules.RuleError as exc:
        raise ApiError(400, "invalid_rule", str(exc)) from None
    db().commit()
    return made, 201


@bp.get("/v1/alerts/rules")
def list_rules() -> Any:
    principal = require("read")
    return {"rules": rules.list_rules(db(), principal.tenant_id)}


@bp.delete("/v1/alerts/rules/<rule_id>")
def delete_rule(rule_id: str) -> Any:
    principal = require("admin")  # before the id is looked at: a stranger gets 401
    if not rule_id.isdigit() or not rules.delete_rule(db(), principal.tenant_id, int(rule_id)):
        raise ApiError(404, "not_found", f"no alert rule {rule_id} for this tenant")
    db().commit()
    return {"deleted": int(rule_id)}


@bp.get("/v1/alerts/deliveries")
def deliveries() -> Any:
    principal = require("read")
    rule = arg("rule")
    if rule is not None and not rule.isdigit():
        raise ApiError(400, "invalid_parameter", "rule: must be a rule id")
    return {
        "deliveries": deliver.list_deliveries(
            db(),
            principal.tenant_id,
            rule_id=int(rule) if rule is not None else None,
            run=arg("run", 64),
            status=choice_arg("status", DELIVERY_STATUSES),
            limit=int_arg("limit", 100, 1, 1000),
        )
    }
