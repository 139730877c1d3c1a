"""The house's rules, as tests: the layers of storage/ and who may import whom, no import
circle (imports inside functions and under ``TYPE_CHECKING`` count), no module loaded by a
string, the SDK free of anything server-side, small rooms and modules, and layout owned
by the formatter."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("hindsight", "collector", "storage", "services", "migrations")
SERVER_PACKAGES = ("flask", "sqlalchemy", "boto3", "botocore", "psycopg2", "alembic", "werkzeug")
#: storage/'s layers, lowest first: a module imports from its own layer or lower ones. Dask's
#: vocabulary (what its reasons mean) sits just above core, where the generic readers of
#: stored records may read it.
LAYERS = (
    "storage.core",
    "storage.dask",
    "storage.analysis",
    "storage.ingest",
    "storage.runs",
    "storage.ray",
    "storage.query",
    "storage.lake",
    "storage.alerts",
    "storage.jobs",
)
MAX_MODULES_IN_A_FOLDER = 12
MAX_MODULE_LINES = 800


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def product_files() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


MODULES = {module_name(p): p for p in product_files() if "versions" not in p.parts}
TREES = {name: ast.parse(path.read_text()) for name, path in MODULES.items()}


def imports_of(tree: ast.Module) -> set[str]:
    """Every module ``tree`` imports, anywhere: at the top, inside functions, under
    ``if TYPE_CHECKING``."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # ``from pkg import mod`` imports ``pkg.mod`` (and runs ``pkg``'s __init__,
            # which must not import back); ``from mod import name`` imports ``mod``
            subs = {f"{node.module}.{a.name}" for a in node.names}
            names |= (subs & MODULES.keys()) or {node.module}
            names |= subs
    return names


IMPORTS = {name: imports_of(tree) for name, tree in TREES.items()}


def project_imports(name: str) -> set[str]:
    """The project modules ``name`` imports (``from pkg import mod`` names ``pkg.mod``)."""
    return {i for i in IMPORTS[name] if i in MODULES}


def within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def importers_of(target: str) -> set[str]:
    return {m for m in MODULES if any(within(i, target) for i in IMPORTS[m])}


def layer_of(name: str) -> int | None:
    """The layer of the longest entry of :data:`LAYERS` that holds ``name``."""
    best: tuple[int, int] | None = None
    for i, layer in enumerate(LAYERS):
        for entry in (layer,) if isinstance(layer, str) else layer:
            if within(name, entry) and (best is None or len(entry) > best[0]):
                best = (len(entry), i)
    return None if best is None else best[1]


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
        if within(name, package):
            bad = {i for i in imps if i.split(".")[0] in forbidden}
            assert not bad, f"{name} imports {sorted(bad)}"


def test_storage_modules_each_belong_to_a_layer():
    loose = [m for m in MODULES if within(m, "storage") and m != "storage" and layer_of(m) is None]
    assert not loose, f"storage modules outside every layer: {loose}"


def test_storage_layers_import_only_their_own_or_lower_ones():
    bad = []
    for name in MODULES:
        mine = layer_of(name)
        if mine is None:
            continue
        for target in project_imports(name):
            theirs = layer_of(target)
            if theirs is not None and theirs > mine:
                bad.append(f"{name} (layer {mine}) imports {target} (layer {theirs})")
    assert not bad, "\n".join(bad)


def test_analysis_is_pure():
    """Analysis takes a run's data and returns facts: no database, no blob store."""
    for name, imps in IMPORTS.items():
        if within(name, "storage.analysis"):
            bad = {
                i
                for i in imps
                if i.split(".")[0] in SERVER_PACKAGES
                or within(i, "storage.core.db")
                or within(i, "storage.core.blobs")
                or within(i, "storage.core.models")
            }
            assert not bad, f"{name} imports {sorted(bad)}"


def test_the_collector_uses_only_the_common_service_plumbing():
    for name, imps in IMPORTS.items():
        if within(name, "collector"):
            bad = {i for i in imps if within(i, "services") and not within(i, "services.common")}
            assert not bad, f"{name} imports {sorted(bad)}"


def test_collector_and_query_service_meet_only_in_the_embedded_server():
    assert {m for m in importers_of("collector") if not within(m, "collector")} == {
        "services.embedded"
    }
    assert not {m for m in importers_of("services.query") if within(m, "collector")}


def test_readers_do_not_import_the_writer_or_the_jobs():
    for package in ("services.query", "services.dashboard", "services.common"):
        for name in MODULES:
            if within(name, package):
                bad = {
                    i
                    for i in IMPORTS[name]
                    if within(i, "storage.ingest") or within(i, "storage.jobs")
                }
                assert not bad, f"{name} imports {sorted(bad)}"


def test_no_import_circle():
    """Counting every import: inside functions and under ``TYPE_CHECKING`` too."""
    graph = {m: {t for t in project_imports(m) if t != m and not within(m, t)} for m in MODULES}
    done: set[str] = set()

    def visit(m: str, path: list[str]) -> None:
        if m in path:
            raise AssertionError("import circle: " + " -> ".join(path[path.index(m) :] + [m]))
        if m in done:
            return
        for t in sorted(graph[m]):
            visit(t, [*path, m])
        done.add(m)

    for m in sorted(graph):
        visit(m, [])


def test_no_project_module_is_loaded_from_a_string():
    bad = []
    for name, tree in TREES.items():
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            func = ast.unparse(node.func)
            if func in ("importlib.import_module", "import_module", "__import__"):
                bad.append(f"{name}: {ast.unparse(node)}")
    assert not bad, "\n".join(bad)


def test_rooms_and_modules_stay_small():
    folders: dict[Path, int] = {}
    for path in product_files():
        if path.name != "__init__.py" and "versions" not in path.parts:
            folders[path.parent] = folders.get(path.parent, 0) + 1
    crowded = {str(f.relative_to(ROOT)): n for f, n in folders.items()}
    crowded = {f: n for f, n in crowded.items() if n > MAX_MODULES_IN_A_FOLDER}
    assert not crowded, f"folders of more than {MAX_MODULES_IN_A_FOLDER} modules: {crowded}"
    long = {
        str(p.relative_to(ROOT)): n
        for p in product_files()
        if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"


def test_the_formatter_owns_layout():
    skips = [
        f"{p.relative_to(ROOT)}:{i}"
        for p in product_files()
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if re.search(r"#\s*fmt:\s*(skip|off)", line)
    ]
    assert not skips, f"fmt: skip/off in product code: {skips}"


def test_code_says_why_not_how_it_was_found():
    """How a bug was found, by whom and when, belongs in the commit message: not in product
    code, tests, benches or docs. (The pattern is built from pieces so this file passes.)"""
    who = "|".join(("a new user", "an operator", "a review", "a trial", "a fresh pair",
                    "fresh pairs", "a held-out", "the openapi fuzz"))  # fmt: skip
    diary = re.compile(
        "found "
        + f"(by|in) ({who})|"
        + "held-"
        + r"out check|\buntil 20\d\d-|"
        + "fresh pairs? "
        + "of eyes|a trial "
        + "found",
        re.IGNORECASE,
    )
    files = [
        *product_files(),
        *sorted((ROOT / "tests").rglob("*.py")),
        *sorted((ROOT / "bench").rglob("*.py")),
        *sorted((ROOT / "docs").rglob("*.md")),
        ROOT / "README.md",
    ]
    lines = [
        f"{p.relative_to(ROOT)}:{i}: {line.strip()}"
        for p in files
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if diary.search(line)
    ]
    assert not lines, "\n".join(lines)


def test_bench_scripts_run_as_modules():
    edits = [
        f"{p.relative_to(ROOT)}:{i}"
        for p in sorted((ROOT / "bench").rglob("*.py"))
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if "sys.path.insert" in line or "sys.path.append" in line
    ]
    assert not edits, f"bench scripts edit sys.path (run them as python -m bench.NAME): {edits}"


def test_json_schema_file_is_generated_from_the_code():
    from hindsight.schema import json_schema

    on_disk = json.loads((ROOT / "docs" / "schema" / "batch-v1.json").read_text())
    assert on_disk == json_schema(), "regenerate with: make schema"


def test_example_batch_is_valid_and_has_every_event_kind():
    from hindsight.schema import Event, decode_batch

    batch = decode_batch((ROOT / "docs" / "examples" / "batch.json").read_bytes())
    assert {type(e) for e in batch.events} == set(Event.__args__)
