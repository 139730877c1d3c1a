"""Import boundaries: the SDK runs inside Dask workers; storage never imports a service."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SERVER_PACKAGES = ("flask", "sqlalchemy", "boto3", "botocore", "psycopg2", "alembic", "werkzeug")


def test_sdk_imports_without_server_packages():
    modules = sorted(
        "hindsight." + ".".join(p.relative_to(ROOT / "hindsight").with_suffix("").parts)
        for p in (ROOT / "hindsight").rglob("*.py")
        if p.name != "__init__.py" and "__main__" not in p.name
    )
    code = (
        "import sys, importlib\n"
        f"for m in {modules!r}:\n"
        "    try:\n"
        "        importlib.import_module(m)\n"
        "    except ImportError as e:\n"
        "        if e.name and e.name.split('.')[0] in ('distributed', 'dask'):\n"
        "            continue  # the Dask modules need Dask, nothing server-side\n"
        "        raise\n"
        f"bad = sorted(m for m in sys.modules if m.split('.')[0] in {SERVER_PACKAGES!r})\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"SDK pulled in server packages: {out.stdout}"


def imports_of(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize(
    ("package", "forbidden"),
    [("storage", {"collector", "services"}), ("hindsight", {"collector", "services", "storage"})],
)
def test_package_boundaries(package, forbidden):
    for path in (ROOT / package).rglob("*.py"):
        if path.name == "cli.py":
            continue  # the CLI imports server packages inside its server-side commands only
        assert not imports_of(path) & forbidden, f"{path} imports {imports_of(path) & forbidden}"


def test_json_schema_file_is_generated_from_the_code():
    from hindsight.schema import json_schema

    on_disk = json.loads((ROOT / "docs" / "schema" / "batch-v1.json").read_text())
    assert on_disk == json_schema(), "regenerate with: make schema"


def test_example_batch_is_valid_and_has_every_event_kind():
    from hindsight.schema import decode_batch

    batch = decode_batch((ROOT / "docs" / "examples" / "batch.json").read_bytes())
    kinds = {type(e).__name__ for e in batch.events}
    assert kinds == {"SessionEvent", "WorkerEvent", "RunEvent", "GraphEvent", "TaskEvent", "MetricEvent",
                     "LogEvent", "CustomEvent", "ProfileEvent", "ActivityEvent", "CodeEvent"}  # fmt: skip
