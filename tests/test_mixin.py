"""JobMixin: several job tables with user columns, DDL names, the misuse error."""

from __future__ import annotations

import jobapp
import pytest
from sqlalchemy import Engine, Index, inspect, text
from sqlalchemy.orm import DeclarativeBase, Mapped, declared_attr
from sqlalchemy.schema import CreateIndex, CreateTable

from sa_jobqueue import JobMixin, JobRepository, JobTableError, job_table_args


def test_two_job_tables_and_user_columns_on_one_base(engine: Engine) -> None:
    insp = inspect(engine)
    for table in ("task_jobs", "email_jobs", "report_jobs"):
        columns = {c["name"] for c in insp.get_columns(table)}
        assert {
            "id", "queue", "task", "payload", "status", "priority", "run_at", "created_at",
            "attempts", "max_attempts", "locked_at", "locked_by", "lease_expires_at",
            "lock_token", "last_error", "dedupe_key", "finished_at",
        } <= columns
    assert "tenant_id" in {c["name"] for c in insp.get_columns("email_jobs")}
    assert "tenant_id" not in {c["name"] for c in insp.get_columns("task_jobs")}


def test_names_derive_from_the_table_and_never_collide(engine: Engine) -> None:
    with engine.connect() as conn:
        rows = conn.execute(
            text("SELECT tablename, indexname, indexdef FROM pg_indexes WHERE tablename IN ('task_jobs', 'email_jobs')")
        ).all()
        checks = set(conn.execute(
            text("SELECT conname FROM pg_constraint WHERE contype = 'c' AND conrelid = 'email_jobs'::regclass")
        ).scalars())
    defs = {name: (table, d) for table, name, d in rows}
    assert defs["ix_email_jobs_claim_v2"][0] == "email_jobs"
    assert defs["ix_task_jobs_claim_v2"][0] == "task_jobs"
    claim = defs["ix_task_jobs_claim_v2"][1]
    assert "(queue, priority, run_at, id)" in claim and "WHERE ((status)::text = 'pending'::text)" in claim
    lease = defs["ix_task_jobs_lease_v1"][1]
    assert "(lease_expires_at)" in lease and "'running'" in lease
    dedupe = defs["uq_task_jobs_dedupe_v1"][1]
    assert dedupe.startswith("CREATE UNIQUE INDEX") and "(queue, dedupe_key)" in dedupe
    assert "dedupe_key IS NOT NULL" in dedupe and "'pending'" in dedupe and "'running'" in dedupe
    assert checks == {"ck_email_jobs_status_v1", "ck_email_jobs_max_attempts_v1"}


def test_status_is_a_string_with_a_check_not_an_enum(engine: Engine) -> None:
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM pg_type WHERE typtype = 'e'")).scalar() == 0
        with pytest.raises(Exception, match="ck_task_jobs_status_v1"):
            conn.execute(text("INSERT INTO task_jobs (task, status) VALUES ('x', 'bogus')"))


def test_naming_convention_does_not_rename_job_objects() -> None:
    class ConventionBase(DeclarativeBase):
        pass

    ConventionBase.metadata.naming_convention = {
        "ix": "ix_%(column_0_label)s", "ck": "ck_%(table_name)s_%(constraint_name)s",
    }

    class Conv(JobMixin, ConventionBase):
        __tablename__ = "conv_jobs"

    ddl = str(CreateTable(Conv.__table__).compile())
    assert "CONSTRAINT ck_conv_jobs_status_v1 CHECK" in ddl
    names = {i.name for i in Conv.__table__.indexes}
    assert names == {"ix_conv_jobs_claim_v2", "ix_conv_jobs_lease_v1", "uq_conv_jobs_dedupe_v1",
                     "ix_conv_jobs_dedupe_done_v1", "ix_conv_jobs_status_v1"}
    JobRepository(Conv)


def test_a_table_that_replaced_table_args_is_refused() -> None:
    class OtherBase(DeclarativeBase):
        pass

    class Careless(JobMixin, OtherBase):
        __tablename__ = "careless_jobs"
        __table_args__ = (Index("ix_careless_queue", "queue"),)

    with pytest.raises(JobTableError, match=r"careless_jobs.*lacks the job indexes.*ix_careless_jobs_claim_v2"):
        JobRepository(Careless)


def test_table_args_that_keep_the_job_ones_are_accepted() -> None:
    class OtherBase(DeclarativeBase):
        pass

    class Careful(JobMixin, OtherBase):
        __tablename__ = "careful_jobs"
        tenant_id: Mapped[int | None]

        @declared_attr.directive
        def __table_args__(cls) -> tuple[object, ...]:
            return (*job_table_args(cls.__tablename__), Index("ix_careful_tenant", "tenant_id"))

    JobRepository(Careful)
    ddl = [str(CreateIndex(i).compile()) for i in Careful.__table__.indexes]
    assert any("ix_careful_tenant" in d for d in ddl)


@pytest.mark.parametrize("model", [object, jobapp.Ledger, "task_jobs", None, JobMixin])
def test_unknown_models_are_refused(model: object) -> None:
    with pytest.raises(JobTableError, match="model"):
        JobRepository(model)  # type: ignore[arg-type]


def test_a_table_name_too_long_for_its_derived_names_is_refused() -> None:
    class OtherBase(DeclarativeBase):
        pass

    with pytest.raises(JobTableError, match="__tablename__.*44 bytes"):

        class TooLong(JobMixin, OtherBase):
            __tablename__ = "j" * 45

    class JustFits(JobMixin, OtherBase):
        __tablename__ = "j" * 44

    assert max(len(i.name) for i in JustFits.__table__.indexes) <= 63
