"""sa_jobqueue.testing's helpers for users' test suites: enqueued(), run_enqueued()
and transactional_session(), against the real PostgreSQL, committing nothing."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import pytest
from jobapp import Ledger, TaskJob, User, emails, jobs, tasks
from sqlalchemy import Engine, func, select
from sqlalchemy.orm import Session

from sa_jobqueue import InvalidArgumentError, RetryJob, TaskRegistry
from sa_jobqueue.testing import MaxRoundsError, enqueued, run_enqueued, run_jobs, transactional_session


@pytest.fixture
def db_session(engine: Engine) -> Iterator[Session]:
    """The docs/testing.md recipe: every test in a transaction rolled back at the end."""
    with transactional_session(engine) as session:
        yield session


def committed(engine: Engine) -> dict[str, int]:
    """Row counts as another connection sees them: only what was committed."""
    with engine.connect() as conn:
        return {
            "jobs": conn.scalar(select(func.count()).select_from(TaskJob)) or 0,
            "ledger": conn.scalar(select(func.count()).select_from(Ledger)) or 0,
            "users": conn.scalar(select(func.count()).select_from(User)) or 0,
        }


NOTHING = {"jobs": 0, "ledger": 0, "users": 0}


def test_enqueue_assert_run_and_roll_back(engine: Engine) -> None:
    with transactional_session(engine) as session:
        # The application's code: it commits, which releases a SAVEPOINT only.
        session.add(User(id=1, name="ada"))
        first = jobs.enqueue(session, "ledger", {"user_id": 1})
        second = jobs.enqueue(session, "ledger", {"user_id": 2}, queue="other")
        session.commit()
        assert committed(engine) == NOTHING

        assert [j.id for j in enqueued(session, jobs)] == [first.id, second.id]
        assert [j.payload for j in enqueued(session, jobs, queue="other")] == [{"user_id": 2}]
        assert enqueued(session, jobs, task="noop") == []
        assert enqueued(session, emails) == []

        result = run_enqueued(session, jobs, tasks)
        assert result.tasks == ["ledger", "ledger"]
        assert {j.id for j in result.completed} == {first.id, second.id}
        assert result.retried == [] and result.dead == [] and result.rounds == 1
        # The handlers' writes are in the test's transaction; the jobs are gone.
        assert sorted(session.scalars(select(Ledger.job_id))) == sorted([first.id, second.id])
        assert enqueued(session, jobs, status=None) == []
        assert session.get(User, 1) is not None
        assert committed(engine) == NOTHING
    assert committed(engine) == NOTHING


def test_queue_filter_and_limit(db_session: Session, engine: Engine) -> None:
    a = jobs.enqueue(db_session, "ledger", queue="a")
    b = jobs.enqueue(db_session, "ledger", queue="b")
    later = jobs.enqueue(db_session, "ledger", queue="a", delay=timedelta(hours=1))
    assert run_enqueued(db_session, jobs, tasks, queue="b").completed[0].id == b.id
    assert [j.id for j in enqueued(db_session, jobs)] == [a.id, later.id]
    result = run_enqueued(db_session, jobs, tasks)
    assert [j.id for j in result.completed] == [a.id]
    # Scheduled in the future: not runnable in this transaction, as in production.
    assert [j.id for j in enqueued(db_session, jobs)] == [later.id]
    assert committed(engine) == NOTHING

    c, d = jobs.enqueue(db_session, "noop"), jobs.enqueue(db_session, "noop")
    assert [j.id for j in run_enqueued(db_session, jobs, tasks, limit=1).completed] == [c.id]
    assert [j.id for j in enqueued(db_session, jobs, task="noop")] == [d.id]


def test_failing_handler_raises_its_exception_and_rolls_back_its_writes(db_session: Session) -> None:
    job = jobs.enqueue(db_session, "always_fails")
    with pytest.raises(ValueError, match="always fails"):
        run_enqueued(db_session, jobs, tasks)
    # The handler's ledger row was rolled back with its SAVEPOINT; the
    # failure was recorded as the worker records it.
    assert db_session.scalars(select(Ledger)).all() == []
    (after,) = enqueued(db_session, jobs)
    assert after.id == job.id and after.attempts == 1
    assert after.last_error is not None and "ValueError: always fails" in after.last_error


def test_without_raise_errors_the_job_is_retried_then_dead_as_in_the_worker(db_session: Session) -> None:
    job = jobs.enqueue(db_session, "always_fails")
    # QUICK retries at once, so each round runs it again until max_attempts=3.
    result = run_enqueued(db_session, jobs, tasks, raise_errors=False)
    assert [run.outcome for run in result.runs] == ["pending", "pending", "dead"]
    assert [len(result.retried), len(result.dead), result.rounds] == [2, 1, 3]
    assert all(isinstance(run.error, ValueError) for run in result.runs)
    (dead,) = enqueued(db_session, jobs, status="dead")
    assert dead.id == job.id and dead.attempts == 3
    assert db_session.scalars(select(Ledger)).all() == []


def test_retry_with_backoff_stays_pending(db_session: Session) -> None:
    registry = TaskRegistry()

    @registry.task
    def fails(job: TaskJob) -> None:
        raise RuntimeError("boom")

    jobs.enqueue(db_session, "fails")
    result = run_enqueued(db_session, jobs, registry, raise_errors=False)
    assert len(result.retried) == 1 and result.rounds == 1
    (pending,) = enqueued(db_session, jobs)
    assert pending.attempts == 1 and "RuntimeError: boom" in (pending.last_error or "")


def test_retry_job_is_not_an_error(db_session: Session) -> None:
    jobs.enqueue(db_session, "retry_later")
    result = run_enqueued(db_session, jobs, tasks)
    assert len(result.retried) == 1 and isinstance(result.runs[0].error, RetryJob)
    assert len(enqueued(db_session, jobs)) == 1


def test_unknown_task(db_session: Session) -> None:
    jobs.enqueue(db_session, "nobody_handles_this")
    with pytest.raises(LookupError, match="unknown task 'nobody_handles_this'"):
        run_enqueued(db_session, jobs, tasks)
    assert len(enqueued(db_session, jobs, status="dead")) == 1
    jobs.enqueue(db_session, "nobody_handles_this")
    assert len(run_enqueued(db_session, jobs, tasks, raise_errors=False).dead) == 1


def test_chained_enqueues_run_across_tables(db_session: Session, engine: Engine) -> None:
    registry = TaskRegistry()

    @registry.task
    def step(job: TaskJob, session: Session) -> None:
        session.add(Ledger(job_id=job.id, note=f"step {job.payload['n']}"))
        if job.payload["n"] < 3:
            jobs.enqueue(session, "step", {"n": job.payload["n"] + 1})
        else:
            emails.enqueue(session, "mail", {"to": "ada"}, extra={"tenant_id": 7})

    @registry.task
    def mail(job: TaskJob, session: Session) -> None:
        session.add(Ledger(job_id=-job.id, note="mail"))

    jobs.enqueue(db_session, "step", {"n": 1})
    result = run_enqueued(db_session, [jobs, emails], registry)
    assert result.tasks == ["step", "step", "step", "mail"]
    assert [run.round for run in result.runs] == [1, 2, 3, 4] and result.rounds == 4
    notes = db_session.scalars(select(Ledger.note).order_by(Ledger.note)).all()
    assert notes == ["mail", "step 1", "step 2", "step 3"]
    assert enqueued(db_session, jobs) == [] and enqueued(db_session, emails) == []
    assert committed(engine) == NOTHING


def test_handlers_see_the_tests_uncommitted_rows(db_session: Session) -> None:
    registry = TaskRegistry()
    seen: list[str] = []

    @registry.task
    def greet(job: TaskJob, session: Session) -> None:
        user = session.get(User, job.payload["user_id"])
        assert user is not None
        seen.append(user.name)
        user.name = "greeted " + user.name

    @registry.task
    def no_session(job: TaskJob) -> None:
        seen.append(f"job {job.id}")

    db_session.add(User(id=5, name="ada"))  # not even flushed
    jobs.enqueue(db_session, "greet", {"user_id": 5})
    other = jobs.enqueue(db_session, "no_session")
    run_enqueued(db_session, jobs, registry)
    assert seen == ["ada", f"job {other.id}"]
    assert db_session.scalar(select(User.name).where(User.id == 5)) == "greeted ada"


def test_max_rounds_bounds_an_endless_chain(db_session: Session) -> None:
    registry = TaskRegistry()

    @registry.task
    def forever(job: TaskJob, session: Session) -> None:
        jobs.enqueue(session, "forever")

    jobs.enqueue(db_session, "forever")
    with pytest.raises(MaxRoundsError, match="max_rounds=5") as info:
        run_enqueued(db_session, jobs, registry, max_rounds=5)
    assert isinstance(info.value, AssertionError)
    assert info.value.result.rounds == 5 and len(info.value.result.runs) == 5
    assert info.value.remaining == 1
    assert len(enqueued(db_session, jobs)) == 1


def test_handler_flush_error_is_the_handlers_failure(db_session: Session) -> None:
    registry = TaskRegistry()

    @registry.task
    def duplicate(job: TaskJob, session: Session) -> None:
        session.add(User(id=1, name="again"))  # flushed by run_enqueued: a primary key violation

    db_session.add(User(id=1, name="ada"))
    db_session.flush()
    jobs.enqueue(db_session, "duplicate")
    result = run_enqueued(db_session, jobs, registry, raise_errors=False)
    assert "IntegrityError" in type(result.runs[0].error).__name__
    # The SAVEPOINT rollback left the test's transaction usable, its writes intact.
    assert db_session.get(User, 1) is not None
    assert enqueued(db_session, jobs)[0].attempts == 1


def test_plain_session_and_arguments(engine: Engine) -> None:
    with Session(engine) as session:
        jobs.enqueue(session, "ledger")
        assert len(run_enqueued(session, jobs, tasks).completed) == 1
        session.rollback()
    assert committed(engine) == NOTHING
    with Session(engine) as session:
        with pytest.raises(InvalidArgumentError, match="status"):
            enqueued(session, jobs, status="bogus")
        with pytest.raises(InvalidArgumentError, match="max_rounds"):
            run_enqueued(session, jobs, tasks, max_rounds=0)
        with pytest.raises(InvalidArgumentError, match="registry"):
            run_enqueued(session, jobs, object())  # type: ignore[arg-type]
        with pytest.raises(InvalidArgumentError, match="repository"):
            enqueued(session, object())  # type: ignore[arg-type]


def test_transactional_session_on_a_connection(engine: Engine) -> None:
    with engine.connect() as conn:
        with transactional_session(conn) as session:
            jobs.enqueue(session, "ledger")
            session.commit()
            session.rollback()
            assert len(enqueued(session, jobs)) == 1
        assert not conn.in_transaction()
    assert committed(engine) == NOTHING


def test_run_jobs_still_commits_with_a_worker(engine: Engine) -> None:
    with Session(engine) as session, session.begin():
        jobs.enqueue(session, "ledger")
    assert run_jobs(engine, jobs, tasks).completed == 1
    assert committed(engine)["ledger"] == 1
