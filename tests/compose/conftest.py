"""The full stack brought up for real with docker compose (``make test-compose``).

These tests run only when selected with ``-m compose``: they need a Docker engine, Compose and
the images docker/prepare.sh builds (it writes the env file they read), and they take minutes.
``make test`` skips them; ``make lint`` checks them like every other file.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from tests.dask.conftest import free_port, wait_until

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "test-artifacts" / "compose"
ENV_FILE = Path(os.environ.get("HINDSIGHT_COMPOSE_ENV", ARTIFACTS / "images.env"))
PROJECT = "hindsight-compose-test"
LONG_RUNNING = ("postgres", "minio", "collector", "query")
ONE_SHOT = ("createbucket", "migrate")

#: What the run measured, printed at the end and written to test-artifacts/compose/figures.json.
FIGURES: dict[str, Any] = {}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if "compose" in (config.getoption("markexpr") or ""):
        return
    skip = pytest.mark.skip(reason="compose: run with make test-compose")
    for item in items:
        if item.get_closest_marker("compose"):
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not FIGURES:
        return
    FIGURES["load_average_at_end"] = load_average()
    terminalreporter.section("make test-compose: what it measured")
    for key, value in FIGURES.items():
        terminalreporter.write_line(f"{key}: {value}")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    (ARTIFACTS / "figures.json").write_text(json.dumps(FIGURES, indent=2) + "\n")


def load_average() -> str:
    """The host's 1, 5 and 15 minute load averages: every timing here depends on them."""
    return " / ".join(f"{x:.1f}" for x in os.getloadavg())


def read_env_file(path: Path) -> dict[str, str]:
    if not path.exists():
        pytest.fail(f"{path} is missing: run `make test-compose` (docker/prepare.sh writes it)")
    out = {}
    for line in path.read_text().splitlines():
        key, sep, value = line.partition("=")
        if sep:
            out[key.strip()] = value.strip()
    return out


class Stack:
    """One compose project of the repository's docker-compose.yml plus the test overrides."""

    def __init__(self, images: dict[str, str]) -> None:
        self.images = images
        self.command = shlex.split(images["HINDSIGHT_TEST_COMPOSE"])
        self.files = images["HINDSIGHT_TEST_COMPOSE_FILES"].split(":")
        # Compose reads the images and ports from its environment; ports are free ones, not
        # 8700/8701, so a test run never collides with a stack already on this host.
        self.settings = dict(images)
        self.settings.update(
            COLLECTOR_PORT=str(free_port()),
            QUERY_PORT=str(free_port()),
            MINIO_CONSOLE_PORT=str(free_port()),
        )
        self.token = ""
        self.logs_saved = False

    @property
    def prefix(self) -> list[str]:
        """``docker compose`` as a user types it, with the project and the override files."""
        files = [part for f in self.files for part in ("-f", f)]
        return [*self.command, "-p", PROJECT, *files]

    def env(self) -> dict[str, str]:
        # The host's own HINDSIGHT_* settings must not leak into the stack's interpolation.
        base = {k: v for k, v in os.environ.items() if not k.startswith("HINDSIGHT_")}
        return {**base, **self.settings}

    def run(self, args: list[str], *, check: bool = True, timeout: float = 1200) -> Any:
        result = subprocess.run(
            args, cwd=ROOT, env=self.env(), capture_output=True, text=True, timeout=timeout,
            stdin=subprocess.DEVNULL,
        )  # fmt: skip
        if check and result.returncode != 0:
            raise AssertionError(
                f"{shlex.join(args)} exited {result.returncode}\n{result.stdout}\n{result.stderr}"
            )
        return result

    def compose(self, *args: str, **kwargs: Any) -> Any:
        return self.run([*self.prefix, *args], **kwargs)

    def containers(self, service: str) -> list[str]:
        out = self.compose("ps", "-q", service).stdout.split()
        return sorted(out, key=lambda cid: self.inspect(cid)["Name"])

    def inspect(self, container: str) -> dict[str, Any]:
        return json.loads(self.run(["docker", "inspect", container]).stdout)[0]

    def state(self, service: str, index: int = 0) -> dict[str, Any]:
        return self.inspect(self.containers(service)[index])["State"]

    def restarts(self, service: str, index: int = 0) -> int:
        """How often the restart policy restarted the container."""
        return self.inspect(self.containers(service)[index])["RestartCount"]

    def healthy(self, *services: str) -> bool:
        for service in services:
            for cid in self.containers(service) or [""]:
                state = self.inspect(cid)["State"] if cid else {}
                if state.get("Health", {}).get("Status") != "healthy":
                    return False
        return True

    def wait_healthy(self, *services: str, timeout: float = 300) -> float:
        start = time.monotonic()
        wait_until(lambda: self.healthy(*services), timeout, f"{services} healthy")
        return time.monotonic() - start

    def port(self, service: str, private: int, index: int = 1) -> int:
        out = self.compose("port", f"--index={index}", service, str(private)).stdout.strip()
        return int(out.rsplit(":", 1)[1])

    def kill9(self, service: str, index: int = 0) -> str:
        """``kill -9`` the container's main process from the host: a crash, which the restart
        policy answers (``docker kill`` counts as a deliberate stop and is not restarted)."""
        container = self.containers(service)[index]
        state = self.inspect(container)["State"]
        assert state["Running"] and state["Pid"] > 0, state
        os.kill(state["Pid"], signal.SIGKILL)
        return container

    def save_logs(self) -> None:
        """Every service's log to test-artifacts/compose/stack.log (while the stack is up)."""
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        logs = self.compose("logs", "--no-color", check=False)
        (ARTIFACTS / "stack.log").write_text(logs.stdout + logs.stderr)
        self.logs_saved = True

    def leftovers(self) -> dict[str, list[str]]:
        label = f"label=com.docker.compose.project={PROJECT}"
        return {
            kind: self.run(["docker", *cmd, "--filter", label, "-q"]).stdout.split()
            for kind, cmd in (
                ("containers", ["ps", "-a"]),
                ("networks", ["network", "ls"]),
                ("volumes", ["volume", "ls"]),
            )
        }


@pytest.fixture(scope="session")
def images() -> dict[str, str]:
    env = read_env_file(ENV_FILE)
    FIGURES["registry"] = (
        "yes" if env.get("HINDSIGHT_TEST_REGISTRY") == "1" else "none: local images"
    )
    FIGURES["compose"] = env["HINDSIGHT_TEST_COMPOSE"]
    FIGURES["load_average_at_start"] = load_average()
    for item in env.get("HINDSIGHT_TEST_PREPARE_FIGURES", "").split():
        key, _, value = item.partition("=")
        FIGURES[f"prepare_{key}"] = float(value)
    return env
