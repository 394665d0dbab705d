"""Packaging: the wheel and sdist that ``python -m build`` makes, and the wheel installed.

The project is built once per module (without build isolation: setuptools and
build come with the ``test`` extra) into a temporary directory. The wheel is
then installed with a plain ``pip install`` into a fresh virtual environment,
dependencies and all, and the README's Quickstart runs there against a fresh
test database, from a directory outside the checkout so that only the
installed package can be imported. Every subprocess has a timeout.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import textwrap
import time
import zipfile
from collections.abc import Callable
from fnmatch import fnmatch
from pathlib import Path

import pytest
from sqlalchemy.engine import URL
from test_public_api import PUBLIC_API

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent
UNBUILT = (".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", "*.pyc", ".*_cache")
README_URL = '"postgresql://postgres@localhost/app"'


def _run(
    args: list[str | Path], timeout: float, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(
        [str(a) for a in args], capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd
    )
    assert out.returncode == 0, f"{args} exited {out.returncode}\n{out.stdout[-4000:]}\n{out.stderr[-4000:]}"
    return out


def _source_files(folder: str) -> set[str]:
    """Files under ``folder`` of the checkout, relative to the root, less what the build copy leaves out."""
    files = (p.relative_to(ROOT) for p in (ROOT / folder).rglob("*") if p.is_file())
    return {f.as_posix() for f in files if not any(fnmatch(part, pat) for part in f.parts for pat in UNBUILT)}


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    # From a copy without build output: setuptools would otherwise reuse the file list of a stale
    # sa_jobqueue.egg-info in the checkout, and an incomplete MANIFEST.in would go unnoticed.
    source = tmp_path_factory.mktemp("source") / "sa_jobqueue"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(*UNBUILT))
    out = tmp_path_factory.mktemp("dist")
    started = time.monotonic()
    _run([sys.executable, "-m", "build", "--wheel", "--sdist", "--no-isolation", "--outdir", out, source], timeout=180)
    print(f"build: {time.monotonic() - started:.1f} s")
    (wheel,) = out.glob("sa_jobqueue-*.whl")
    (sdist,) = out.glob("sa_jobqueue-*.tar.gz")
    return {"wheel": wheel, "sdist": sdist}


def test_wheel_holds_the_package_typed_and_nothing_else(dist: dict[str, Path]) -> None:
    with zipfile.ZipFile(dist["wheel"]) as wheel:
        names = set(wheel.namelist())
    assert "sa_jobqueue/py.typed" in names
    package = _source_files("sa_jobqueue")
    assert any(name.startswith("sa_jobqueue/contrib/") for name in package)
    missing = package - names
    assert not missing, f"not in the wheel: {sorted(missing)}"
    top = {name.split("/")[0] for name in names}
    assert top == {"sa_jobqueue", dist["wheel"].name.split("-py3")[0] + ".dist-info"}, top
    metadata = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    with zipfile.ZipFile(dist["wheel"]) as wheel:
        assert "sa-jobqueue = sa_jobqueue.cli:main" in wheel.read(metadata).decode()


def test_sdist_holds_migrations_docs_and_tests(dist: dict[str, Path]) -> None:
    with tarfile.open(dist["sdist"]) as sdist:
        names = {name.split("/", 1)[1] for name in sdist.getnames() if "/" in name}
    wanted = {"README.md", "alembic.ini", "pyproject.toml", "MANIFEST.in"}
    for folder in ("alembic", "docs", "tests", "examples", "sa_jobqueue"):
        wanted |= _source_files(folder)
    assert "alembic/versions/0001_default_job_table.py" in wanted
    missing = wanted - names
    assert not missing, f"not in the sdist: {sorted(missing)}"
    assert not [name for name in names if "__pycache__" in name or name.endswith(".pyc")]


def _quickstart() -> str:
    """The README's Quickstart code, pointed at ``DATABASE_URL``."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Quickstart", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "no python block under ## Quickstart in README.md"
    code = match.group(1)
    assert code.count(README_URL) == 1, f"the Quickstart no longer connects to {README_URL}"
    return "import os\n" + code.replace(README_URL, 'os.environ["DATABASE_URL"]')


CHECKS = textwrap.dedent("""
    import json
    from sqlalchemy import func, select

    import sa_jobqueue

    with Session(engine) as session:
        welcomed = session.scalars(select(User.welcomed)).all()
        left = session.scalar(select(func.count()).select_from(EmailJob))
    engine.dispose()
    print(json.dumps({"welcomed": welcomed, "jobs_left": left, "all": sa_jobqueue.__all__,
                      "file": sa_jobqueue.__file__}))
""")


def test_installed_wheel_runs_the_quickstart(
    dist: dict[str, Path], create_database: Callable[[], URL], tmp_path: Path
) -> None:
    started = time.monotonic()
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", venv], timeout=120)
    python = venv / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k not in {"PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME"}}
    _run([python, "-m", "pip", "install", dist["wheel"]], timeout=300, env=env, cwd=tmp_path)
    installed = time.monotonic()

    url = create_database().set(drivername="postgresql").render_as_string(hide_password=False)
    script = tmp_path / "quickstart.py"
    script.write_text(_quickstart() + CHECKS)
    out = _run([python, script], timeout=120, env={**env, "DATABASE_URL": url}, cwd=tmp_path)
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert "sending the welcome email to ada@example.com" in out.stdout
    # A worker that finds its operations tables logs nothing: a new user sees no warning.
    assert out.stderr == "", out.stderr
    assert report["welcomed"] == [True]
    assert report["jobs_left"] == 0  # done jobs are deleted unless __keep_done__
    assert sorted(report["all"]) == sorted(PUBLIC_API)
    assert Path(report["file"]).is_relative_to(venv), report["file"]

    # The project's revisions run from the unpacked sdist with the installed alembic (docs/alembic.md).
    with tarfile.open(dist["sdist"]) as sdist:
        if hasattr(tarfile, "data_filter"):  # 3.10.12+, 3.11.4+
            sdist.extractall(tmp_path / "sdist", filter="data")
        else:
            sdist.extractall(tmp_path / "sdist")
    (unpacked,) = (tmp_path / "sdist").iterdir()
    # A database of their own: the Quickstart created the operations tables the revisions create.
    url = create_database().set(drivername="postgresql").render_as_string(hide_password=False)
    _run([venv / "bin" / "alembic", "upgrade", "head"], timeout=120, env={**env, "DATABASE_URL": url}, cwd=unpacked)
    check = _run([venv / "bin" / "alembic", "check"], timeout=120, env={**env, "DATABASE_URL": url}, cwd=unpacked)
    assert "No new upgrade operations detected" in check.stdout + check.stderr

    help_ = _run([venv / "bin" / "sa-jobqueue", "--help"], timeout=60, env=env, cwd=tmp_path)
    assert "Usage" in help_.stdout
    print(f"venv + install: {installed - started:.1f} s, quickstart: {time.monotonic() - installed:.1f} s")
