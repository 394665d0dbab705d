"""The documentation site builds with MkDocs in strict mode (mkdocs.yml).

Strict mode turns every warning into a failure: a broken relative link or
anchor, a page missing from the nav, a docstring mkdocstrings cannot read.
The API page is generated from the docstrings of the public modules, so it
must name every export of ``sa_jobqueue.__all__``.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import sa_jobqueue

ROOT = Path(__file__).resolve().parent.parent

pytest.importorskip("mkdocs")
pytest.importorskip("mkdocstrings")


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
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
        "sa_jobqueue.signals",
        "sa_jobqueue.logs.JobLogFilter",
        "sa_jobqueue.prometheus.JobMetrics",
        "sa_jobqueue.contrib.flask.JobQueue",
        "sa_jobqueue.migrations.set_queue_storage",
    ):
        assert name in ids, name


def test_design_page_links_the_guarantees(site: Path) -> None:
    html = (site / "design" / "index.html").read_text(encoding="utf-8")
    assert "../concepts/#guarantees" in html
