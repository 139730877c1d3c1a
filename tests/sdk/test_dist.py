"""`make dist`: a wheel of the SDK alone, to bake into Dask worker images. It holds the agent,
the client and the schema, and nothing of the server nor its dependencies."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SERVER = ("flask", "sqlalchemy", "boto3", "botocore", "psycopg2", "alembic", "gunicorn", "bokeh")


def test_make_dist_builds_a_wheel_of_the_sdk_alone(tmp_path):
    out = subprocess.run(
        ["make", "-s", "dist"], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stdout + out.stderr
    (wheel,) = sorted((ROOT / "dist").glob("hindsight_sdk-*.whl"))
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        meta = next(z.read(n).decode() for n in names if n.endswith(".dist-info/METADATA"))
    tops = {n.split("/")[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"hindsight"}
    assert "hindsight/dask/__init__.py" in names
    required = [line for line in meta.splitlines() if line.startswith("Requires-Dist:")]
    assert not [r for r in required if any(s in r.lower() for s in SERVER)], required

    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", target, wheel],
        check=True,
        timeout=300,
    )
    code = (
        "import sys\n"
        f"sys.path.insert(0, {str(target)!r})\n"
        "import hindsight, hindsight.dask, hindsight.schema\n"
        f"assert hindsight.__file__.startswith({str(target)!r}), hindsight.__file__\n"
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {SERVER!r}))\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]"
