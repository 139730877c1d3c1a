"""Alert rules over REST, and their webhooks posted to a real HTTP receiver: signed,
retried until taken, one per (rule, run) however often the run is finished again, and
kept across a restart of the process posting them."""

from __future__ import annotations

import hashlib
import hmac
import time
from typing import Any

import pytest

from storage.alerts import deliver
from storage.core import models as m
from storage.jobs.finish import finish_run
from tests.helpers import auth, post
from tests.query.test_runs import T0, run_batch


def store_of(query: Any) -> Any:
    return query.application.extensions["hindsight"]


def make_rule(query: Any, token: str, **spec: Any) -> dict[str, Any]:
    resp = query.post("/v1/alerts/rules", json=spec, headers=auth(token))
    assert resp.status_code == 201, resp.json
    return resp.json


def erred_run(collector: Any, query: Any, token: str, name: str, cluster: str = "prod") -> dict:
    """A run of ``name`` on ``cluster`` whose scheduler ended it erred, finished: its
    finished-run work done, as the finish worker does it."""
    body = run_batch(cluster, f"s-{name}", name, 0, status="erred")
    body["events"][1]["status"] = "erred"  # one task failed
    body["events"][1]["exception"] = "ValueError('boom')"
    assert post(collector, body, token=token).status_code == 202
    (run,) = [
        r for r in query.get("/v1/runs", headers=auth(token)).json["runs"] if r["run_key"] == name
    ]
    finish(query, run["id"])
    return run


def finish(query: Any, public_id: str) -> None:
    st = store_of(query)
    with st.sessions() as db:
        run_id = db.query(m.Run.id).filter(m.Run.public_id == public_id).scalar()
        assert finish_run(db, st.blobs, run_id) == []
        # done, as the finish worker leaves it: no other process's worker takes it up
        db.query(m.FinishJob).filter(m.FinishJob.run_id == run_id).delete()
        db.commit()


def send(query: Any) -> int:
    st = store_of(query)
    return deliver.deliver_due(st.sessions, allow_private=True, backoff=0.0)


def deliveries(query: Any, token: str, **params: Any) -> list[dict[str, Any]]:
    resp = query.get("/v1/alerts/deliveries", query_string=params, headers=auth(token))
    assert resp.status_code == 200, resp.json
    return resp.json["deliveries"]


def test_rules_are_made_listed_and_removed_per_tenant(apps, make_token, receiver):
    _, query = apps
    admin, reader = make_token(scopes="read,admin"), make_token(scopes="read")
    rule = make_rule(query, admin, name="nightly", url=receiver.url, job="etl*", min_change=0.3)
    assert len(rule["secret"]) == 64 and rule["job"] == "etl*" and rule["format"] == "json"
    listed = query.get("/v1/alerts/rules", headers=auth(admin)).json["rules"]
    assert [r["name"] for r in listed] == ["nightly"] and "secret" not in listed[0]
    # another tenant sees none of it, and cannot remove it
    assert query.get("/v1/alerts/rules", headers=auth(reader)).json["rules"] == []
    other_admin = make_token(scopes="read,admin")
    gone = query.delete(f"/v1/alerts/rules/{rule['id']}", headers=auth(other_admin))
    assert gone.status_code == 404
    # reading is not managing
    refused = query.post("/v1/alerts/rules", json={"name": "x", "url": receiver.url},
                         headers=auth(reader))  # fmt: skip
    assert refused.status_code == 403
    again = query.post("/v1/alerts/rules", json={"name": "nightly", "url": receiver.url},
                       headers=auth(admin))  # fmt: skip
    assert again.status_code == 400 and "exists" in again.json["error"]["message"]
    assert query.delete(f"/v1/alerts/rules/{rule['id']}", headers=auth(admin)).status_code == 200
    assert query.get("/v1/alerts/rules", headers=auth(admin)).json["rules"] == []


@pytest.mark.parametrize(
    "spec, says",
    [
        ({"name": "a", "url": "ftp://example.com/x"}, "http:// or https://"),
        ({"name": "a", "url": "https://u:p@example.com/x"}, "credentials"),
        ({"name": "a", "url": "https://example.com/x", "format": "xml"}, "format"),
        ({"name": "a", "url": "https://example.com/x", "min_change": -1}, "min_change"),
        ({"name": "a", "url": "https://example.com/x", "on_slower": False}, "alerts on"),
        ({"name": "a", "url": "https://example.com/x", "treshold": 1}, "unknown field"),
        ({"url": "https://example.com/x"}, "name"),
    ],
)
def test_a_bad_rule_is_a_400_naming_what_is_wrong(apps, make_token, spec, says):
    _, query = apps
    resp = query.post("/v1/alerts/rules", json=spec, headers=auth(make_token(scopes="admin")))
    assert resp.status_code == 400 and says in resp.json["error"]["message"], resp.json


@pytest.mark.parametrize(
    "url",
    ["http://127.0.0.1:9/x", "http://10.1.2.3/x", "http://[::1]/x", "http://169.254.169.254/"],
)
def test_internal_addresses_are_refused_unless_the_operator_allows_them(stack, make_token, url):
    from services.query.app import create_app

    query = create_app(stack).test_client()  # HINDSIGHT_ALERTS_ALLOW_PRIVATE unset
    resp = query.post("/v1/alerts/rules", json={"name": "a", "url": url},
                      headers=auth(make_token(scopes="admin")))  # fmt: skip
    assert resp.status_code == 400
    assert "HINDSIGHT_ALERTS_ALLOW_PRIVATE" in resp.json["error"]["message"]


def test_an_erred_run_is_posted_signed_retried_until_taken_and_once(apps, make_token, receiver):
    collector, query = apps
    token = make_token(scopes="ingest,read,admin")
    rule = make_rule(query, token, name="failures", url=receiver.url, on_failures=True,
                     on_slower=False, cluster="prod")  # fmt: skip
    receiver.answers = [503, 500]  # down twice, then up
    run = erred_run(collector, query, token, "etl-1")
    (queued,) = deliveries(query, token, run=run["id"])
    assert queued["status"] == "pending" and queued["reasons"] == ["failures"]

    deadline = time.monotonic() + 30
    while deliveries(query, token, run=run["id"])[0]["status"] == "pending":
        send(query)
        assert time.monotonic() < deadline, "never delivered"
    (done,) = deliveries(query, token, run=run["id"])
    assert (done["status"], done["attempts"], done["last_status"]) == ("delivered", 3, 200)
    posts = receiver.wait_for(3)
    assert len(posts) == 3
    # every attempt the same alert, under the same idempotency key, signed with the secret
    assert {p["headers"]["X-Hindsight-Delivery"] for p in posts} == {done["idempotency_key"]}
    for p in posts:
        mac = hmac.new(rule["secret"].encode(), p["raw"], hashlib.sha256).hexdigest()
        assert p["headers"]["X-Hindsight-Signature"] == f"sha256={mac}"
    body = posts[-1]["body"]
    assert body["reasons"] == ["failures"] and body["run"]["id"] == run["id"]
    assert body["run"]["error_count"] == 1 and body["rule"]["name"] == "failures"
    # the run finished again (a late batch, a reindex): no second alert
    finish(query, run["id"])
    assert send(query) == 0 and len(deliveries(query, token)) == 1
    # a run on another cluster, or of a tenant without rules, raises none
    erred_run(collector, query, token, "etl-2", cluster="dev")
    erred_run(collector, query, make_token(), "etl-3")
    assert send(query) == 0 and len(receiver.posts) == 3


def test_a_refused_alert_fails_at_once_and_says_why(apps, make_token, receiver):
    collector, query = apps
    token = make_token(scopes="ingest,read,admin")
    make_rule(query, token, name="f", url=receiver.url, on_failures=True)
    receiver.answers = [410]
    run = erred_run(collector, query, token, "gone-1")
    assert send(query) == 1
    (d,) = deliveries(query, token, run=run["id"])
    assert (d["status"], d["attempts"], d["last_status"]) == ("failed", 1, 410)
    assert "410" in d["last_error"]
    assert deliveries(query, token, status="failed")[0]["id"] == d["id"]


def test_a_slack_rule_posts_a_slack_message(apps, make_token, receiver):
    collector, query = apps
    token = make_token(scopes="ingest,read,admin")
    make_rule(query, token, name="s", url=receiver.url, format="slack", on_failures=True)
    run = erred_run(collector, query, token, "etl-s")
    assert send(query) == 1
    (p,) = receiver.wait_for(1)
    assert "X-Hindsight-Signature" not in p["headers"]
    assert "etl-s on prod had 1 failed task(s)" in p["body"]["text"]
    assert p["body"]["blocks"][0]["type"] == "section"
    assert run["id"] in p["body"]["blocks"][1]["elements"][0]["text"]


def test_a_pending_alert_survives_a_restart_of_the_process(stack, apps, make_token, receiver):
    collector, query = apps
    token = make_token(scopes="ingest,read,admin")
    make_rule(query, token, name="f", url=receiver.url, on_failures=True)
    run = erred_run(collector, query, token, "etl-r")
    store_of(query).engine.dispose()  # the process goes away before posting it
    from services.query.app import create_app

    after = create_app({**stack, "alerts_allow_private": True}).test_client()
    assert send(after) == 1
    (d,) = deliveries(after, token, run=run["id"])
    assert d["status"] == "delivered" and receiver.wait_for(1)[0]["body"]["run"]["id"] == run["id"]


def test_slower_runs_alert_by_their_change(apps, make_token, receiver):
    """A rule on slower runs fires on a run its explanation judges slower by at least the
    rule's change, and not on a smaller change or another verdict."""
    collector, query = apps
    token = make_token(scopes="ingest,read,admin")
    make_rule(query, token, name="slow", url=receiver.url, job="etl*", min_change=0.3)
    post(collector, run_batch("prod", "s-x", "x", 0), token=token)
    st = store_of(query)
    with st.sessions() as db:
        run = db.query(m.Run).filter(m.Run.run_key == "x", m.Run.status == "finished").one()
        run.name = "etl-nightly"
        verdicts = [
            ({"verdict": "slower", "change": 0.2, "text": "a bit"}, 0),
            ({"verdict": "normal", "change": 0.9}, 0),
            ({"verdict": "slower", "change": 0.45, "text": "call_api waited"}, 1),
        ]
        for explanation, new in verdicts:
            assert deliver.enqueue(db, run, "prod", explanation) == new
        db.commit()
    assert send(query) == 1
    (p,) = receiver.wait_for(1)
    assert p["body"]["reasons"] == ["slower"] and p["body"]["change"] == 0.45
    assert "45% slower than usual. call_api waited" in p["body"]["text"]


def test_a_run_its_explanation_judges_slower_is_posted_with_the_why(apps, make_token, receiver):
    """Five usual runs of a nightly job, then one three times as long: its finished-run work
    explains it (verdict slower) and the rule on that job posts it, with the paragraph and
    the findings; the usual runs raise nothing."""
    collector, query = apps
    token = make_token(scopes="ingest,read,admin")
    make_rule(query, token, name="slower", url=receiver.url, job="etl-nightly", min_change=0.5)

    def nightly(i: int, stretch: float) -> str:
        body = run_batch("prod", f"night-{i}", f"n{i}", 0, n_tasks=6, t=T0 + 86400 * i)
        body["events"][0]["name"] = "etl-nightly"
        for k, ev in enumerate(body["events"][1:-1]):
            (ss,) = ev["startstops"]
            ss["start"] = T0 + 86400 * i + k * stretch  # one after another, each longer
            ss["stop"] = ss["start"] + 0.5 * stretch
        body["events"][-1]["time"] = max(ev["startstops"][0]["stop"] for ev in body["events"][1:-1])
        assert post(collector, body, token=token).status_code == 202
        (run,) = [r for r in query.get("/v1/runs", headers=auth(token)).json["runs"]
                  if r["run_key"] == f"n{i}"]  # fmt: skip
        finish(query, run["id"])
        return run["id"]

    usual = [nightly(i, 1.0 + 0.02 * (i % 3)) for i in range(5)]
    assert send(query) == 0 and deliveries(query, token) == []
    slow = nightly(5, 3.0)
    explained = query.get(f"/v1/runs/{slow}/explain", headers=auth(token)).json
    assert explained["verdict"] == "slower" and explained["change"] >= 0.5, explained
    assert send(query) == 1
    (p,) = receiver.wait_for(1)
    body = p["body"]
    assert body["run"]["id"] == slow and body["reasons"] == ["slower"]
    assert body["verdict"] == "slower" and body["change"] == explained["change"]
    assert explained["text"] in body["text"] and body["findings"] == explained["findings"][:5]
    assert not {d["run"] for d in deliveries(query, token)} & set(usual)
