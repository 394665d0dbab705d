"""The claim index's move from ``_v1`` to ``_v2`` (docs/alembic.md, section 6).

Tables of the previous version have ``ix_<t>_claim_v1`` on ``(priority,
run_at, id)``: the project's revision 0004 and, for users' tables, the
documented revision with ``upgrade_claim_index`` replace it by ``_v2`` on
``(queue, priority, run_at, id)``, without blocking writes, and can run again
after a failed build.
"""

from __future__ import annotations

import re
import textwrap
from collections.abc import Callable
from pathlib import Path

from sqlalchemy.engine import URL
from test_migrations import (
    DEFAULT_TABLE,
    REPO,
    _offline_sql,
    alembic_cli,
    assert_job_objects,
    assert_no_drift,
    execute,
    indexes,
    load_models,
    query,
    reference_snapshot,
    snapshot,
    user_project,  # noqa: F401  (a fixture)
)

from sa_jobqueue.mixin import CLAIM_INDEX_COLUMNS

USER_TABLES = ["customers", "email_jobs", "report_jobs"]
JOB_TABLES = ("email_jobs", "report_jobs")


def _as_previous_version(source: str) -> str:
    """A generated first revision as the previous version wrote it: ``_v1``."""
    for table in JOB_TABLES:
        current = f"op.create_index(op.f('ix_{table}_claim_v2'), '{table}', ['queue', 'priority', 'run_at', 'id']"
        assert current in source
        source = source.replace(
            current, f"op.create_index(op.f('ix_{table}_claim_v1'), '{table}', ['priority', 'run_at', 'id']"
        ).replace(f"ix_{table}_claim_v2", f"ix_{table}_claim_v1")
    return source


def _documented_revision(table: str) -> str:
    (snippet,) = [
        block for block in re.findall(r"```python\n(.*?)```", (REPO / "docs" / "alembic.md").read_text(), re.S)
        if "upgrade_claim_index(" in block
    ]
    return snippet.replace("email_jobs", table)


def test_user_tables_of_the_previous_version_take_the_documented_revision(
    user_project: Path, create_database: Callable[[], URL]  # noqa: F811
) -> None:
    url = create_database()
    alembic_cli("revision", "--autogenerate", "--rev-id", "u0001", "-m", "jobs", cwd=user_project, database_url=url)
    (first,) = (user_project / "alembic" / "versions").glob("u0001_*.py")
    first.write_text(_as_previous_version(first.read_text()))
    alembic_cli("upgrade", "head", cwd=user_project, database_url=url)
    execute(url, "INSERT INTO email_jobs (queue, task) VALUES ('a', 'noop'), ('b', 'noop')")
    before = snapshot(url, USER_TABLES)
    proc = alembic_cli("check", cwd=user_project, database_url=url, check=False)
    assert proc.returncode != 0 and "ix_email_jobs_claim_v2" in proc.stdout + proc.stderr

    # What autogenerate writes (docs/alembic.md says so), replaced by the helpers.
    alembic_cli("revision", "--autogenerate", "--rev-id", "u0002", "-m", "claim v2", cwd=user_project, database_url=url)
    (second,) = (user_project / "alembic" / "versions").glob("u0002_*.py")
    generated = second.read_text()
    for table in JOB_TABLES:
        assert f"op.create_index(op.f('ix_{table}_claim_v2'), '{table}', {list(CLAIM_INDEX_COLUMNS)}" in generated
        assert f"op.drop_index(op.f('ix_{table}_claim_v1'), table_name='{table}'" in generated
    snippets = [_documented_revision(table) for table in JOB_TABLES]
    imports = snippets[0].split("\n\n")[0]
    bodies = [re.findall(r"^    (\w+_claim_index\(.*\))$", snippet, re.M) for snippet in snippets]
    second.write_text(
        f"{imports}\n\nrevision = 'u0002'\ndown_revision = 'u0001'\nbranch_labels = None\ndepends_on = None\n\n\n"
        f"def upgrade() -> None:\n" + "".join(f"    {b[0]}\n" for b in bodies)
        + "\n\ndef downgrade() -> None:\n" + "".join(f"    {b[1]}\n" for b in bodies)
    )

    alembic_cli("upgrade", "head", cwd=user_project, database_url=url)
    for table in JOB_TABLES:
        assert_job_objects(url, table)
    assert_no_drift(user_project, url)
    models = load_models(user_project, "claim_v2")
    assert snapshot(url, USER_TABLES) == reference_snapshot(create_database, models.Base.metadata, USER_TABLES)
    assert query(url, "SELECT queue FROM email_jobs ORDER BY id") == [("a",), ("b",)]

    alembic_cli("downgrade", "u0001", cwd=user_project, database_url=url)
    assert snapshot(url, USER_TABLES) == before


def test_revision_0004_builds_again_over_an_invalid_index(create_database: Callable[[], URL]) -> None:
    """A concurrent build that failed leaves an INVALID index of the new name:
    the revision run again drops it and builds a valid one."""
    url = create_database()
    alembic_cli("upgrade", "0003", cwd=REPO, database_url=url)
    execute(
        url,
        f"INSERT INTO {DEFAULT_TABLE} (queue, task) SELECT 'q' || (g % 3), 'noop' FROM generate_series(1, 500) g",
        # What a failed CREATE INDEX CONCURRENTLY leaves behind: the index,
        # marked not valid (here on the wrong columns, to tell it apart).
        f"CREATE INDEX ix_{DEFAULT_TABLE}_claim_v2 ON {DEFAULT_TABLE} (id) WHERE status = 'pending'",
        f"UPDATE pg_index SET indisvalid = false WHERE indexrelid = 'ix_{DEFAULT_TABLE}_claim_v2'::regclass",
    )
    alembic_cli("upgrade", "head", cwd=REPO, database_url=url)
    assert_job_objects(url, DEFAULT_TABLE)
    valid = query(url, f"SELECT indisvalid FROM pg_index WHERE indexrelid = 'ix_{DEFAULT_TABLE}_claim_v2'::regclass")
    assert valid == [(True,)]
    assert_no_drift(REPO, url)
    # Run again on a finished upgrade, the step changes nothing.
    alembic_cli("downgrade", "0003", cwd=REPO, database_url=url)
    assert f"ix_{DEFAULT_TABLE}_claim_v2" not in indexes(url, DEFAULT_TABLE)
    alembic_cli("upgrade", "head", cwd=REPO, database_url=url)
    assert_job_objects(url, DEFAULT_TABLE)
    assert query(url, f"SELECT count(*) FROM {DEFAULT_TABLE}") == [(500,)]


def test_the_helpers_build_concurrently_outside_the_revisions_transaction(tmp_path: Path) -> None:
    proc = _offline_sql('upgrade_claim_index("Jobs", schema="work")', tmp_path)
    assert proc.returncode == 0, proc.stderr
    sql = proc.stdout
    create = (
        'CREATE INDEX CONCURRENTLY "ix_Jobs_claim_v2" ON work."Jobs" '
        "(queue, priority, run_at, id) WHERE status = 'pending'"
    )
    drop = 'DROP INDEX CONCURRENTLY IF EXISTS work."ix_Jobs_claim_v1"'
    # The autocommit block: the revision's transaction ends first.
    assert sql.index("COMMIT;") < sql.index(create) < sql.index(drop)


def test_the_helpers_in_the_revisions_transaction(tmp_path: Path) -> None:
    proc = _offline_sql('downgrade_claim_index("jobs", concurrently=False)', tmp_path)
    assert proc.returncode == 0, proc.stderr
    sql = proc.stdout
    create = "CREATE INDEX ix_jobs_claim_v1 ON jobs (priority, run_at, id) WHERE status = 'pending'"
    assert create in sql and "DROP INDEX IF EXISTS ix_jobs_claim_v2" in sql
    assert "CONCURRENTLY" not in sql
    assert sql.index("BEGIN;") < sql.index(create) < sql.index("COMMIT;")


def test_the_helpers_refuse_bad_arguments(tmp_path: Path) -> None:
    for body, parameter in (
        ('upgrade_claim_index("jobs; DROP TABLE x")', "table_name"),
        ('upgrade_claim_index("jobs", schema="a.b")', "schema"),
        ('downgrade_claim_index("jobs", concurrently="yes")', "concurrently"),
    ):
        proc = _offline_sql(textwrap.dedent(body), tmp_path / parameter)
        assert proc.returncode != 0
        assert f"InvalidArgumentError: {parameter}: " in proc.stderr
        assert "INDEX" not in proc.stdout
