"""A rule made with the CLI, a real Dask run with a failed task recorded by ``hindsight
serve``, and the alert posted by the server's own sender thread to a real receiver."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid

import pytest

from tests.dask.conftest import EmbeddedServer, wait_for_run, wait_until


def fails_on_three(i: int) -> int:
    if i == 3:
        raise ValueError("three is not allowed")
    return i


def cli(server: EmbeddedServer, *args: str) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "hindsight.cli", "alerts", *args, "--url", server.url],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def test_a_failed_dask_run_is_posted_to_the_rules_webhook(tmp_path, receiver):
    import dask
    from distributed import Client, LocalCluster, span

    server = EmbeddedServer(
        tmp_path / "data",
        env={
            "HINDSIGHT_ALERTS_ALLOW_PRIVATE": "true",
            "HINDSIGHT_FINISH_SETTLE_SECONDS": "0.2",
        },
    )
    server.start()
    cluster = f"alerts-{uuid.uuid4().hex[:8]}"
    try:
        rule = json.loads(cli(server, "add", "nightly failures", "--webhook", receiver.url,
                              "--job", "nightly-*", "--failures", "--no-slower"))  # fmt: skip
        assert rule["on_failures"] and not rule["on_slower"] and len(rule["secret"]) == 64
        assert json.loads(cli(server, "list"))["name"] == "nightly failures"
        config = {"hindsight.url": server.url, "hindsight.cluster": cluster}
        with dask.config.set(config), LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0",
            scheduler_kwargs={"preload": ["hindsight.dask"]},
        ) as lc, Client(lc) as client:  # fmt: skip
            with span("nightly-etl"):
                futures = client.map(fails_on_three, range(8))
                with pytest.raises(ValueError):
                    client.gather(futures)
                client.gather(futures, errors="skip")
            with span("adhoc"):  # another job: no alert
                futures = client.map(fails_on_three, [3, 4], key=["adhoc-3", "adhoc-4"])
                client.gather(futures, errors="skip")
        run = wait_for_run(server, cluster, "nightly-etl", 8, status="erred")
        (post,) = receiver.wait_for(1)
        body = post["body"]
        assert body["run"]["id"] == run["id"] and body["reasons"] == ["failures"]
        assert body["run"]["error_count"] == 1 and body["run"]["cluster"] == cluster
        assert post["headers"]["X-Hindsight-Signature"].startswith("sha256=")

        def delivered() -> str:
            out = cli(server, "deliveries")
            return out if "\tdelivered\t1\t200" in out else ""

        lines = wait_until(delivered, 30, "the delivery to read delivered").splitlines()
        assert len(lines) == 2 and run["id"] in lines[1]  # header + the one alert
        wait_for_run(server, cluster, "adhoc", 2, status="erred")
        assert len(receiver.posts) == 1
        cli(server, "rm", str(rule["id"]))
        assert cli(server, "list") == ""
    finally:
        server.stop()
