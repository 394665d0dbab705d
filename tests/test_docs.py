"""The documentation: the site builds, and the code it shows is the code that runs.

The site builds with MkDocs in strict mode (mkdocs.yml), which turns every
warning into a failure: a broken relative link or anchor, a page missing
from the nav, a docstring mkdocstrings cannot read. The API page is
generated from the docstrings of the public modules, so it must name every
export of ``sa_jobqueue.__all__``.

The files docs/flask.md shows are those of examples/flask_app/ (which
tests/test_examples.py runs), and docs/alembic.md's "From Python" example
runs here against a fresh database. (docs/cli.md's examples run in
tests/test_cli.py.)
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine, create_engine, inspect
from sqlalchemy.engine import URL

import sa_jobqueue

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
ALEMBIC_INI = ROOT / "alembic.ini"
FLASK_EXAMPLE = ROOT / "examples" / "flask_app"


def python_blocks(markdown: str) -> list[str]:
    """The contents of the ```python blocks of a Markdown text."""
    return re.findall(r"^```python\n(.*?)^```", markdown, re.S | re.M)


def section(page: Path, heading: str) -> str:
    """The text under ``heading`` (a whole heading line) up to the next heading of its level or
    above; lines inside fenced code blocks are never headings."""
    level = len(heading.split(" ", 1)[0])
    lines = page.read_text(encoding="utf-8").splitlines(keepends=True)
    start = lines.index(heading + "\n") + 1
    fenced = False
    for end in range(start, len(lines)):
        line = lines[end]
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(rf"#{{1,{level}}} ", line):
            return "".join(lines[start:end])
    return "".join(lines[start:])


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings")
    out = tmp_path_factory.mktemp("site")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    return out


def test_every_doc_page_is_built(site: Path) -> None:
    for page in sorted((ROOT / "docs").glob("*.md")):
        assert (site / page.stem / "index.html").is_file(), page.name


def test_api_page_documents_the_public_face(site: Path) -> None:
    html = (site / "api" / "index.html").read_text(encoding="utf-8")
    ids = set(re.findall(r'id="([^"]+)"', html))
    for name in sa_jobqueue.__all__:
        assert f"sa_jobqueue.{name}" in ids, name
    for name in (
        "sa_jobqueue.JobRepository.enqueue",
        "sa_jobqueue.Worker",
        "sa_jobqueue.testing.run_jobs",
        "sa_jobqueue.testing.run_enqueued",
        "sa_jobqueue.signals",
        "sa_jobqueue.logs.JobLogFilter",
        "sa_jobqueue.prometheus.JobMetrics",
        "sa_jobqueue.contrib.flask.JobQueue",
        "sa_jobqueue.aio.AsyncJobRepository",
        "sa_jobqueue.aio.AsyncJobRepository.enqueue",
        "sa_jobqueue.aio.testing.run_enqueued",
        "sa_jobqueue.migrations.set_queue_storage",
    ):
        assert name in ids, name


def test_design_page_links_the_guarantees(site: Path) -> None:
    html = (site / "design" / "index.html").read_text(encoding="utf-8")
    assert "../concepts/#guarantees" in html


# -- docs/flask.md: the files shown are examples/flask_app/'s ------------------


def files_shown(page: str, root: Path) -> list[str]:
    """The files ``docs/<page>`` shows, in order, each checked to be the file under ``root``: each
    python block starts with ``# <path>`` and is, below that line, ``root/<path>`` verbatim."""
    shown: list[str] = []
    for block in python_blocks((DOCS / page).read_text(encoding="utf-8")):
        first, _, body = block.partition("\n")
        assert first.startswith("# "), f"a python block of docs/{page} does not name its file: {first!r}"
        path = first[2:].strip()
        assert body == (root / path).read_text(encoding="utf-8"), f"docs/{page}'s {path} differs"
        shown.append(path)
    return shown


def test_flask_page_shows_the_example_files_verbatim() -> None:
    """The layout docs/flask.md shows is the one tests/test_examples.py runs."""
    assert files_shown("flask.md", FLASK_EXAMPLE) == ["app/__init__.py", "app/views.py", "app/jobs.py", "worker.py"]


# -- docs/alembic.md "From Python" --------------------------------------------


@pytest.fixture
def fresh_engine(create_database: Callable[[], URL]) -> Iterator[Engine]:
    engine = create_engine(create_database())
    yield engine
    engine.dispose()


def _migrated(engine: Engine) -> bool:
    tables = set(inspect(engine).get_table_names())
    return {"sa_jobqueue_jobs", "sa_jobqueue_alembic_version"} <= tables


def _alembic_example() -> str:
    (code,) = python_blocks(section(DOCS / "alembic.md", "### From Python"))
    assert code.count('"/path/to/sa_jobqueue/alembic.ini"') == 1
    return code.replace('"/path/to/sa_jobqueue/alembic.ini"', repr(str(ALEMBIC_INI)))


def test_alembic_from_python_example_runs_and_commits(fresh_engine: Engine) -> None:
    exec(compile(_alembic_example(), "docs/alembic.md", "exec"), {"engine": fresh_engine})
    assert _migrated(fresh_engine)


def test_alembic_from_python_example_rolls_back_on_an_error(fresh_engine: Engine) -> None:
    """The page's promise: the migrations are in the caller's transaction, so an exception after
    ``command.upgrade`` in the block undoes them. (Its earlier example, on a connection with no
    transaction begun, had Alembic commit them by itself.)"""
    lines = _alembic_example().splitlines()
    (at,) = [i for i, line in enumerate(lines) if "command.upgrade(" in line]
    indent = lines[at][: len(lines[at]) - len(lines[at].lstrip())]
    lines.insert(at + 1, f"{indent}raise RuntimeError('after the migrations')")
    with pytest.raises(RuntimeError, match="after the migrations"):
        exec(compile("\n".join(lines), "docs/alembic.md", "exec"), {"engine": fresh_engine})
    assert not _migrated(fresh_engine)


def test_alembic_on_a_connection_joins_a_begun_transaction_only(create_database: Callable[[], URL]) -> None:
    """What the page says about the two cases: with a transaction begun, the migrations are the
    caller's to roll back; without one, Alembic commits them by itself."""
    from alembic.config import Config

    from alembic import command

    for begun in (True, False):
        engine = create_engine(create_database())
        try:
            config = Config(str(ALEMBIC_INI))
            with engine.connect() as connection:
                if begun:
                    connection.begin()
                config.attributes["connection"] = connection
                command.upgrade(config, "head")
                connection.rollback()
            assert _migrated(engine) is not begun, f"transaction begun first: {begun}"
        finally:
            engine.dispose()
