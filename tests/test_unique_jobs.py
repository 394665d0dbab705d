"""Unique jobs (sa_jobqueue.dedupe, docs/tasks.md "Unique jobs"): what an enqueue
does when a job holds its dedupe key, how long a job holds it, and which job
won, one by one and in bulk, against a real PostgreSQL."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime, timedelta, timezone

import pytest
from jobapp import ReportJob, TaskJob, jobs, reports
from sqlalchemy import Engine, func, insert, select, text, update
from sqlalchemy.dialects.postgresql.psycopg import PGDialect_psycopg
from sqlalchemy.orm import Session, sessionmaker

from sa_jobqueue import Dedupe, EnqueueOutcome, InvalidArgumentError, JobSpec, TaskRegistry

LEASE = timedelta(seconds=60)
LATER = timedelta(hours=1)


def _rows(sessions: sessionmaker[Session]) -> list[tuple[int, str, object, str | None]]:
    with sessions() as session:
        return [tuple(r) for r in session.execute(  # type: ignore[misc]
            select(TaskJob.id, TaskJob.status, TaskJob.payload, TaskJob.dedupe_key).order_by(TaskJob.id)
        )]


def _run_at(sessions: sessionmaker[Session], job_id: int) -> datetime:
    with sessions() as session:
        value = session.scalar(select(TaskJob.run_at).where(TaskJob.id == job_id))
    assert value is not None
    return value


def test_a_plain_key_and_skip_keep_the_holder_as_it_was(sessions: sessionmaker[Session]) -> None:
    with sessions.begin() as session:
        first = jobs.enqueue(session, "noop", {"v": 1}, dedupe_key="k")
        again = jobs.enqueue(session, "noop", {"v": 2}, dedupe_key=Dedupe("k"), delay=LATER)
    assert again.id == first.id and again.payload == {"v": 1}
    assert _run_at(sessions, first.id) == first.run_at


def test_replace_gives_a_pending_holder_the_new_payload_and_run_at(sessions: sessionmaker[Session]) -> None:
    with sessions.begin() as session:
        first = jobs.enqueue(session, "noop", {"v": 1}, dedupe_key="k")
    with sessions.begin() as session:
        [outcome] = jobs.enqueue_many_report(session, [
            JobSpec("noop", {"v": 2}, delay=LATER, dedupe_key=Dedupe("k", on_conflict="replace")),
        ])
    assert outcome.outcome == "replaced" and outcome.job.id == first.id
    assert outcome.job.payload == {"v": 2} and outcome.job.run_at > first.run_at + LATER / 2
    assert _rows(sessions) == [(first.id, "pending", {"v": 2}, "k")]
    assert _run_at(sessions, first.id) == outcome.job.run_at


def test_debounce_moves_run_at_later_only_and_keeps_the_payload(sessions: sessionmaker[Session]) -> None:
    with sessions.begin() as session:
        first = jobs.enqueue(session, "noop", {"v": 1}, dedupe_key="k", delay=timedelta(minutes=10))
    debounce = Dedupe("k", on_conflict="debounce")
    with sessions.begin() as session:
        pushed = jobs.enqueue(session, "noop", {"v": 2}, dedupe_key=debounce, delay=LATER)
    assert pushed.id == first.id and pushed.payload == {"v": 1} and pushed.run_at > first.run_at
    with sessions.begin() as session:  # an earlier run time never pulls the job forward
        [kept] = jobs.enqueue_many_report(session, [JobSpec("noop", dedupe_key=debounce)])
    assert kept.outcome == "debounced" and kept.job.run_at == pushed.run_at
    assert _rows(sessions) == [(first.id, "pending", {"v": 1}, "k")]


@pytest.mark.parametrize("on_conflict", ["replace", "debounce"])
def test_a_running_holder_is_never_changed(sessions: sessionmaker[Session], on_conflict: str) -> None:
    with sessions.begin() as session:
        first = jobs.enqueue(session, "noop", {"v": 1}, dedupe_key="k")
    with sessions.begin() as session:
        [claimed] = jobs.claim(session, lease=LEASE)
    with sessions.begin() as session:
        [outcome] = jobs.enqueue_many_report(session, [
            JobSpec("noop", {"v": 2}, delay=LATER, dedupe_key=Dedupe("k", on_conflict=on_conflict)),  # type: ignore[arg-type]
        ])
    assert outcome.outcome == "duplicate" and outcome.job.id == first.id and outcome.job.status == "running"
    assert _rows(sessions) == [(first.id, "running", {"v": 1}, "k")]
    assert _run_at(sessions, first.id) == claimed.run_at


def test_until_started_gives_the_key_up_at_the_claim(sessions: sessionmaker[Session]) -> None:
    until_started = Dedupe("refresh:7", until="started")
    with sessions.begin() as session:
        first = jobs.enqueue(session, "noop", dedupe_key=until_started)
        assert jobs.enqueue(session, "noop", dedupe_key=until_started).id == first.id  # pending: held
    with sessions.begin() as session:
        [claimed] = jobs.claim(session, lease=LEASE)
    assert claimed.id == first.id and claimed.dedupe_key is None
    with sessions.begin() as session:
        second = jobs.enqueue(session, "noop", dedupe_key=until_started)
        third = jobs.enqueue(session, "noop", dedupe_key=until_started)
    assert second.id != first.id and third.id == second.id
    assert _rows(sessions) == [(first.id, "running", {}, None), (second.id, "pending", {}, "refresh:7")]


def test_until_finished_still_holds_the_key_while_the_job_runs(sessions: sessionmaker[Session]) -> None:
    with sessions.begin() as session:
        first = jobs.enqueue(session, "noop", dedupe_key=Dedupe("k", until="finished"))
    with sessions.begin() as session:
        [claimed] = jobs.claim(session, lease=LEASE)
    assert claimed.dedupe_key == "k"
    with sessions.begin() as session:
        assert jobs.enqueue(session, "noop", dedupe_key="k").id == first.id


def test_in_bulk_each_spec_reports_the_job_that_won(sessions: sessionmaker[Session]) -> None:
    with sessions.begin() as session:
        held = jobs.enqueue(session, "noop", {"v": 0}, dedupe_key="held")
    replace = Dedupe("new", on_conflict="replace")
    with sessions.begin() as session:
        outcomes = jobs.enqueue_many_report(session, [
            JobSpec("noop", {"v": 1}, dedupe_key="held"),
            JobSpec("noop", {"v": 2}, dedupe_key=replace),
            JobSpec("noop", {"v": 3}),
            JobSpec("noop", {"v": 4}, dedupe_key=replace),  # a later spec of the call replaces an earlier one
            JobSpec("noop", {"v": 5}, dedupe_key=Dedupe("held", on_conflict="replace")),
        ])
    assert [o.outcome for o in outcomes] == ["duplicate", "inserted", "inserted", "replaced", "replaced"]
    assert all(isinstance(o, EnqueueOutcome) for o in outcomes)
    assert outcomes[0].job.id == outcomes[4].job.id == held.id
    assert outcomes[1].job.id == outcomes[3].job.id
    # Every spec of a key shows its job as the call left it.
    assert outcomes[1].job.payload == outcomes[3].job.payload == {"v": 4}
    assert outcomes[0].job.payload == {"v": 5}
    assert {(r[2]["v"], r[3]) for r in _rows(sessions)} == {(5, "held"), (4, "new"), (3, None)}  # type: ignore[index]


def test_enqueue_many_returns_the_winners_as_enqueue_many_report_does(sessions: sessionmaker[Session]) -> None:
    with sessions.begin() as session:
        first = jobs.enqueue(session, "noop", dedupe_key="k")
        again = jobs.enqueue_many(session, [JobSpec("noop", {"v": 9}, dedupe_key=Dedupe("k", on_conflict="replace"))])
    assert [job.id for job in again] == [first.id] and again[0].payload == {"v": 9}


def test_a_task_enqueues_with_a_dedupe(sessions: sessionmaker[Session]) -> None:
    registry = TaskRegistry(repository=jobs)

    @registry.task
    def refresh(account: int) -> None:
        pass

    debounced = refresh.configure(dedupe_key=Dedupe("refresh", on_conflict="replace"), delay=LATER)
    with sessions.begin() as session:
        first = debounced.enqueue(session, 1)
        second = debounced.enqueue(session, 2)
    assert second.id == first.id and second.payload == {"account": 2}


# -- locks: a keyed enqueue never waits on a running job, nor makes a worker wait on it


@pytest.fixture
def held_open(engine: Engine) -> Iterator[Session]:
    """A session whose transaction the test keeps open, ended (rolled back) at teardown."""
    with Session(engine) as session:
        yield session
        session.rollback()


@pytest.mark.parametrize("on_conflict", ["skip", "replace", "debounce"])
def test_a_keyed_enqueue_does_not_wait_for_a_running_holders_row_lock(
    sessions: sessionmaker[Session], held_open: Session, on_conflict: str
) -> None:
    """As in transaction mode, where the job's own transaction locks its row until the handler is done."""
    with sessions.begin() as session:
        jobs.enqueue(session, "noop", dedupe_key="k")
    with sessions.begin() as session:
        [claimed] = jobs.claim(session, lease=LEASE)
    held_open.execute(select(TaskJob.id).where(TaskJob.id == claimed.id).with_for_update())
    with sessions.begin() as session:
        # Waiting for the lock would end the statement with an error, not a slow test.
        session.execute(text("SET LOCAL lock_timeout = '5s'"))
        [outcome] = jobs.enqueue_many_report(session, [
            JobSpec("noop", {"v": 2}, dedupe_key=Dedupe("k", on_conflict=on_conflict)),  # type: ignore[arg-type]
        ])
    assert outcome.outcome == "duplicate" and outcome.job.id == claimed.id


def test_a_replacing_transaction_left_open_does_not_hold_up_the_running_holders_heartbeat(
    sessions: sessionmaker[Session], held_open: Session
) -> None:
    with sessions.begin() as session:
        jobs.enqueue(session, "noop", dedupe_key="k")
    with sessions.begin() as session:
        [claimed] = jobs.claim(session, lease=LEASE)
    outcomes = jobs.enqueue_many_report(held_open, [JobSpec("noop", dedupe_key=Dedupe("k", on_conflict="replace"))])
    assert outcomes[0].outcome == "duplicate"
    with sessions.begin() as session:
        session.execute(text("SET LOCAL lock_timeout = '5s'"))
        report = jobs.extend_leases(session, [claimed], lease=LEASE)
        jobs.complete(session, claimed)
    assert claimed.id in report.owned
    with sessions() as session:
        assert session.scalar(select(func.count()).select_from(TaskJob)) == 0


def test_a_pending_holder_being_replaced_is_skipped_by_claims_until_the_replacement_commits(
    sessions: sessionmaker[Session], held_open: Session
) -> None:
    with sessions.begin() as session:
        first = jobs.enqueue(session, "noop", {"v": 1}, dedupe_key="k")
    jobs.enqueue_many_report(held_open, [JobSpec("noop", {"v": 2}, dedupe_key=Dedupe("k", on_conflict="replace"))])
    with sessions.begin() as session:
        assert jobs.claim(session, lease=LEASE) == []  # locked by the replacement: skipped, not waited for
    held_open.commit()
    with sessions.begin() as session:
        [claimed] = jobs.claim(session, lease=LEASE)
    assert claimed.id == first.id and claimed.payload == {"v": 2}


def test_replaced_run_at_is_measured_on_the_database_clock(sessions: sessionmaker[Session]) -> None:
    at = datetime(2030, 1, 1, tzinfo=timezone.utc)
    with sessions.begin() as session:
        first = jobs.enqueue(session, "noop", dedupe_key="k")
        replaced = jobs.enqueue(session, "noop", dedupe_key=Dedupe("k", on_conflict="replace"), run_at=at)
    assert replaced.id == first.id and replaced.run_at == at


# -- a dedupe window: finished jobs of the key count, on a table that keeps them


def _finish(sessions: sessionmaker[Session], *, enqueued_ago: timedelta | None = None) -> None:
    """Claim and complete every runnable report job; optionally date their enqueue back."""
    with sessions.begin() as session:
        for job in reports.claim(session, limit=100, lease=LEASE):
            reports.complete(session, job)
        if enqueued_ago is not None:
            session.execute(update(ReportJob).values(created_at=func.now() - enqueued_ago))


HOURLY = Dedupe("digest:ada", window=timedelta(hours=1))


def test_a_job_finished_within_the_window_holds_the_key(sessions: sessionmaker[Session]) -> None:
    with sessions.begin() as session:
        first = reports.enqueue(session, "noop", dedupe_key=HOURLY)
    _finish(sessions, enqueued_ago=timedelta(minutes=59))
    with sessions.begin() as session:
        [outcome] = reports.enqueue_many_report(session, [JobSpec("noop", {"v": 2}, dedupe_key=HOURLY)])
        plain = reports.enqueue(session, "noop", dedupe_key="digest:ada")  # no window: the key is free
    assert outcome.outcome == "duplicate" and outcome.job.id == first.id and outcome.job.status == "done"
    assert plain.id != first.id
    with sessions() as session:
        assert session.scalar(select(func.count()).select_from(ReportJob)) == 2


def test_past_the_window_a_finished_job_does_not(sessions: sessionmaker[Session]) -> None:
    with sessions.begin() as session:
        first = reports.enqueue(session, "noop", dedupe_key=HOURLY)
    _finish(sessions, enqueued_ago=timedelta(minutes=61))
    with sessions.begin() as session:
        [outcome] = reports.enqueue_many_report(session, [JobSpec("noop", dedupe_key=HOURLY)])
    assert outcome.outcome == "inserted" and outcome.job.id != first.id


def test_dead_and_cancelled_jobs_do_not_hold_a_window(sessions: sessionmaker[Session]) -> None:
    with sessions.begin() as session:
        cancelled = reports.enqueue(session, "noop", dedupe_key=HOURLY)
        assert reports.cancel(session, cancelled.id)
        again = reports.enqueue(session, "noop", dedupe_key=HOURLY)
    assert again.id != cancelled.id


def test_a_window_in_bulk_repeats_and_a_live_holder(sessions: sessionmaker[Session]) -> None:
    with sessions.begin() as session:
        done = reports.enqueue(session, "noop", dedupe_key=HOURLY)
    _finish(sessions)
    replace_daily = Dedupe("daily", on_conflict="replace", window=timedelta(days=1))
    with sessions.begin() as session:
        outcomes = reports.enqueue_many_report(session, [
            JobSpec("noop", {"v": 1}, dedupe_key=HOURLY),
            JobSpec("noop", {"v": 2}, dedupe_key=replace_daily),
            JobSpec("noop", {"v": 3}, dedupe_key=HOURLY),
            JobSpec("noop", {"v": 4}, dedupe_key=replace_daily),
        ])
    assert [o.outcome for o in outcomes] == ["duplicate", "inserted", "duplicate", "replaced"]
    assert outcomes[0].job.id == outcomes[2].job.id == done.id
    assert outcomes[1].job.id == outcomes[3].job.id and outcomes[3].job.payload == {"v": 4}


def test_a_window_on_a_table_that_deletes_finished_jobs_is_refused(sessions: sessionmaker[Session]) -> None:
    with sessions.begin() as session:
        with pytest.raises(InvalidArgumentError) as refused:
            jobs.enqueue_many(session, [JobSpec("noop"), JobSpec("noop", dedupe_key=HOURLY)])
        assert refused.value.parameter == "dedupe_key.window" and "task_jobs" in str(refused.value)
        assert session.scalar(select(func.count()).select_from(TaskJob)) == 0


def test_the_window_lookup_reads_its_index_under_a_generic_plan(sessions: sessionmaker[Session]) -> None:
    from sa_jobqueue.keyed import done_holder

    with sessions.begin() as session:
        session.execute(insert(ReportJob), [
            {"task": "noop", "queue": f"q{n % 10}", "dedupe_key": f"k{n}", "status": "done"} for n in range(5000)
        ])
        session.execute(text("ANALYZE report_jobs"))
    statement = done_holder(ReportJob, [ReportJob.__table__.c.id])
    sql = str(statement.compile(dialect=PGDialect_psycopg(paramstyle="numeric_dollar")))
    assert sql.count("$") == 4, sql  # queue, key, window, limit: all parameters, as the driver sends them
    with sessions.begin() as session:
        session.execute(text("SET LOCAL plan_cache_mode = force_generic_plan"))
        session.execute(text(f"PREPARE window_lookup(varchar, varchar, interval, integer) AS {sql}"))
        plan = "\n".join(session.scalars(text(
            "EXPLAIN EXECUTE window_lookup('q1', 'k1', interval '1 hour', 1)")))
        session.execute(text("DEALLOCATE window_lookup"))
    assert "ix_report_jobs_dedupe_done_v1" in plan, plan
