"""Columns whose type processes values (a ``TypeDecorator``): every enqueue verb stores
what SQLAlchemy would store, COPY or not (sa_jobqueue/bulk.py, ``sent_as_is``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from sqlalchemy import JSON, Engine, String, create_engine, select, text
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.engine import URL
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column
from sqlalchemy.types import TypeDecorator

from sa_jobqueue import JobMixin, JobRepository, JobSpec
from sa_jobqueue.bulk import COPY_THRESHOLD, sent_as_is
from sa_jobqueue.default import Job


class Sealed(TypeDecorator[Any]):
    """A payload type that changes what is stored (as an encrypting type would)."""

    impl = JSONB
    cache_ok = True

    def process_bind_param(self, value: Any, dialect: Any) -> Any:
        return {"sealed": value}

    def process_result_value(self, value: Any, dialect: Any) -> Any:
        return value["sealed"] if isinstance(value, dict) and "sealed" in value else ("NOT SEALED", value)


class Upper(TypeDecorator[str]):
    """A task name type that stores names in capitals."""

    impl = String(128)
    cache_ok = True

    def process_bind_param(self, value: Any, dialect: Any) -> Any:
        return None if value is None else str(value).upper()


class TypesBase(DeclarativeBase):
    pass


class SealedJob(JobMixin, TypesBase):
    __tablename__ = "sealed_jobs"
    payload: Mapped[Any] = mapped_column(Sealed())


class VariantJob(JobMixin, TypesBase):
    """The processing type chosen for PostgreSQL only, through a variant."""

    __tablename__ = "variant_jobs"
    payload: Mapped[Any] = mapped_column(JSON().with_variant(Sealed(), "postgresql"))


class UpperJob(JobMixin, TypesBase):
    __tablename__ = "upper_jobs"
    task: Mapped[str] = mapped_column(Upper())


class PlainJSONBJob(JobMixin, TypesBase):
    """A payload declared as plain JSONB: nothing to apply, COPY may write it."""

    __tablename__ = "plain_jsonb_jobs"
    payload: Mapped[Any] = mapped_column(JSONB)


@pytest.fixture(scope="module")
def types_engine(create_database: Callable[[], URL]) -> Iterator[Engine]:
    engine = create_engine(create_database())
    TypesBase.metadata.create_all(engine)
    try:
        yield engine
    finally:
        engine.dispose()


def test_only_tables_whose_types_copy_as_is_take_the_copy() -> None:
    assert sent_as_is(Job.__table__) and sent_as_is(PlainJSONBJob.__table__)  # type: ignore[arg-type]
    for model in (SealedJob, VariantJob, UpperJob):
        assert not sent_as_is(model.__table__), model  # type: ignore[arg-type]


VERBS = ["enqueue", "enqueue_many", "enqueue_many_fast"]


def _enqueue(repo: JobRepository[Any], session: Session, verb: str, count: int) -> None:
    if verb == "enqueue":
        for i in range(count):
            repo.enqueue(session, "send", {"i": i})
    else:
        getattr(repo, verb)(session, [JobSpec("send", {"i": i}) for i in range(count)])


@pytest.mark.parametrize("verb", VERBS)
@pytest.mark.parametrize("model", [SealedJob, VariantJob])
def test_a_payload_type_is_applied_by_every_verb(types_engine: Engine, model: Any, verb: str) -> None:
    repo = JobRepository(model)
    count = COPY_THRESHOLD * 2  # enough for COPY, had the table taken it
    with Session(types_engine) as session, session.begin():
        session.execute(text(f"TRUNCATE {model.__tablename__}"))
        _enqueue(repo, session, verb, count)
    with Session(types_engine) as session:
        stored = session.scalars(text(f"SELECT payload FROM {model.__tablename__} ORDER BY id")).all()
        read = session.scalars(select(model.payload).order_by(model.id)).all()
    assert stored == [{"sealed": {"i": i}} for i in range(count)]
    assert read == [{"i": i} for i in range(count)]


@pytest.mark.parametrize("verb", VERBS)
def test_a_task_type_is_applied_by_every_verb(types_engine: Engine, verb: str) -> None:
    with Session(types_engine) as session, session.begin():
        session.execute(text("TRUNCATE upper_jobs"))
        _enqueue(JobRepository(UpperJob), session, verb, COPY_THRESHOLD * 2)
    with Session(types_engine) as session:
        assert set(session.scalars(text("SELECT task FROM upper_jobs")).all()) == {"SEND"}


def test_the_snapshots_read_the_payload_through_its_type(types_engine: Engine) -> None:
    repo = JobRepository(SealedJob)
    with Session(types_engine) as session, session.begin():
        one = repo.enqueue(session, "send", {"i": -1})
        many = repo.enqueue_many(session, [JobSpec("send", {"i": i}) for i in range(COPY_THRESHOLD)])
    assert one.payload == {"i": -1}
    assert [job.payload for job in many] == [{"i": i} for i in range(COPY_THRESHOLD)]
