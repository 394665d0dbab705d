"""Which limit a job dies by: the one given at enqueue, else its task's, else 20.

docs/concepts.md "Retries": a limit on the job wins and the task's is the
default of its jobs (as in Oban and River), both when a handler fails and
when the job's lease keeps expiring; a job enqueued without a limit stores
NULL. Before, a task's limit overrode the one given at enqueue, so
``sa-jobqueue enqueue --max-attempts 3`` was ignored for such a task.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from click.testing import CliRunner
from jobapp import QUICK, TaskJob, jobs
from sqlalchemy import Engine, select, update
from sqlalchemy.orm import Session, sessionmaker

from sa_jobqueue import JobRepository, ReapResult, TaskRegistry
from sa_jobqueue.cli import main
from sa_jobqueue.default import Job
from sa_jobqueue.mixin import DEAD, DEFAULT_MAX_ATTEMPTS, PENDING
from sa_jobqueue.testing import run_enqueued, run_jobs

registry = TaskRegistry()


@registry.task(retry=QUICK, max_attempts=10)
def capped(job: Any, session: Session) -> None:
    raise ValueError("capped fails")


@registry.task(retry=QUICK)
def uncapped(job: Any, session: Session) -> None:
    raise ValueError("uncapped fails")


# What a worker's reaper passes: the limits of its tasks that have one.
REAPER_LIMITS = {task.name: task.max_attempts for task in registry if task.max_attempts is not None}

CASES = [
    pytest.param("capped", 3, 3, id="given-3-wins-over-the-tasks-10"),
    pytest.param("capped", 12, 12, id="given-12-wins-over-the-tasks-10"),
    pytest.param("capped", None, 10, id="none-given-the-tasks-10"),
    pytest.param("uncapped", None, DEFAULT_MAX_ATTEMPTS, id="neither-20"),
]


def _row(sessions: sessionmaker[Session], job_id: int) -> TaskJob:
    with sessions() as session:
        row = session.get(TaskJob, job_id)
        assert row is not None
        return row


@pytest.mark.parametrize(("task", "given", "limit"), CASES)
def test_a_failing_job_dies_by_its_own_limit_else_its_tasks_else_20(
    sessions: sessionmaker[Session], task: str, given: int | None, limit: int
) -> None:
    with sessions.begin() as session:
        job = jobs.enqueue(session, task, max_attempts=given)
    assert job.max_attempts == given
    with sessions.begin() as session:
        # Failures are recorded as the worker records them (the task's limit passed to fail).
        result = run_enqueued(session, jobs, registry, raise_errors=False)
    assert [run.outcome for run in result.runs] == [PENDING] * (limit - 1) + [DEAD]
    row = _row(sessions, job.id)
    assert (row.status, row.attempts, row.max_attempts) == (DEAD, limit, given)


@pytest.mark.parametrize("mode", ["lease", "transaction"])
def test_the_worker_applies_the_limit_given_at_enqueue(
    engine: Engine, sessions: sessionmaker[Session], mode: str
) -> None:
    with sessions.begin() as session:
        given = jobs.enqueue(session, "capped", max_attempts=3)
        default = jobs.enqueue(session, "capped")
    result = run_jobs(engine, jobs, registry, mode=mode)
    assert result.dead == 2
    assert (_row(sessions, given.id).status, _row(sessions, given.id).attempts) == (DEAD, 3)
    assert (_row(sessions, default.id).status, _row(sessions, default.id).attempts) == (DEAD, 10)


def _expire(sessions: sessionmaker[Session], job_id: int) -> None:
    """The job's worker crashed: its lease lies in the past (no waiting for it)."""
    t = TaskJob.__table__
    with sessions.begin() as session:
        session.execute(update(t).where(t.c.id == job_id).values(lease_expires_at=t.c.locked_at - timedelta(hours=1)))


@pytest.mark.parametrize(("task", "given", "limit"), CASES)
def test_a_job_whose_lease_keeps_expiring_dies_by_the_same_rule(
    sessions: sessionmaker[Session], task: str, given: int | None, limit: int
) -> None:
    with sessions.begin() as session:
        job = jobs.enqueue(session, task, max_attempts=given)
    for attempt in range(1, limit + 1):
        with sessions.begin() as session:
            [claimed] = jobs.claim(session)
        assert claimed.attempts == attempt
        _expire(sessions, job.id)
        with sessions.begin() as session:
            reaped = jobs.reap(session, task_max_attempts=REAPER_LIMITS)
        assert reaped == (ReapResult(requeued=0, dead=1) if attempt == limit else ReapResult(requeued=1, dead=0))
    row = _row(sessions, job.id)
    assert (row.status, row.attempts, row.max_attempts) == (DEAD, limit, given)


def test_a_reaper_without_the_tasks_limits_uses_20_for_jobs_without_one(sessions: sessionmaker[Session]) -> None:
    with sessions.begin() as session:
        job = jobs.enqueue(session, "capped")
        given = jobs.enqueue(session, "capped", max_attempts=2, priority=1)
    for attempt in range(1, DEFAULT_MAX_ATTEMPTS + 1):
        with sessions.begin() as session:
            claimed = jobs.claim(session, limit=2)
        assert {j.id for j in claimed} == ({job.id, given.id} if attempt <= 2 else {job.id})
        for j in claimed:
            _expire(sessions, j.id)
        with sessions.begin() as session:
            jobs.reap(session)  # a script's reaper: no task limits
    assert (_row(sessions, given.id).status, _row(sessions, given.id).attempts) == (DEAD, 2)
    assert (_row(sessions, job.id).status, _row(sessions, job.id).attempts) == (DEAD, DEFAULT_MAX_ATTEMPTS)


def test_retry_gives_one_more_attempt_and_leaves_an_unset_limit_unset(sessions: sessionmaker[Session]) -> None:
    with sessions.begin() as session:
        given = jobs.enqueue(session, "capped", max_attempts=3)
        unset = jobs.enqueue(session, "capped")
        cancelled = jobs.enqueue(session, "capped", delay=3600)
        assert jobs.cancel(session, cancelled.id)
    with sessions.begin() as session:
        run_enqueued(session, jobs, registry, raise_errors=False)
    assert (_row(sessions, given.id).attempts, _row(sessions, unset.id).attempts) == (3, 10)
    with sessions.begin() as session:
        assert jobs.retry(session, given.id) and jobs.retry(session, unset.id) and jobs.retry(session, cancelled.id)
    # The explicit limit grows to attempts + 1; the unset one stays unset, so the task's still applies.
    assert (_row(sessions, given.id).max_attempts, _row(sessions, unset.id).max_attempts) == (4, None)
    assert _row(sessions, cancelled.id).max_attempts is None
    with sessions.begin() as session:
        result = run_enqueued(session, jobs, registry, raise_errors=False)
    runs: dict[int, list[str]] = {}
    for run in result.runs:
        runs.setdefault(run.job.id, []).append(run.outcome)
    # One more attempt each, then dead again; the cancelled job had all of its task's ten left.
    assert runs == {given.id: [DEAD], unset.id: [DEAD], cancelled.id: [PENDING] * 9 + [DEAD]}
    assert [_row(sessions, j.id).attempts for j in (given, unset, cancelled)] == [4, 11, 10]


# -- the command line's --max-attempts ----------------------------------------




def _cli_enqueue(url: str, *args: str) -> int:
    result = CliRunner().invoke(main, ["enqueue", *args], env={"DATABASE_URL": url}, prog_name="sa-jobqueue")
    assert result.exit_code == 0, result.output
    return int(result.output.strip())


def test_cli_enqueue_max_attempts_wins_over_the_tasks_and_its_default_is_the_tasks(
    default_table: tuple[str, Engine],
) -> None:
    url, engine = default_table
    given = _cli_enqueue(url, "capped", "--max-attempts", "3")
    unset = _cli_enqueue(url, "capped")
    default_jobs = JobRepository(Job)
    with Session(engine) as session, session.begin():
        stored = dict(session.execute(select(Job.id, Job.max_attempts)).all())
        assert stored == {given: 3, unset: None}
        run_enqueued(session, default_jobs, registry, raise_errors=False)
        attempts = dict(session.execute(select(Job.id, Job.attempts).where(Job.status == DEAD)).all())
        session.rollback()
    assert attempts == {given: 3, unset: 10}
    help_text = CliRunner().invoke(main, ["enqueue", "--help"]).output
    assert "default: the task's max_attempts, else 20" in " ".join(help_text.split())
