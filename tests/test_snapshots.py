"""Jobs handed back by enqueue, enqueue_many and claim are detached snapshots
equal to the stored rows, whichever path wrote them (INSERT or COPY)."""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from decimal import Decimal
from typing import Any

import pytest
from jobapp import EmailJob, TaskJob, emails, jobs
from sqlalchemy import DateTime, Engine, create_engine, func, select, text
from sqlalchemy import inspect as sa_inspect
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker
from sqllog import recorded_sql

from sa_jobqueue import JobMixin, JobRepository, JobSpec
from sa_jobqueue.aio import AsyncJobRepository
from sa_jobqueue.bulk import COPY_THRESHOLD, NOW, stored_defaults
from sa_jobqueue.mixin import COLUMN_DEFAULTS


def _columns(job: Any) -> dict[str, Any]:
    return {attr.key: getattr(job, attr.key) for attr in sa_inspect(type(job)).column_attrs}


def _assert_equal_to_rows(session: Session, snapshots: list[Any]) -> None:
    model = type(snapshots[0])
    stored = {row.id: row for row in session.scalars(select(model).where(model.id.in_([j.id for j in snapshots])))}
    assert len(stored) == len({j.id for j in snapshots})
    for job in snapshots:
        assert _columns(job) == _columns(stored[job.id])


def _specs(n: int) -> list[JobSpec]:
    at = datetime(2030, 1, 2, 3, 4, 5, 678901, tzinfo=timezone(timedelta(hours=5)))
    return [
        JobSpec(
            "noop", {"i": i, "tuple": (1, "a"), "nested": {"k": [None, True, 1.5]}}, queue=f"q{i % 3}",
            priority=i % 7 - 3, max_attempts=None if i % 3 == 0 else i % 4 + 1,
            run_at=at if i % 5 == 0 else None, delay=timedelta(seconds=i) if i % 5 == 1 else None,
        )
        for i in range(n)
    ]


def test_bulk_enqueue_copies_and_returns_what_was_stored(sessions: sessionmaker[Session], engine: Engine) -> None:
    with recorded_sql(engine) as sent, sessions.begin() as session:
        created = jobs.enqueue_many(session, _specs(200))
    assert not [s for s in sent if s.startswith("INSERT")], "plain rows of a plain job table go through COPY"
    assert [job.payload["i"] for job in created] == list(range(200))
    assert created[0].payload["tuple"] == [1, "a"], "as read back from jsonb"
    assert [job.id for job in created] == sorted(job.id for job in created)
    with sessions() as session:
        _assert_equal_to_rows(session, created)
        now = session.scalar(select(func.now()))
        assert now is not None
        # A delayed row is due at its enqueue time plus its delay, on the database's clock.
        assert created[1].run_at == created[1].created_at + timedelta(seconds=1)


class _CountedPayload(dict[str, Any]):
    """A payload that counts its JSON encodings: json's encoder reads a dict subclass through items()."""

    encodings = 0

    def items(self) -> Any:
        type(self).encodings += 1
        return super().items()


@pytest.mark.parametrize("verb", ["enqueue_many", "enqueue_many_report", "enqueue"])
def test_bulk_enqueue_sends_each_payload_as_its_check_encoded_it(sessions: sessionmaker[Session], verb: str) -> None:
    # What COPY (and the one-job INSERT) sends is the text the payload's checks passed: encoded once.
    _CountedPayload.encodings = 0
    specs = [JobSpec("noop", _CountedPayload(i=i)) for i in range(COPY_THRESHOLD * 2 if verb != "enqueue" else 1)]
    with sessions.begin() as session:
        if verb == "enqueue":
            made = [jobs.enqueue(session, "noop", specs[0].payload)]
        else:
            made = getattr(jobs, verb)(session, specs)
    assert _CountedPayload.encodings == len(specs)
    created = [getattr(item, "job", item) for item in made]
    assert [job.payload for job in created] == [{"i": i} for i in range(len(specs))]
    with sessions() as session:
        _assert_equal_to_rows(session, created)


def test_bulk_enqueue_rolls_back_with_the_callers_transaction(sessions: sessionmaker[Session]) -> None:
    with sessions() as session:
        session.begin()
        jobs.enqueue_many(session, _specs(COPY_THRESHOLD * 4))
        session.rollback()
    with sessions() as session:
        assert session.scalar(select(func.count()).select_from(TaskJob)) == 0
    with sessions.begin() as session:
        jobs.enqueue_many(session, _specs(COPY_THRESHOLD * 4))
    with sessions() as session:
        assert session.scalar(select(func.count()).select_from(TaskJob)) == COPY_THRESHOLD * 4


def test_insert_paths_return_what_was_stored(sessions: sessionmaker[Session]) -> None:
    with sessions.begin() as session:
        few = jobs.enqueue_many(session, _specs(COPY_THRESHOLD - 1))  # under the COPY threshold
        own_column = emails.enqueue_many(
            session, [JobSpec("noop", {"i": i}, extra={"tenant_id": i}) for i in range(50)]
        )
        one = jobs.enqueue(session, "noop", {"x": 1}, delay=30)
        deduped = jobs.enqueue_many(session, [JobSpec("noop", dedupe_key=f"k{i % 10}") for i in range(40)])
    assert [job.tenant_id for job in own_column] == list(range(50))
    with sessions() as session:
        for created in (few, own_column, [one], deduped):
            _assert_equal_to_rows(session, created)


def test_one_enqueue_returns_what_was_stored(sessions: sessionmaker[Session], engine: Engine) -> None:
    """A plain job table's one-row INSERT returns only id, created_at and run_at, and the
    snapshot is built from the row (bulk.stored_row): it equals the stored row, column by
    column, whatever the row holds (a run_at, a delay, a limit, meta, a tuple in the payload),
    with or without the NOTIFY folded in; a table with columns of its own returns every column."""
    specs = _specs(10)
    with recorded_sql(engine) as sent, sessions.begin() as session:
        made = [jobs.enqueue(session, s.task, s.payload, queue=s.queue, priority=s.priority, run_at=s.run_at,
                             delay=s.delay, max_attempts=s.max_attempts, meta={"m": (1, 2)} if i % 2 else None)
                for i, s in enumerate(specs)]
        own = emails.enqueue(session, "noop", {"x": 1}, extra={"tenant_id": 3})
    inserts = [s for s in sent if s.startswith("INSERT INTO task_jobs")]
    returned = [s[s.index(" RETURNING "):] for s in inserts]
    assert len(returned) == 10 and all(r.startswith(" RETURNING task_jobs.id, task_jobs.created_at, task_jobs.run_at")
                                       and "payload" not in r for r in returned), returned
    assert any("pg_notify" in s for s in inserts), "the first runnable job of a queue notifies in the same statement"
    assert made[0].payload["tuple"] == [1, "a"] and made[1].meta == {"m": [1, 2]}, "as read back from jsonb"
    with sessions() as session:
        _assert_equal_to_rows(session, made)
        _assert_equal_to_rows(session, [own])
    assert own.tenant_id == 3


def test_snapshots_are_detached_and_outlive_their_session(sessions: sessionmaker[Session], engine: Engine) -> None:
    with Session(engine) as session, session.begin():  # expire_on_commit=True, the default
        job = jobs.enqueue(session, "noop", {"a": 1})
        bulk = jobs.enqueue_many(session, _specs(40))
    state = sa_inspect(job)
    assert state.detached and state.identity == (job.id,)
    # The session committed and closed: reading emits no SQL and raises nothing.
    with recorded_sql(engine) as sent:
        assert (job.payload, job.status, bulk[-1].payload["i"]) == ({"a": 1}, "pending", 39)
    assert sent == []
    with sessions.begin() as session:
        claimed = jobs.claim(session, limit=100)
        assert all(sa_inspect(j).detached for j in claimed)
        _assert_equal_to_rows(session, claimed)
        # A snapshot can join a session, and reloads the row from there.
        attached = session.merge(claimed[0])
        assert attached.status == "running"
    with sessions() as session:
        reloaded = session.get(EmailJob, 10**12)
        assert reloaded is None


def test_copy_and_insert_store_the_same_rows_column_by_column(sessions: sessionmaker[Session], engine: Engine) -> None:
    """The COPY path fills in every column it leaves out from the mixin's own
    defaults (bulk.stored_defaults): the rows equal those the INSERT path
    writes for the same specs in the same transaction, every column but the id."""
    specs = _specs(COPY_THRESHOLD * 3)
    with sessions.begin() as session:
        with recorded_sql(engine) as sent:
            copied = jobs.enqueue_many(session, specs)
        assert not [s for s in sent if s.startswith("INSERT")], "these rows go through COPY"
        with recorded_sql(engine) as sent:
            inserted = [job for i in range(0, len(specs), COPY_THRESHOLD - 1)
                        for job in jobs.enqueue_many(session, specs[i:i + COPY_THRESHOLD - 1])]
        assert [s for s in sent if s.startswith("INSERT")], "chunks under the threshold go through INSERT"
    columns = {column.key for column in TaskJob.__table__.columns}
    with sessions() as session:
        _assert_equal_to_rows(session, copied)
        _assert_equal_to_rows(session, inserted)
        rows = {row.id: _columns(row) for row in session.scalars(select(TaskJob))}
    assert len(rows) == 2 * len(specs)
    for by_copy, by_insert in zip(copied, inserted, strict=True):
        a, b = rows[by_copy.id], rows[by_insert.id]
        assert set(a) == columns  # every column compared, cancel_requested_at and max_attempts included
        assert {k: v for k, v in a.items() if k != "id"} == {k: v for k, v in b.items() if k != "id"}
    assert {rows[j.id]["max_attempts"] for j in copied} == {None, 1, 2, 3, 4}


def test_copy_knows_the_defaults_from_the_mixins_one_definition() -> None:
    defaults = stored_defaults(TaskJob.__table__)
    assert defaults is not None
    assert {k: v for k, v in defaults.items() if k in COLUMN_DEFAULTS} == {
        k: v for k, v in COLUMN_DEFAULTS.items() if k in defaults
    }
    assert defaults["created_at"] is NOW
    assert {k for k, v in defaults.items() if v is None} == {
        "locked_at", "locked_by", "lease_expires_at", "lock_token", "last_error", "dedupe_key", "finished_at",
        "cancel_requested_at", "result", "meta", "dedupe_until", "progress",
    }


class OwnDefaultsBase(DeclarativeBase):
    pass


class OwnDefaultJob(JobMixin, OwnDefaultsBase):
    """A model that overrides a job column's default: only an INSERT applies it."""

    __tablename__ = "own_default_jobs"
    created_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), server_default=text("'2000-01-01 00:00:00+00'")
    )


def test_a_job_column_with_a_default_of_its_own_takes_the_insert_path(
    create_database: Callable[[], URL],
) -> None:
    assert stored_defaults(OwnDefaultJob.__table__) is None
    engine = create_engine(create_database())
    try:
        OwnDefaultsBase.metadata.create_all(engine)
        own = JobRepository(OwnDefaultJob)
        with recorded_sql(engine) as sent, Session(engine) as session, session.begin():
            created = own.enqueue_many(session, _specs(COPY_THRESHOLD * 2))
        assert [s for s in sent if s.startswith("INSERT")]
        assert {job.created_at for job in created} == {datetime(2000, 1, 1, tzinfo=timezone.utc)}
        with Session(engine) as session:
            _assert_equal_to_rows(session, created)
    finally:
        engine.dispose()


PAYLOADS = [
    {"text": "é ü 日本 \u2028 \U0001f600", "n": 1.1, "big": 2**70, "neg": -0.0, "exp": 1e300},
    [None, True, False, {"nested": {"deeper": ["x"]}}],
    {"quote": "\"'\\", "empty": {}, "list": []},
]
LOADED: list[type] = []


def _recording_loads(value: bytes) -> Any:
    """An application's json_deserializer (module level: psycopg caches its loader per function)."""
    LOADED.append(type(value))
    return {"decoded by": "the application", "value": json.loads(value)}


@pytest.mark.parametrize("deserializer", [None, _recording_loads], ids=["default", "engine-json_deserializer"])
def test_a_claim_decodes_payloads_as_the_driver_loads_them(
    db_url: URL, engine: Engine, deserializer: Callable[[bytes], Any] | None
) -> None:
    """The claim reads the payload as JSON text and decodes it itself
    (snapshot.json_loads): the payload equals what psycopg's own jsonb loader
    gives the ORM for the same row, custom deserializer or not."""
    options: dict[str, Any] = {} if deserializer is None else {"json_deserializer": deserializer}
    custom = create_engine(db_url, **options)
    try:
        with Session(custom) as session, session.begin():
            ids = [job.id for job in jobs.enqueue_many(session, [JobSpec("noop", p) for p in PAYLOADS])]
        LOADED.clear()
        with Session(custom) as session, session.begin():
            claimed = {job.id: job.payload for job in jobs.claim(session, limit=len(ids))}
        with Session(custom) as session:
            loaded = {job_id: session.get(TaskJob, job_id).payload for job_id in ids}  # type: ignore[union-attr]
    finally:
        custom.dispose()
    # repr: equal values of equal types, in the same key order (jsonb's: 1e300 reads back as an int).
    assert set(claimed) == set(ids) and [repr(claimed[i]) for i in ids] == [repr(loaded[i]) for i in ids]
    if deserializer is None:
        assert loaded[ids[1]] == PAYLOADS[1] and loaded[ids[0]]["text"] == PAYLOADS[0]["text"]  # type: ignore[call-overload]
    else:
        assert all(p["decoded by"] == "the application" for p in claimed.values())
        # Given bytes by the claim as by psycopg: once per row each.
        assert LOADED == [bytes] * (2 * len(PAYLOADS))


def _decimal_loads(value: str | bytes) -> Any:
    return json.loads(value, parse_float=Decimal)


@pytest.mark.parametrize("count", [1, COPY_THRESHOLD], ids=["enqueue", "enqueue_many through COPY"])
def test_enqueued_snapshots_read_json_as_the_engine_does(db_url: URL, engine: Engine, count: int) -> None:
    """With the engine's own ``json_deserializer``, the jobs an enqueue hands back hold
    the payload and meta the stored row gives (Decimal here, not float)."""
    custom = create_engine(db_url, json_deserializer=_decimal_loads)
    try:
        with Session(custom) as session, session.begin():
            specs = [JobSpec("noop", {"x": 1.5, "i": i}, meta={"w": 0.25}) for i in range(count)]
            made = [jobs.enqueue(session, "noop", {"x": 1.5, "i": 0}, meta={"w": 0.25})] if count == 1 else (
                jobs.enqueue_many(session, specs))
        with Session(custom) as session:
            _assert_equal_to_rows(session, made)
    finally:
        custom.dispose()
    assert [(type(job.payload["x"]), type(job.meta["w"])) for job in made] == [(Decimal, Decimal)] * count


@pytest.mark.anyio
@pytest.mark.parametrize("driver", ["psycopg", "asyncpg"])
async def test_enqueued_snapshots_read_json_as_the_async_engine_does(db_url: URL, engine: Engine, driver: str) -> None:
    """The same on an AsyncSession, each async driver, and for the claim."""
    custom = create_async_engine(db_url.set(drivername=f"postgresql+{driver}"), json_deserializer=_decimal_loads)
    repo = AsyncJobRepository(TaskJob)
    try:
        async with AsyncSession(custom) as session, session.begin():
            one = await repo.enqueue(session, "noop", {"x": 1.5})
            many = await repo.enqueue_many(session, [JobSpec("noop", {"x": 2.5}) for _ in range(COPY_THRESHOLD)])
        async with AsyncSession(custom) as session:
            stored = {job.id: job.payload for job in await session.scalars(select(TaskJob))}
        async with AsyncSession(custom) as session, session.begin():
            claimed = await repo.claim(session, limit=COPY_THRESHOLD + 1)
    finally:
        await custom.dispose()
    assert [job.payload for job in (one, *many)] == [stored[job.id] for job in (one, *many)]
    assert {type(job.payload["x"]) for job in (one, *many)} == {type(p["x"]) for p in stored.values()} == {Decimal}
    assert len(claimed) == COPY_THRESHOLD + 1 and {type(job.payload["x"]) for job in claimed} == {Decimal}


def _wrapping_dumps(value: Any) -> str:
    """An application's json_serializer that changes what is stored (not only its spelling)."""
    return json.dumps({"via": "app", "value": value})


@pytest.mark.parametrize("verb", ["enqueue", "enqueue_many", "enqueue_many_fast"])
def test_the_engines_json_serializer_writes_every_payload(db_url: URL, engine: Engine, verb: str) -> None:
    """With the engine's own ``json_serializer``, every verb stores the payload and meta as it
    writes them (COPY, which would send the checks' own JSON text, gives way to the INSERT), and the
    jobs handed back equal the stored rows."""
    custom = create_engine(db_url, json_serializer=_wrapping_dumps)
    count = COPY_THRESHOLD * 2
    try:
        with Session(custom) as session, session.begin():
            if verb == "enqueue":
                made = [jobs.enqueue(session, "noop", {"i": i}, meta={"m": i}) for i in range(count)]
            else:
                written = getattr(jobs, verb)(session, [JobSpec("noop", {"i": i}, meta={"m": i}) for i in range(count)])
        with Session(custom) as session:
            stored = session.execute(text("SELECT payload, meta FROM task_jobs ORDER BY id")).all()
            if verb != "enqueue_many_fast":
                _assert_equal_to_rows(session, made if verb == "enqueue" else written)
    finally:
        custom.dispose()
    assert [tuple(row) for row in stored] == [
        ({"via": "app", "value": {"i": i}}, {"via": "app", "value": {"m": i}}) for i in range(count)]
