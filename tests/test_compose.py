"""The full-stack deployment files, checked without a Docker engine.

docker-compose.yml is parsed with PyYAML and its `${VAR:-default}` references are resolved to
their defaults the way `docker compose` would with no .env file; the Dockerfile is read as text.
The checks tie the deployment to the code: every HINDSIGHT_* variable must be one the services
read (storage.core.config.ENVIRONMENT), and every gunicorn command must name an app factory that
exists.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from storage.core.config import ENVIRONMENT, load_settings

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
ENV_EXAMPLE = ROOT / ".env.example"
DEPLOY_DOC = ROOT / "docs" / "deploy.md"

LONG_RUNNING = ("postgres", "minio", "collector", "query")
ONE_SHOT = ("createbucket", "migrate")
HINDSIGHT_SERVICES = ("migrate", "collector", "query")
HTTP_SERVICES = {"collector": 8700, "query": 8701}
FACTORIES = {"collector": "collector.app:create_app()", "query": "services.query.app:create_app()"}

# ${VAR}, ${VAR:-default} or ${VAR-default}; `$$` is compose's escape for a literal `$`.
_REFERENCE = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?::?-([^}]*))?\}")


def _interpolate(text: str) -> str:
    """``text`` as compose sees it with no .env file: every reference takes its default."""

    def replace(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        return match.group(2) or ""

    return _REFERENCE.sub(replace, text)


def _resolve(value: Any) -> Any:
    if isinstance(value, str):
        return _interpolate(value)
    if isinstance(value, list):
        return [_resolve(item) for item in value]
    if isinstance(value, dict):
        return {key: _resolve(item) for key, item in value.items()}
    return value


def _references(value: Any) -> dict[str, str]:
    """Every ``${VAR:-default}`` in ``value``: variable name -> default."""
    found: dict[str, str] = {}
    if isinstance(value, str):
        for match in _REFERENCE.finditer(value):
            if match.group(1):
                found[match.group(1)] = match.group(2) or ""
    elif isinstance(value, list):
        for item in value:
            found.update(_references(item))
    elif isinstance(value, dict):
        for item in value.values():
            found.update(_references(item))
    return found


def _environment(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {key: str(value) for key, value in env.items()}


def _command(service: dict[str, Any]) -> list[str]:
    command = service.get("command") or []
    return command.split() if isinstance(command, str) else [str(part) for part in command]


@pytest.fixture(scope="module")
def raw() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


@pytest.fixture(scope="module")
def services(raw: dict[str, Any]) -> dict[str, Any]:
    return _resolve(raw["services"])


def test_services_present(services: dict[str, Any]) -> None:
    assert set(LONG_RUNNING + ONE_SHOT) <= set(services)


def test_valid_for_compose_v1_and_v2(raw: dict[str, Any]) -> None:
    # docker-compose 1.29 (Debian's) rejects a top-level `name:` and anything but these; the
    # project name comes from -p or COMPOSE_PROJECT_NAME (.env.example) instead.
    allowed = {"version", "services", "networks", "volumes", "secrets", "configs"}
    assert [k for k in raw if k not in allowed and not k.startswith("x-")] == []


@pytest.mark.parametrize(
    "override", sorted(ROOT.glob("docker/compose.*.yml")), ids=lambda p: p.name
)
def test_test_overrides_only_touch_services_of_the_compose_file(
    services: dict[str, Any], override: Path
) -> None:
    extra = yaml.safe_load(override.read_text())
    assert set(extra) == {"services"}
    assert set(extra["services"]) <= set(services), override.name


@pytest.mark.parametrize(("name", "port"), sorted(HTTP_SERVICES.items()))
def test_service_port_published(services: dict[str, Any], name: str, port: int) -> None:
    published = {str(spec).rsplit(":", 1)[-1] for spec in services[name].get("ports", [])}
    assert str(port) in published
    assert f"0.0.0.0:{port}" in " ".join(_command(services[name]))


def test_no_fixed_container_names(services: dict[str, Any]) -> None:
    # A container_name would stop `docker compose up --scale collector=N`.
    assert not [name for name, service in services.items() if "container_name" in service]


@pytest.mark.parametrize("name", LONG_RUNNING)
def test_long_running_service_has_healthcheck(services: dict[str, Any], name: str) -> None:
    healthcheck = services[name].get("healthcheck")
    assert healthcheck and healthcheck.get("test"), f"{name} has no healthcheck"
    assert not healthcheck.get("disable", False)
    assert services[name].get("restart") in ("unless-stopped", "always")


@pytest.mark.parametrize(("name", "port"), sorted(HTTP_SERVICES.items()))
def test_http_healthcheck_probes_readyz_without_curl(
    services: dict[str, Any], name: str, port: int
) -> None:
    probe = " ".join(services[name]["healthcheck"]["test"])
    assert f"http://127.0.0.1:{port}/readyz" in probe
    assert "curl" not in probe and "wget" not in probe  # the slim image has neither


@pytest.mark.parametrize("name", ONE_SHOT)
def test_one_shot_services_do_not_restart(services: dict[str, Any], name: str) -> None:
    assert services[name].get("restart", "no") == "no"


@pytest.mark.parametrize(
    ("name", "dependency", "condition"),
    [
        ("collector", "migrate", "service_completed_successfully"),
        ("query", "migrate", "service_completed_successfully"),
        ("migrate", "postgres", "service_healthy"),
        ("migrate", "createbucket", "service_completed_successfully"),
        ("createbucket", "minio", "service_healthy"),
    ],
)
def test_dependency_condition(
    services: dict[str, Any], name: str, dependency: str, condition: str
) -> None:
    depends_on = services[name].get("depends_on")
    assert isinstance(depends_on, dict), f"{name}: depends_on needs conditions"
    assert depends_on[dependency]["condition"] == condition


def test_every_dependency_has_a_condition(services: dict[str, Any]) -> None:
    for name, service in services.items():
        for dependency, spec in (service.get("depends_on") or {}).items():
            assert dependency in services, f"{name} depends on unknown {dependency}"
            assert spec.get("condition") in (
                "service_healthy",
                "service_completed_successfully",
            ), f"{name} -> {dependency}"


@pytest.mark.parametrize("name", HINDSIGHT_SERVICES)
def test_hindsight_variables_are_read_by_the_code(services: dict[str, Any], name: str) -> None:
    env = _environment(services[name])
    unknown = sorted(var for var in env if var.startswith("HINDSIGHT_") and var not in ENVIRONMENT)
    assert not unknown, f"{name} sets variables no service reads: {unknown}"
    assert {"HINDSIGHT_DATABASE_URL", "HINDSIGHT_BLOB_URL"} <= set(env)


@pytest.mark.parametrize("name", ["collector", "query"])
def test_gunicorn_services_answer_metrics_for_every_worker(
    services: dict[str, Any], name: str
) -> None:
    """Without PROMETHEUS_MULTIPROC_DIR each scrape reads one gunicorn worker's counters."""
    assert _environment(services[name]).get("PROMETHEUS_MULTIPROC_DIR", "").startswith("/")


@pytest.mark.parametrize("name", HINDSIGHT_SERVICES)
def test_service_environment_loads(services: dict[str, Any], name: str) -> None:
    env = _environment(services[name])
    settings = load_settings(environ=env)
    assert settings.database_url.startswith("postgresql+psycopg2://")
    assert settings.blob_url.startswith("s3://")
    assert settings.s3_endpoint_url == "http://minio:9000"
    assert settings.auth_required, "the full stack must require tokens by default"
    assert settings.auto_upgrade is False, "the migrate service owns the schema"


def test_compose_defaults_match_code_defaults(raw: dict[str, Any]) -> None:
    # A pass-through like HINDSIGHT_LOG_LEVEL: ${HINDSIGHT_LOG_LEVEL:-INFO} must default to
    # what the code would use if the variable were unset; only the S3 endpoint differs on
    # purpose (MinIO in compose, AWS when unset).
    code_defaults = load_settings(environ={"HINDSIGHT_BLOB_URL": "s3://bucket/prefix"})
    for name in HINDSIGHT_SERVICES:
        for var, value in _environment(raw["services"][name]).items():
            match = re.fullmatch(r"\$\{(\w+):-([^}]*)\}", value)
            if var not in ENVIRONMENT or not match or match.group(1) != var:
                continue
            if var == "HINDSIGHT_S3_ENDPOINT_URL":
                continue
            field = ENVIRONMENT[var][0]
            in_compose = load_settings(
                environ={"HINDSIGHT_BLOB_URL": "s3://bucket/prefix", var: match.group(2)}
            )
            assert getattr(in_compose, field) == getattr(code_defaults, field), var


@pytest.mark.parametrize(("name", "factory"), sorted(FACTORIES.items()))
def test_gunicorn_runs_an_existing_app_factory(
    services: dict[str, Any], name: str, factory: str
) -> None:
    command = _command(services[name])
    assert command[0] == "gunicorn"
    assert "--worker-class=gthread" in command or "gthread" in command
    targets = [part for part in command if re.fullmatch(r"[\w.]+:\w+\(\)", part)]
    assert targets == [factory]
    module_name, _, call = factory.partition(":")
    module = importlib.import_module(module_name)
    assert callable(getattr(module, call.removesuffix("()")))
    # The shared gunicorn config (gc.freeze after start-up, for ack latency) is loaded.
    (config,) = [p.split("=", 1)[1] for p in command if p.startswith("--config=")]
    conf = importlib.import_module(config.removeprefix("python:"))
    assert callable(conf.post_worker_init)


def test_shared_settings_are_identical(services: dict[str, Any]) -> None:
    envs = [_environment(services[name]) for name in HINDSIGHT_SERVICES]
    assert all(env == envs[0] for env in envs[1:])


def test_blob_bucket_is_the_bucket_createbucket_makes(services: dict[str, Any]) -> None:
    blob_url = urlsplit(_environment(services["collector"])["HINDSIGHT_BLOB_URL"])
    assert blob_url.scheme == "s3"
    bucket_env = _environment(services["createbucket"])["BUCKET"]
    script = " ".join(_command(services["createbucket"]))
    made = re.search(r"mc mb --ignore-existing \"?[\w-]+/(\$\{BUCKET\}|[\w.-]+)\"?", script)
    assert made, "createbucket does not run `mc mb --ignore-existing`"
    made_bucket = bucket_env if made.group(1) == "${BUCKET}" else made.group(1)
    assert blob_url.netloc == made_bucket


def test_credentials_agree(services: dict[str, Any]) -> None:
    app_env = _environment(services["collector"])
    postgres = _environment(services["postgres"])
    minio = _environment(services["minio"])
    database = urlsplit(app_env["HINDSIGHT_DATABASE_URL"])
    assert (database.username, database.password) == (
        postgres["POSTGRES_USER"],
        postgres["POSTGRES_PASSWORD"],
    )
    assert (database.hostname, database.port) == ("postgres", 5432)
    assert database.path == f"/{postgres['POSTGRES_DB']}"
    assert app_env["AWS_ACCESS_KEY_ID"] == minio["MINIO_ROOT_USER"]
    assert app_env["AWS_SECRET_ACCESS_KEY"] == minio["MINIO_ROOT_PASSWORD"]
    assert len(minio["MINIO_ROOT_PASSWORD"]) >= 8  # MinIO refuses to start otherwise


def test_secrets_are_overridable_dev_defaults(raw: dict[str, Any]) -> None:
    # Every password is a ${VAR:-default} reference, so a .env file overrides it, and the
    # default says plainly that it is for development.
    for name, service in raw["services"].items():
        for var, value in _environment(service).items():
            if "PASSWORD" in var or "SECRET" in var:
                refs = _references(value)
                assert refs, f"{name}.{var} is hard-coded"
                assert all("dev-only" in default for default in refs.values()), var


def test_volumes_are_named(raw: dict[str, Any]) -> None:
    assert {"postgres-data", "minio-data"} <= set(raw.get("volumes") or {})
    assert "postgres-data:/var/lib/postgresql/data" in raw["services"]["postgres"]["volumes"]
    assert "minio-data:/data" in raw["services"]["minio"]["volumes"]


def test_env_example_documents_every_variable(raw: dict[str, Any]) -> None:
    example: dict[str, str] = {}
    for line in ENV_EXAMPLE.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, _, value = line.partition("=")
            example[key.strip()] = value.strip()
    references = _references(raw)
    assert sorted(set(references) - set(example)) == []
    # COMPOSE_PROJECT_NAME is Compose's own (the project name, for v1 and v2 alike).
    assert sorted(set(example) - set(references) - {"COMPOSE_PROJECT_NAME"}) == []
    differing = {var: (example[var], references[var]) for var in references}
    assert {var: pair for var, pair in differing.items() if pair[0] != pair[1]} == {}


def test_deploy_doc_lists_every_setting() -> None:
    text = DEPLOY_DOC.read_text()
    assert [var for var in ENVIRONMENT if f"`{var}`" not in text] == []


def _dockerfile_instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    instructions = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            instructions.append((keyword.upper(), rest.strip()))
    return instructions


def test_dockerfile_installs_the_server_extra_only() -> None:
    instructions = _dockerfile_instructions()
    installs = [
        rest for keyword, rest in instructions if keyword == "RUN" and "pip install" in rest
    ]
    assert any("'.[server]'" in rest or '".[server]"' in rest for rest in installs)
    assert not any(re.search(r"\[[^\]]*\b(test|dev)\b", rest) for rest in installs)
    assert ("ARG", "PYTHON_IMAGE=python:3.11-slim") in instructions
    bases = [rest.split()[0] for keyword, rest in instructions if keyword == "FROM"]
    assert bases and set(bases) == {"${PYTHON_IMAGE}"}


def test_dockerfile_runs_as_non_root_without_secrets() -> None:
    instructions = _dockerfile_instructions()
    users = [rest for keyword, rest in instructions if keyword == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    for keyword, rest in instructions:
        if keyword in ("ENV", "ARG"):
            assert not re.search(r"PASSWORD|SECRET|TOKEN|ACCESS_KEY", rest), rest


def test_dockerignore_keeps_secrets_and_venv_out() -> None:
    ignored = {line.strip() for line in DOCKERIGNORE.read_text().splitlines()}
    assert {".env", ".git", ".venv"} <= ignored
