"""Migrations on a real PostgreSQL: the project's revisions and a user's own environment.

Every test works on fresh databases of its own. The ``alembic`` command runs as
a real subprocess (``python -m alembic``), the way users run it; the catalog
(pg_indexes, pg_constraint, pg_class.reloptions, information_schema) is then
compared with what the models declare, because ``alembic check`` alone cannot
see a partial index predicate or a CHECK body.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from alembic.config import Config
from sqlalchemy import MetaData, create_engine, text
from sqlalchemy.engine import URL
from sqlalchemy.orm import Session

from alembic import command
from sa_jobqueue import InvalidArgumentError, JobRepository
from sa_jobqueue.control_tables import PAUSED_TABLE, THROUGHPUT_TABLE, WORKERS_TABLE, ControlBase
from sa_jobqueue.default import Base as DefaultBase
from sa_jobqueue.default import Job
from sa_jobqueue.migrations import QUEUE_STORAGE, queue_storage
from sa_jobqueue.periodic import PERIODIC_TABLE, PeriodicBase

REPO = Path(__file__).resolve().parent.parent
DEFAULT_TABLE = "sa_jobqueue_jobs"
CLEAN = "No new upgrade operations detected"
TIMEOUT = 120


# --------------------------------------------------------------------------- helpers


def libpq(url: URL) -> str:
    """``postgresql://…``: the form users put in DATABASE_URL."""
    return url.set(drivername="postgresql").render_as_string(hide_password=False)


def alembic_cli(
    *args: str, cwd: Path, database_url: URL | None, check: bool = True
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"}
    if database_url is not None:
        env["DATABASE_URL"] = libpq(database_url)
    proc = subprocess.run(
        [sys.executable, "-m", "alembic", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    if check:
        assert proc.returncode == 0, (
            f"alembic {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
        )
    return proc


def assert_no_drift(cwd: Path, url: URL) -> None:
    proc = alembic_cli("check", cwd=cwd, database_url=url)
    assert CLEAN in proc.stdout + proc.stderr


def query(url: URL, sql: str, **params: Any) -> list[tuple[Any, ...]]:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return [tuple(row) for row in conn.execute(text(sql), params)]
    finally:
        engine.dispose()


def execute(url: URL, *statements: str) -> None:
    engine = create_engine(url)
    try:
        with engine.begin() as conn:
            for statement in statements:
                conn.execute(text(statement))
    finally:
        engine.dispose()


def tables(url: URL) -> set[str]:
    rows = query(url, "SELECT tablename FROM pg_tables WHERE schemaname = 'public'")
    return {name for (name,) in rows}


def indexes(url: URL, table: str) -> dict[str, str]:
    rows = query(
        url,
        "SELECT indexname, indexdef FROM pg_indexes "
        "WHERE schemaname = 'public' AND tablename = :t",
        t=table,
    )
    return dict(rows)  # type: ignore[arg-type]


def constraints(url: URL, table: str) -> dict[str, str]:
    rows = query(
        url,
        "SELECT conname, pg_get_constraintdef(oid) FROM pg_constraint "
        "WHERE conrelid = CAST(:t AS regclass)",
        t=f"public.{table}",
    )
    return dict(rows)  # type: ignore[arg-type]


def reloptions(url: URL, table: str) -> dict[str, str]:
    rows = query(
        url,
        "SELECT reloptions FROM pg_class "
        "WHERE relname = :t AND relnamespace = 'public'::regnamespace",
        t=table,
    )
    assert rows, f"no table {table}"
    return dict(option.split("=", 1) for option in rows[0][0] or [])


def columns(url: URL, table: str) -> list[tuple[Any, ...]]:
    return query(
        url,
        "SELECT column_name, data_type, character_maximum_length, is_nullable, "
        "column_default, is_identity, identity_generation "
        "FROM information_schema.columns WHERE table_schema = 'public' AND table_name = :t "
        "ORDER BY ordinal_position",
        t=table,
    )


def sequences(url: URL) -> set[str]:
    rows = query(url, "SELECT sequencename FROM pg_sequences WHERE schemaname = 'public'")
    return {name for (name,) in rows}


def snapshot(url: URL, names: Iterable[str]) -> dict[str, Any]:
    """What a table is, as PostgreSQL reports it (storage parameters aside)."""
    return {
        name: {
            "columns": columns(url, name),
            "indexes": indexes(url, name),
            "constraints": constraints(url, name),
        }
        for name in names
    }


def reference_snapshot(
    create_database: Callable[[], URL], metadata: MetaData, names: Iterable[str]
) -> dict[str, Any]:
    """The snapshot of ``metadata.create_all`` on a fresh database: what the models declare."""
    url = create_database()
    engine = create_engine(url)
    try:
        metadata.create_all(engine)
    finally:
        engine.dispose()
    return snapshot(url, names)


def expected_reloptions(parameters: dict[str, Any]) -> dict[str, str]:
    return {k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in parameters.items()}


def assert_job_objects(url: URL, table: str) -> None:
    """The job indexes, with their exact predicates, and the named checks exist."""
    found = indexes(url, table)
    assert found[f"ix_{table}_claim_v2"] == (
        f"CREATE INDEX ix_{table}_claim_v2 ON public.{table} USING btree "
        "(queue, priority, run_at, id) WHERE ((status)::text = 'pending'::text)"
    )
    assert f"ix_{table}_claim_v1" not in found
    assert found[f"ix_{table}_lease_v1"] == (
        f"CREATE INDEX ix_{table}_lease_v1 ON public.{table} USING btree "
        "(lease_expires_at) WHERE ((status)::text = 'running'::text)"
    )
    assert found[f"uq_{table}_dedupe_v1"] == (
        f"CREATE UNIQUE INDEX uq_{table}_dedupe_v1 ON public.{table} USING btree "
        "(queue, dedupe_key) WHERE ((dedupe_key IS NOT NULL) AND "
        "((status)::text = ANY ((ARRAY['pending'::character varying, "
        "'running'::character varying])::text[])))"
    )
    # The dashboard's (revision 0008).
    assert found[f"ix_{table}_status_v1"] == (
        f"CREATE INDEX ix_{table}_status_v1 ON public.{table} USING btree (status, queue, id) "
        "WHERE ((status)::text = ANY ((ARRAY['pending'::character varying, 'done'::character varying, "
        "'dead'::character varying, 'cancelled'::character varying])::text[]))"
    )
    checks = constraints(url, table)
    assert checks[f"ck_{table}_max_attempts_v1"] == "CHECK ((max_attempts >= 1))"
    status_check = checks[f"ck_{table}_status_v1"]
    for status in ("pending", "running", "done", "dead", "cancelled"):
        assert f"'{status}'" in status_check


# --------------------------------------------------------------------------- the project's revisions


def test_project_revisions_upgrade_check_downgrade(create_database: Callable[[], URL]) -> None:
    url = create_database()
    # The database of an application with a history and tables of its own.
    execute(
        url,
        "CREATE TABLE app_users (id serial PRIMARY KEY, name text)",
        "CREATE TABLE alembic_version (version_num varchar(32) PRIMARY KEY)",
        "INSERT INTO alembic_version VALUES ('app_rev_42')",
    )

    alembic_cli("upgrade", "head", cwd=REPO, database_url=url)

    assert {DEFAULT_TABLE, "sa_jobqueue_alembic_version"} <= tables(url)
    assert_job_objects(url, DEFAULT_TABLE)
    assert reloptions(url, DEFAULT_TABLE) == expected_reloptions(dict(QUEUE_STORAGE))
    assert query(url, "SELECT version_num FROM sa_jobqueue_alembic_version") == [("0008",)]
    # The application's history and tables are left alone.
    assert query(url, "SELECT version_num FROM alembic_version") == [("app_rev_42",)]
    # The schema the revisions build is the schema the model declares.
    reference = reference_snapshot(create_database, DefaultBase.metadata, [DEFAULT_TABLE])
    assert snapshot(url, [DEFAULT_TABLE]) == reference
    # Revision 0002: the periodic schedules' table, as its model declares it.
    periodic_reference = reference_snapshot(create_database, PeriodicBase.metadata, [PERIODIC_TABLE])
    assert snapshot(url, [PERIODIC_TABLE]) == periodic_reference
    # Revision 0007: the operations tables, as their models declare them.
    control = [WORKERS_TABLE, PAUSED_TABLE, THROUGHPUT_TABLE]
    assert snapshot(url, control) == reference_snapshot(create_database, ControlBase.metadata, control)
    ids = query(url, "SELECT is_identity FROM information_schema.columns "
                "WHERE table_name = :t AND column_name = 'id'", t=DEFAULT_TABLE)
    assert ids == [("YES",)]
    payload = query(url, "SELECT data_type FROM information_schema.columns "
                    "WHERE table_name = :t AND column_name = 'payload'", t=DEFAULT_TABLE)
    assert payload == [("jsonb",)]

    # No drift, and the application's own table is not reported as one to drop.
    assert_no_drift(REPO, url)

    alembic_cli("downgrade", "0006", cwd=REPO, database_url=url)
    assert not {WORKERS_TABLE, PAUSED_TABLE, THROUGHPUT_TABLE} & tables(url)
    assert "progress" not in {c[0] for c in columns(url, DEFAULT_TABLE)}
    alembic_cli("downgrade", "0003", cwd=REPO, database_url=url)
    assert set(indexes(url, DEFAULT_TABLE)) >= {f"ix_{DEFAULT_TABLE}_claim_v1"}
    assert f"ix_{DEFAULT_TABLE}_claim_v2" not in indexes(url, DEFAULT_TABLE)
    alembic_cli("downgrade", "0002", cwd=REPO, database_url=url)
    assert "cancel_requested_at" not in {c[0] for c in columns(url, DEFAULT_TABLE)}
    assert PERIODIC_TABLE in tables(url)
    alembic_cli("downgrade", "0001", cwd=REPO, database_url=url)
    assert PERIODIC_TABLE not in tables(url)
    assert DEFAULT_TABLE in tables(url)
    alembic_cli("downgrade", "base", cwd=REPO, database_url=url)
    assert DEFAULT_TABLE not in tables(url)
    assert "app_users" in tables(url)
    assert query(url, "SELECT count(*) FROM sa_jobqueue_alembic_version") == [(0,)]

    alembic_cli("upgrade", "head", cwd=REPO, database_url=url)
    assert snapshot(url, [DEFAULT_TABLE]) == reference
    assert snapshot(url, [PERIODIC_TABLE]) == periodic_reference
    assert reloptions(url, DEFAULT_TABLE) == expected_reloptions(dict(QUEUE_STORAGE))
    assert_no_drift(REPO, url)


def test_revision_0003_adds_cancel_requested_at_to_a_table_with_jobs(create_database: Callable[[], URL]) -> None:
    """From 0002 (the previous version's schema) with jobs in the table: the
    column comes in empty, the rows stay, and the new code works on them."""
    url = create_database()
    alembic_cli("upgrade", "0002", cwd=REPO, database_url=url)
    execute(
        url,
        f"INSERT INTO {DEFAULT_TABLE} (task, payload) VALUES ('noop', '{{\"n\": 1}}'), ('noop', '{{\"n\": 2}}')",
        f"UPDATE {DEFAULT_TABLE} SET status = 'running', attempts = 1, lock_token = gen_random_uuid(), "
        "lease_expires_at = now() + interval '1 minute' WHERE payload = '{\"n\": 2}'",
    )
    alembic_cli("upgrade", "head", cwd=REPO, database_url=url)

    assert query(url, f"SELECT payload ->> 'n', status, cancel_requested_at FROM {DEFAULT_TABLE} ORDER BY id") == [
        ("1", "pending", None), ("2", "running", None),
    ]
    assert ("cancel_requested_at", "timestamp with time zone", None, "YES", None, "NO", None) in columns(
        url, DEFAULT_TABLE
    )
    assert snapshot(url, [DEFAULT_TABLE]) == reference_snapshot(
        create_database, DefaultBase.metadata, [DEFAULT_TABLE]
    )
    repo = JobRepository(Job)
    engine = create_engine(url)
    try:
        with Session(engine) as session, session.begin():
            [claimed] = repo.claim(session)
            assert claimed.payload == {"n": 1} and claimed.cancel_requested_at is None
            running = session.scalar(text(f"SELECT id FROM {DEFAULT_TABLE} WHERE payload ->> 'n' = '2'"))
            assert repo.cancel(session, running) is True
    finally:
        engine.dispose()
    assert query(url, f"SELECT status, cancel_requested_at IS NOT NULL FROM {DEFAULT_TABLE} ORDER BY id") == [
        ("running", False), ("running", True),
    ]


def test_revision_0003_keeps_stored_limits_and_its_downgrade_stores_20_in_unset_ones(
    create_database: Callable[[], URL],
) -> None:
    """``max_attempts`` becomes nullable without a default: rows written before
    keep their limit (they count as given at enqueue), jobs enqueued without
    one store NULL, and the downgrade gives those the old default back."""
    url = create_database()
    alembic_cli("upgrade", "0002", cwd=REPO, database_url=url)
    previous = snapshot(url, [DEFAULT_TABLE])
    execute(url, f"INSERT INTO {DEFAULT_TABLE} (task) VALUES ('old')",
            f"INSERT INTO {DEFAULT_TABLE} (task, max_attempts) VALUES ('old-3', 3)")
    alembic_cli("upgrade", "head", cwd=REPO, database_url=url)

    assert ("max_attempts", "integer", None, "YES", None, "NO", None) in columns(url, DEFAULT_TABLE)
    engine = create_engine(url)
    try:
        with Session(engine) as session, session.begin():
            repo = JobRepository(Job)
            assert repo.enqueue(session, "new").max_attempts is None
            assert repo.enqueue(session, "new-5", max_attempts=5).max_attempts == 5
    finally:
        engine.dispose()
    by_task = f"SELECT task, max_attempts FROM {DEFAULT_TABLE} ORDER BY id"
    assert query(url, by_task) == [("old", 20), ("old-3", 3), ("new", None), ("new-5", 5)]
    assert_no_drift(REPO, url)

    alembic_cli("downgrade", "0002", cwd=REPO, database_url=url)
    assert query(url, by_task) == [("old", 20), ("old-3", 3), ("new", 20), ("new-5", 5)]
    assert snapshot(url, [DEFAULT_TABLE]) == previous


def test_revision_0008_builds_the_dashboards_indexes_on_a_table_with_jobs(
    create_database: Callable[[], URL]
) -> None:
    """0008 builds ``ix_<t>_status_v1`` CONCURRENTLY on a table that has jobs
    (valid, and used by the dashboard's queries); its downgrade (to 0007) drops them and nothing else."""
    url = create_database()
    alembic_cli("upgrade", "0007", cwd=REPO, database_url=url)
    previous = snapshot(url, [DEFAULT_TABLE])
    execute(url, f"INSERT INTO {DEFAULT_TABLE} (task, status, finished_at) "
                 "SELECT 'old', CASE WHEN n % 2 = 0 THEN 'dead' ELSE 'pending' END, "
                 "CASE WHEN n % 2 = 0 THEN now() END FROM generate_series(1, 1000) AS n")
    alembic_cli("upgrade", "head", cwd=REPO, database_url=url)
    assert_job_objects(url, DEFAULT_TABLE)
    valid = query(url, "SELECT c.relname, i.indisvalid FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid "
                       "WHERE c.relname LIKE :like", like=f"ix_{DEFAULT_TABLE}_%_v1")
    assert (f"ix_{DEFAULT_TABLE}_status_v1", True) in set(valid)
    assert_no_drift(REPO, url)
    alembic_cli("downgrade", "0007", cwd=REPO, database_url=url)
    assert snapshot(url, [DEFAULT_TABLE]) == previous


def test_check_reports_real_drift(create_database: Callable[[], URL]) -> None:
    """``alembic check`` is not blind: a dropped column and a stray index are reported."""
    url = create_database()
    alembic_cli("upgrade", "head", cwd=REPO, database_url=url)
    execute(
        url,
        f"ALTER TABLE {DEFAULT_TABLE} DROP COLUMN finished_at",
        f"CREATE INDEX ix_stray ON {DEFAULT_TABLE} (task)",
    )
    proc = alembic_cli("check", cwd=REPO, database_url=url, check=False)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "finished_at" in output
    assert "ix_stray" in output


def test_project_revisions_on_a_given_connection(create_database: Callable[[], URL]) -> None:
    """``config.attributes["connection"]``: migrations run on the caller's connection."""
    url = create_database()
    cfg = Config(str(REPO / "alembic.ini"))
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, "head")
            conn.commit()
        assert_job_objects(url, DEFAULT_TABLE)
        assert reloptions(url, DEFAULT_TABLE) == expected_reloptions(dict(QUEUE_STORAGE))

        with engine.connect() as conn:
            cfg.attributes["connection"] = conn
            command.downgrade(cfg, "base")
            conn.commit()
        assert DEFAULT_TABLE not in tables(url)
    finally:
        engine.dispose()


def test_offline_sql_needs_no_database() -> None:
    proc = alembic_cli("upgrade", "head", "--sql", cwd=REPO, database_url=None)
    sql = proc.stdout
    assert f"CREATE TABLE {DEFAULT_TABLE}" in sql
    assert f"ON {DEFAULT_TABLE} (priority, run_at, id) WHERE status = 'pending'" in sql
    assert "CONSTRAINT ck_sa_jobqueue_jobs_status_v1 CHECK" in sql
    assert f"ALTER TABLE {DEFAULT_TABLE} SET (fillfactor = 80" in sql
    assert "INSERT INTO sa_jobqueue_alembic_version" in sql


def test_online_without_database_url_says_what_to_set() -> None:
    proc = alembic_cli("upgrade", "head", cwd=REPO, database_url=None, check=False)
    assert proc.returncode != 0
    assert "DATABASE_URL is not set" in proc.stderr


# --------------------------------------------------------------------------- a user's environment

MODELS = '''
from sqlalchemy import ForeignKey, Index, MetaData, String
from sqlalchemy.orm import DeclarativeBase, Mapped, declared_attr, mapped_column

from sa_jobqueue import JobMixin, job_table_args


class Base(DeclarativeBase):
    # A naming convention, as many apps have: the job objects keep their own names.
    metadata = MetaData(naming_convention={{
        "ix": "ix_%(column_0_label)s",
        "uq": "uq_%(table_name)s_%(column_0_name)s",
        "ck": "ck_%(table_name)s_%(constraint_name)s",
        "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    }})


class Customer(Base):
    __tablename__ = "customers"
    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(100))


class EmailJob(JobMixin, Base):
    __tablename__ = "email_jobs"
    customer_id: Mapped[int | None] = mapped_column(ForeignKey("customers.id"))

    @declared_attr.directive
    def __table_args__(cls):
        return (*job_table_args(cls.__tablename__), Index("ix_email_jobs_customer", "customer_id"))


class ReportJob(JobMixin, Base):
    __tablename__ = "{report_table}"
    __keep_done__ = True
'''

USER_ENV = '''
import os

from alembic import context
from sqlalchemy import create_engine, pool

from sa_jobqueue.urls import psycopg_url

import models

config = context.config
target_metadata = models.Base.metadata


def run_migrations_offline():
    context.configure(
        url=psycopg_url(os.environ["DATABASE_URL"]),
        target_metadata=target_metadata,
        literal_binds=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online():
    engine = create_engine(psycopg_url(os.environ["DATABASE_URL"]), poolclass=pool.NullPool)
    with engine.connect() as connection:
        context.configure(connection=connection, target_metadata=target_metadata)
        with context.begin_transaction():
            context.run_migrations()
    engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
'''

USER_INI = """
[alembic]
script_location = %(here)s/alembic
prepend_sys_path = .
path_separator = os
"""

RENAME_REVISION = '''
"""rename report_jobs to invoice_jobs, tune storage"""

from sa_jobqueue.migrations import (
    QUEUE_STORAGE,
    rename_job_table,
    reset_queue_storage,
    set_queue_storage,
)

revision = "u0002"
down_revision = "u0001"
branch_labels = None
depends_on = None


def upgrade():
    rename_job_table("report_jobs", "invoice_jobs")
    set_queue_storage("invoice_jobs", fillfactor=90, autovacuum_vacuum_cost_delay=0)
    set_queue_storage("email_jobs")


def downgrade():
    reset_queue_storage("email_jobs")
    # Extra parameters are reset by name, next to the defaults.
    reset_queue_storage("invoice_jobs", *QUEUE_STORAGE, "autovacuum_vacuum_cost_delay")
    rename_job_table("invoice_jobs", "report_jobs")
'''


def write_models(project: Path, report_table: str) -> None:
    (project / "models.py").write_text(MODELS.format(report_table=report_table))


def load_models(project: Path, tag: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"user_models_{tag}", project / "models.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def user_project(tmp_path: Path) -> Path:
    """An ``alembic init``-style project with a models module of its own."""
    (tmp_path / "alembic" / "versions").mkdir(parents=True)
    (tmp_path / "alembic" / "env.py").write_text(textwrap.dedent(USER_ENV))
    (tmp_path / "alembic" / "script.py.mako").write_text(
        (REPO / "alembic" / "script.py.mako").read_text()
    )
    (tmp_path / "alembic.ini").write_text(USER_INI)
    write_models(tmp_path, "report_jobs")
    return tmp_path


def test_user_environment_autogenerate_upgrade_rename(
    user_project: Path, create_database: Callable[[], URL]
) -> None:
    url = create_database()
    user_tables = ["customers", "email_jobs", "report_jobs"]

    alembic_cli(
        "revision", "--autogenerate", "--rev-id", "u0001", "-m", "jobs",
        cwd=user_project, database_url=url,
    )
    (generated,) = (user_project / "alembic" / "versions").glob("u0001_*.py")
    source = generated.read_text()
    for table in ("email_jobs", "report_jobs"):
        assert (
            f"op.create_index(op.f('ix_{table}_claim_v2'), '{table}', ['queue', 'priority', 'run_at', 'id']"
        ) in source
        assert "postgresql_where=sa.text(\"status = 'pending'\")" in source
        assert "postgresql_where=sa.text(\"status = 'running'\")" in source
        assert f"op.create_index(op.f('uq_{table}_dedupe_v1'), '{table}', " in source
        assert (f"op.create_index(op.f('ix_{table}_dedupe_done_v1'), '{table}', "
                "['queue', 'dedupe_key', 'created_at']") in source
        assert f"op.create_index(op.f('ix_{table}_status_v1'), '{table}', ['status', 'queue', 'id']" in source
        assert f"name=op.f('ck_{table}_status_v1')" in source
        assert f"name=op.f('ck_{table}_max_attempts_v1')" in source
    assert (
        "postgresql_where=sa.text(\"dedupe_key IS NOT NULL AND status IN "
        "('pending', 'running')\")"
    ) in source
    assert "sa.Column('customer_id', sa.Integer(), nullable=True)" in source
    assert "op.create_index('ix_email_jobs_customer', 'email_jobs', ['customer_id']" in source
    assert "sa.Identity(always=False)" in source
    assert "postgresql.JSONB" in source
    # Stock types only: the revision does not depend on sa_jobqueue.
    assert "sa_jobqueue" not in source

    alembic_cli("upgrade", "head", cwd=user_project, database_url=url)
    assert set(user_tables) <= tables(url)
    for table in ("email_jobs", "report_jobs"):
        assert_job_objects(url, table)
    models = load_models(user_project, "before")
    assert snapshot(url, user_tables) == reference_snapshot(
        create_database, models.Base.metadata, user_tables
    )
    assert_no_drift(user_project, url)

    # Rows that must survive the rename, and a live dedupe key that must stay unique.
    execute(
        url,
        "INSERT INTO report_jobs (task, dedupe_key) VALUES ('monthly', 'm-2026-11')",
        "INSERT INTO report_jobs (task) VALUES ('weekly')",
    )

    # A hand-written revision: rename a job table, tune storage; then the model follows.
    (user_project / "alembic" / "versions" / "u0002_rename.py").write_text(RENAME_REVISION)
    write_models(user_project, "invoice_jobs")
    alembic_cli("upgrade", "head", cwd=user_project, database_url=url)

    renamed_tables = ["customers", "email_jobs", "invoice_jobs"]
    assert "report_jobs" not in tables(url)
    assert_job_objects(url, "invoice_jobs")
    assert set(indexes(url, "invoice_jobs")) == {
        "invoice_jobs_pkey",
        "ix_invoice_jobs_claim_v2",
        "ix_invoice_jobs_lease_v1",
        "uq_invoice_jobs_dedupe_v1",
        "ix_invoice_jobs_dedupe_done_v1",  # renamed too
        "ix_invoice_jobs_status_v1",
    }
    renamed_constraints = set(constraints(url, "invoice_jobs"))
    # PostgreSQL 18+ also lists NOT NULL constraints, named <table>_<column>_not_null.
    assert {n for n in renamed_constraints if not n.endswith("_not_null")} == {
        "invoice_jobs_pkey",
        "ck_invoice_jobs_status_v1",
        "ck_invoice_jobs_max_attempts_v1",
    }
    assert not [n for n in renamed_constraints if "report_jobs" in n]
    assert "invoice_jobs_id_seq" in sequences(url)
    assert "report_jobs_id_seq" not in sequences(url)
    # The database now is exactly what a fresh create_all of the renamed models gives.
    renamed = load_models(user_project, "after")
    assert snapshot(url, renamed_tables) == reference_snapshot(
        create_database, renamed.Base.metadata, renamed_tables
    )
    assert reloptions(url, "invoice_jobs") == expected_reloptions(
        queue_storage(fillfactor=90, autovacuum_vacuum_cost_delay=0)
    )
    assert reloptions(url, "email_jobs") == expected_reloptions(dict(QUEUE_STORAGE))
    assert reloptions(url, "customers") == {}
    # The rows came along; identity and the dedupe index still work under the new names.
    assert query(url, "SELECT id, task FROM invoice_jobs ORDER BY id") == [
        (1, "monthly"),
        (2, "weekly"),
    ]
    assert query(url, "INSERT INTO invoice_jobs (task) VALUES ('daily') RETURNING id") == [(3,)]
    duplicate = query(
        url,
        "INSERT INTO invoice_jobs (task, dedupe_key) VALUES ('monthly', 'm-2026-11') "
        "ON CONFLICT (queue, dedupe_key) WHERE dedupe_key IS NOT NULL "
        "AND status IN ('pending', 'running') DO NOTHING RETURNING id",
    )
    assert duplicate == []
    assert_no_drift(user_project, url)

    # Downgrade undoes both: old names back, storage reset.
    alembic_cli("downgrade", "u0001", cwd=user_project, database_url=url)
    assert "invoice_jobs" not in tables(url)
    assert_job_objects(url, "report_jobs")
    assert "report_jobs_id_seq" in sequences(url)
    assert reloptions(url, "report_jobs") == {}
    assert reloptions(url, "email_jobs") == {}
    assert snapshot(url, user_tables) == reference_snapshot(
        create_database, models.Base.metadata, user_tables
    )


def test_user_job_tables_of_the_previous_version_migrate_by_autogenerate_and_the_documented_edits(
    user_project: Path, create_database: Callable[[], URL]
) -> None:
    """docs/alembic.md: your own job tables need ``cancel_requested_at`` and a
    nullable ``max_attempts`` without a default too; autogenerate writes both
    but the default's drop, which the docs say to add, with a downgrade. The
    previous version's tables are today's without the column, with ``max_attempts
    NOT NULL DEFAULT 20``."""
    url = create_database()
    alembic_cli(
        "revision", "--autogenerate", "--rev-id", "u0001", "-m", "jobs",
        cwd=user_project, database_url=url,
    )
    (first,) = (user_project / "alembic" / "versions").glob("u0001_*.py")
    previous = first.read_text().replace(
        "    sa.Column('cancel_requested_at', sa.DateTime(timezone=True), nullable=True),\n", ""
    ).replace(
        "    sa.Column('result', sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql'), "
        "nullable=True),\n", ""
    ).replace(
        "    sa.Column('meta', sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql'), "
        "nullable=True),\n", ""
    ).replace(
        "    sa.Column('dedupe_until', sa.String(length=16), nullable=True),\n", ""
    ).replace(
        "    sa.Column('progress', sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql'), "
        "nullable=True),\n", ""
    ).replace(
        "sa.Column('max_attempts', sa.Integer(), nullable=True)",
        "sa.Column('max_attempts', sa.Integer(), server_default=sa.text('20'), nullable=False)",
    )
    assert "cancel_requested_at" not in previous and "server_default=sa.text('20')" in previous
    # Nor the index of dedupe windows (each of its create and drop is one line of the revision).
    previous = "".join(line for line in previous.splitlines(keepends=True) if "_dedupe_done_v1" not in line)
    # Nor the dashboard's indexes (revision 0008).
    previous = "".join(line for line in previous.splitlines(keepends=True)
                       if not re.search(r"'ix_\w+_status_v1'", line))
    assert "'result'" not in previous and "'meta'" not in previous and "'dedupe_until'" not in previous
    assert "'progress'" not in previous
    first.write_text(previous)
    alembic_cli("upgrade", "head", cwd=user_project, database_url=url)
    execute(url, "INSERT INTO email_jobs (task) VALUES ('noop')")
    user_tables = ["customers", "email_jobs", "report_jobs"]
    before = snapshot(url, user_tables)
    proc = alembic_cli("check", cwd=user_project, database_url=url, check=False)
    assert proc.returncode != 0 and "cancel_requested_at" in proc.stdout + proc.stderr

    alembic_cli(
        "revision", "--autogenerate", "--rev-id", "u0002", "-m", "cancel requests",
        cwd=user_project, database_url=url,
    )
    (second,) = (user_project / "alembic" / "versions").glob("u0002_*.py")
    source = second.read_text()
    for table in ("email_jobs", "report_jobs"):
        assert (
            f"op.add_column('{table}', sa.Column('cancel_requested_at', sa.DateTime(timezone=True), "
            "nullable=True))"
        ) in source
        assert f"op.drop_column('{table}', 'cancel_requested_at')" in source
        assert (f"op.add_column('{table}', sa.Column('dedupe_until', sa.String(length=16), nullable=True))"
                in source)
        assert f"op.create_index(op.f('ix_{table}_dedupe_done_v1'), '{table}', " in source
        assert (f"op.add_column('{table}', sa.Column('progress', sa.JSON().with_variant(postgresql.JSONB("
                "astext_type=sa.Text()), 'postgresql'), nullable=True))") in source
        assert f"op.drop_index(op.f('ix_{table}_dedupe_done_v1')" in source
        assert f"op.create_index(op.f('ix_{table}_status_v1'), '{table}', " in source
        assert f"op.drop_index(op.f('ix_{table}_status_v1')" in source
        # max_attempts: nullable now; the server default's drop is left to the
        # user (autogenerate compares defaults only with compare_server_default).
        assert (
            f"op.alter_column('{table}', 'max_attempts',\n               existing_type=sa.INTEGER(),\n"
            "               nullable=True,\n               existing_server_default=sa.text('20'))"
        ) in source
    # What docs/alembic.md says to add by hand: server_default=None in the
    # upgrade, and its downgrade snippet in place of the generated alter_column.
    assert source.count("nullable=True,\n               existing_server_default=sa.text('20'))") == 2
    source = source.replace(
        "nullable=True,\n               existing_server_default=sa.text('20'))",
        "nullable=True,\n               server_default=None,\n               existing_server_default=sa.text('20'))",
    )
    (snippet,) = [b for b in re.findall(r"```python\n(.*?)```", (REPO / "docs" / "alembic.md").read_text(), re.S)
                  if "UPDATE email_jobs SET max_attempts = 20" in b]
    for table in ("email_jobs", "report_jobs"):
        generated = (
            f"    op.alter_column('{table}', 'max_attempts',\n               existing_type=sa.INTEGER(),\n"
            "               nullable=False,\n               existing_server_default=sa.text('20'))\n"
        )
        assert generated in source
        source = source.replace(generated, textwrap.indent(snippet.replace("email_jobs", table), "    "))
    second.write_text(source)
    alembic_cli("upgrade", "head", cwd=user_project, database_url=url)
    assert_no_drift(user_project, url)
    models = load_models(user_project, "previous")
    assert snapshot(url, user_tables) == reference_snapshot(create_database, models.Base.metadata, user_tables)
    # A row of the previous version keeps its limit: given at enqueue, as far as the code can tell.
    assert query(url, "SELECT task, cancel_requested_at, max_attempts FROM email_jobs") == [("noop", None, 20)]
    execute(url, "INSERT INTO email_jobs (task) VALUES ('unset')", "INSERT INTO report_jobs (task) VALUES ('unset')")
    alembic_cli("downgrade", "u0001", cwd=user_project, database_url=url)
    assert snapshot(url, user_tables) == before
    assert query(url, "SELECT task, max_attempts FROM email_jobs ORDER BY id") == [("noop", 20), ("unset", 20)]
    assert query(url, "SELECT task, max_attempts FROM report_jobs") == [("unset", 20)]


# --------------------------------------------------------------------------- helpers' arguments


def _offline_sql(upgrade_body: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """Run a one-revision environment offline and return the rendered SQL."""
    (tmp_path / "alembic" / "versions").mkdir(parents=True)
    (tmp_path / "alembic.ini").write_text(USER_INI)
    (tmp_path / "alembic" / "env.py").write_text(
        textwrap.dedent(
            """
            from alembic import context
            context.configure(dialect_name="postgresql", literal_binds=True)
            with context.begin_transaction():
                context.run_migrations()
            """
        )
    )
    (tmp_path / "alembic" / "versions" / "x1.py").write_text(
        "from sa_jobqueue.migrations import downgrade_claim_index, rename_job_table, "
        "reset_queue_storage, set_queue_storage, upgrade_claim_index\n"
        "revision = 'x1'\ndown_revision = None\nbranch_labels = None\ndepends_on = None\n"
        f"def upgrade():\n{textwrap.indent(textwrap.dedent(upgrade_body), '    ')}\n"
        "def downgrade():\n    pass\n"
    )
    return alembic_cli("upgrade", "head", "--sql", cwd=tmp_path, database_url=None, check=False)


def test_helpers_render_quoted_sql_offline(tmp_path: Path) -> None:
    proc = _offline_sql(
        """
        set_queue_storage("Jobs", schema="work", fillfactor=None, vacuum_truncate=False)
        reset_queue_storage("Jobs", "fillfactor", schema="work")
        rename_job_table("Jobs", "order", schema="work")
        """,
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    sql = proc.stdout
    assert (
        'ALTER TABLE work."Jobs" SET (autovacuum_vacuum_scale_factor = 0.02, '
        "autovacuum_vacuum_threshold = 200, autovacuum_analyze_scale_factor = 0.02, "
        "vacuum_truncate = false)"
    ) in sql
    assert 'ALTER TABLE work."Jobs" RESET (fillfactor)' in sql
    assert 'ALTER TABLE work."Jobs" RENAME TO "order"' in sql
    assert 'ALTER TABLE work."order" RENAME CONSTRAINT "ck_Jobs_status_v1" TO ck_order_status_v1' in sql
    assert 'ALTER INDEX work."ix_Jobs_claim_v2" RENAME TO ix_order_claim_v2' in sql
    assert 'ALTER INDEX IF EXISTS work."Jobs_pkey" RENAME TO order_pkey' in sql
    assert 'ALTER SEQUENCE IF EXISTS work."Jobs_id_seq" RENAME TO order_id_seq' in sql
    assert "WHERE c.conrelid = 'work.\"order\"'::regclass" in sql


@pytest.mark.parametrize(
    ("body", "parameter"),
    [
        ('set_queue_storage("jobs; DROP TABLE x")', "table_name"),
        ('set_queue_storage("jobs", fillfactor="80; DROP TABLE x")', "fillfactor"),
        ('set_queue_storage("jobs", **{"Bad-Name": 1})', "Bad-Name"),
        ('reset_queue_storage("jobs", schema="a.b")', "schema"),
        ('rename_job_table("jobs", "jobs")', "new"),
        ('rename_job_table("jobs", "j" * 45)', "new"),
    ],
)
def test_helpers_refuse_bad_arguments(tmp_path: Path, body: str, parameter: str) -> None:
    proc = _offline_sql(body, tmp_path)
    assert proc.returncode != 0
    assert f"InvalidArgumentError: {parameter}: " in proc.stderr
    assert "ALTER" not in proc.stdout


def test_queue_storage_merges_overrides() -> None:
    assert queue_storage() == dict(QUEUE_STORAGE)
    merged = queue_storage(fillfactor=None, autovacuum_vacuum_cost_delay=0)
    assert "fillfactor" not in merged
    assert merged["autovacuum_vacuum_cost_delay"] == 0
    with pytest.raises(TypeError):
        QUEUE_STORAGE["fillfactor"] = 50  # type: ignore[index]
    assert issubclass(InvalidArgumentError, ValueError)
