"""Settings resolution: arguments > Dask config > environment > defaults."""

from __future__ import annotations

import pytest

from hindsight.config import Settings, load_settings


def test_defaults_disable_the_agent():
    settings = load_settings(environ={}, dask_config={})
    assert settings == Settings()
    assert not settings.enabled
    assert settings.spool_max_bytes == 256 * 1024 * 1024
    assert (settings.flush_events, settings.flush_interval) == (5000, 1.0)


def test_environment_variables_are_read():
    env = {
        "HINDSIGHT_URL": "http://c:8080/",
        "HINDSIGHT_TOKEN": "t0k",
        "HINDSIGHT_CLUSTER": "prod-etl",
        "HINDSIGHT_FLUSH_INTERVAL": "0.5",
        "HINDSIGHT_SPOOL_MAX_BYTES": "1024",
    }
    s = load_settings(environ=env, dask_config={})
    assert (s.url, s.token, s.cluster) == ("http://c:8080", "t0k", "prod-etl")
    assert (s.flush_interval, s.spool_max_bytes) == (0.5, 1024)


def test_dask_config_beats_environment_and_arguments_beat_both():
    env = {"HINDSIGHT_URL": "http://env", "HINDSIGHT_CLUSTER": "from-env"}
    dconf = {"url": "http://dask", "cluster": "from-dask", "flush-events": 10}
    s = load_settings(environ=env, dask_config=dconf)
    assert (s.url, s.cluster, s.flush_events) == ("http://dask", "from-dask", 10)
    s = load_settings({"cluster": "from-arg"}, environ=env, dask_config=dconf)
    assert (s.url, s.cluster) == ("http://dask", "from-arg")


def test_invalid_values_fall_back_with_a_warning(caplog):
    env = {
        "HINDSIGHT_URL": "ftp://nope",
        "HINDSIGHT_CLUSTER": "../etc",
        "HINDSIGHT_FLUSH_EVENTS": "many",
        "HINDSIGHT_WORKER_LOG_LEVEL": "LOUD",
    }
    s = load_settings(environ=env, dask_config={})
    assert (s.url, s.flush_events, s.log_level) == (None, 5000, "WARNING")
    assert caplog.text.count("ignoring invalid") == 3
    # A cluster name is made valid, and the warning says what it became.
    assert s.cluster == "etc"
    assert "recording as cluster 'etc'" in caplog.text


@pytest.mark.parametrize(
    "given,recorded",
    [("my cluster", "my-cluster"), ("prod/eu west", "prod-eu-west"), (".hidden", "hidden"),
     ("x" * 200, "x" * 128), ("é", "default"), ("-", "default")],
)  # fmt: skip
def test_an_invalid_cluster_name_is_recorded_under_a_valid_one_it_names(caplog, given, recorded):
    """``cluster="my cluster"`` was recorded under ``default``, the
    log saying only that the argument was ignored."""
    s = load_settings({"cluster": given}, environ={}, dask_config={})
    assert s.cluster == recorded
    if recorded == "default":
        assert "ignoring invalid argument cluster" in caplog.text
    else:
        assert f"recording as cluster {recorded!r}" in caplog.text


def test_dask_config_keys_are_read_from_dask():
    import dask

    with dask.config.set({"hindsight.url": "http://from-dask-config", "hindsight.cluster": "x"}):
        s = load_settings(environ={})
    assert (s.url, s.cluster) == ("http://from-dask-config", "x")
