"""Import boundaries: the SDK runs inside Dask workers; storage never imports a service; the
collector and the query service meet only in the embedded server; readers never import
the writer; no two modules import each other."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("hindsight", "collector", "storage", "services", "migrations")
SERVER_PACKAGES = ("flask", "sqlalchemy", "boto3", "botocore", "psycopg2", "alembic", "werkzeug")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def first_party_modules() -> dict[str, Path]:
    return {
        module_name(p): p
        for pkg in PACKAGES
        for p in (ROOT / pkg).rglob("*.py")
        if "versions" not in p.parts
    }


def imports_of(path: Path) -> set[str]:
    """Modules ``path`` imports anywhere (functions too), except under ``if TYPE_CHECKING``."""
    tree = ast.parse(path.read_text())
    skip = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for n in ast.walk(node)
    }
    names = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names |= {f"{node.module}.{a.name}" for a in node.names}
    return names


MODULES = first_party_modules()
IMPORTS = {name: imports_of(path) for name, path in MODULES.items()}


def importers_of(target: str) -> set[str]:
    return {
        m
        for m, imps in IMPORTS.items()
        if any(i == target or i.startswith(target + ".") for i in imps)
    }


def test_sdk_imports_without_server_packages():
    modules = sorted(m for m in MODULES if m.startswith("hindsight.") and "__main__" not in m)
    code = (
        "import sys, importlib\n"
        f"for m in {modules!r}:\n"
        "    try:\n"
        "        importlib.import_module(m)\n"
        "    except ImportError as e:\n"
        "        if e.name and e.name.split('.')[0] in ('distributed', 'dask', 'pandas', 'pyarrow'):\n"
        "            continue  # the Dask and DataFrame modules need those, nothing server-side\n"
        "        raise\n"
        f"bad = sorted(m for m in sys.modules if m.split('.')[0] in {SERVER_PACKAGES!r})\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"SDK pulled in server packages: {out.stdout}"


@pytest.mark.parametrize(
    ("package", "forbidden"),
    [
        ("storage", {"collector", "services"}),
        ("hindsight", {"collector", "services", "storage"}),
        ("migrations", {"collector", "services"}),
    ],
)
def test_package_boundaries(package, forbidden):
    for name, imps in IMPORTS.items():
        if name == package or name.startswith(package + "."):
            bad = {i for i in imps if i.split(".")[0] in forbidden}
            assert not bad, f"{name} imports {sorted(bad)}"


def test_the_collector_uses_only_the_common_service_plumbing():
    for name, imps in IMPORTS.items():
        if name.startswith("collector"):
            bad = {
                i for i in imps if i.startswith("services") and not i.startswith("services.common")
            }
            assert not bad, f"{name} imports {sorted(bad)}"


def test_collector_and_query_service_meet_only_in_the_embedded_server():
    assert {m for m in importers_of("collector") if not m.startswith("collector")} == {
        "services.embedded"
    }
    assert not {m for m in importers_of("services.query") if m.startswith("collector")}


def test_readers_do_not_import_the_writer():
    # the collector's two ingest routes and reindex; storage.ray.bridge derives batches for Ray jobs
    assert importers_of("storage.ingest.writer") == {
        "collector.views",
        "storage.jobs.reindex",
        "storage.ray.bridge",
    }


def test_no_two_modules_import_each_other():
    graph = {
        m: {t for t in MODULES if t != m and any(i == t or i.startswith(t + ".") for i in imps)}
        for m, imps in IMPORTS.items()
    }
    # a module importing its own package's __init__ is not a cycle worth reporting
    graph = {m: {t for t in ts if not m.startswith(t + ".")} for m, ts in graph.items()}
    seen: set[str] = set()

    def visit(m: str, path: list[str]) -> None:
        if m in path:
            raise AssertionError("import cycle: " + " -> ".join(path[path.index(m) :] + [m]))
        if m in seen:
            return
        for t in sorted(graph[m]):
            visit(t, [*path, m])
        seen.add(m)

    for m in sorted(graph):
        visit(m, [])


def test_json_schema_file_is_generated_from_the_code():
    from hindsight.schema import json_schema

    on_disk = json.loads((ROOT / "docs" / "schema" / "batch-v1.json").read_text())
    assert on_disk == json_schema(), "regenerate with: make schema"


def test_example_batch_is_valid_and_has_every_event_kind():
    from hindsight.schema import Event, decode_batch

    batch = decode_batch((ROOT / "docs" / "examples" / "batch.json").read_bytes())
    assert {type(e) for e in batch.events} == set(Event.__args__)
