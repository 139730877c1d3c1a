"""What a new user meets first: the `serve` banner names the dashboard, and ticking more than
two runs for "compare" offers the pairs instead of a bare error."""

from __future__ import annotations

import re

from tests.helpers import auth, post
from tests.query.test_runs import T0, run_batch
from tests.test_cli import Served


def test_the_serve_banner_names_the_dashboard(tmp_path):
    server = Served(tmp_path)
    banner = server.stop()
    assert f"dashboard:  {server.url}/" in banner, banner


def test_three_runs_ticked_offer_their_three_pairs(apps, make_token):
    collector, query = apps
    token = make_token()
    h = auth(token)
    for i in range(3):
        body = run_batch("c", "s", f"r{i}", 0, t=T0 + 3600 * i)
        body["seq"] = i
        assert post(collector, body, token=token).status_code == 202
    runs = query.get("/v1/runs", headers=h).json["runs"]
    page = query.get("/compare", query_string={"run": [r["id"] for r in runs]}, headers=h)
    assert page.status_code == 400
    html = page.data.decode()
    assert "3 runs were ticked" in html
    links = re.findall(r'href="(/compare\?a=[^"]+)"', html)
    assert len(links) == 3
    oldest = min(runs, key=lambda r: r["started_at"])["id"]
    assert sum(f"a={oldest}" in link for link in links) == 2  # the earliest is A of both
    pair = query.get(links[0].replace("&amp;", "&"), headers=h)
    assert pair.status_code == 200 and b"<title>Compare" in pair.data
