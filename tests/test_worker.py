"""The Worker in-process, in both modes: retries, dead, unknown tasks, heartbeats, stop."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
from jobapp import Ledger, TaskJob, jobs, tasks
from sqlalchemy import Engine, event, func, select
from sqlalchemy.orm import Session, sessionmaker
from sqllog import recorded_own_sql

from sa_jobqueue import InvalidArgumentError, JobSpec, TaskRegistry, Worker
from sa_jobqueue.worker.options import CLAIMERS

MODES = ["lease", "transaction"]


def _worker(engine: Engine, mode: str, **kwargs: object) -> Worker:
    return Worker(engine, jobs, tasks, mode=mode, poll_interval=0.1, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("mode", MODES)
def test_jobs_run_once_each_with_their_own_session(engine: Engine, sessions: sessionmaker[Session], mode: str) -> None:
    with sessions.begin() as session:
        created = jobs.enqueue_many(session, [JobSpec("ledger") for _ in range(50)])
    result = _worker(engine, mode, concurrency=4).run(until_empty=True)
    assert (result.completed, result.retried, result.dead, result.lost) == (50, 0, 0, 0)
    with sessions() as session:
        assert sorted(session.scalars(select(Ledger.job_id))) == sorted(j.id for j in created)
        assert session.scalar(select(func.count()).select_from(TaskJob)) == 0


@pytest.mark.parametrize("mode", MODES)
def test_retries_then_success_and_then_dead(engine: Engine, sessions: sessionmaker[Session], mode: str) -> None:
    with sessions.begin() as session:
        flaky = jobs.enqueue(session, "flaky", {"failures": 2})
        doomed = jobs.enqueue(session, "always_fails")
    result = _worker(engine, mode, concurrency=2).run(until_empty=True)
    assert result.completed == 1 and result.dead == 1 and result.retried == 2 + 2
    with sessions() as session:
        notes = dict(session.execute(select(Ledger.job_id, Ledger.note)).all())
        assert notes == {flaky.id: "attempt 3"}  # the failing handler's own write rolled back
        row = session.get(TaskJob, doomed.id)
        assert row is not None and row.status == "dead" and row.attempts == 3  # the task's max_attempts
        assert "ValueError: always fails" in (row.last_error or "")


@pytest.mark.parametrize("mode", MODES)
def test_unknown_task_goes_dead_with_a_clear_error(engine: Engine, sessions: sessionmaker[Session], mode: str) -> None:
    with sessions.begin() as session:
        job = jobs.enqueue(session, "no_such_task")
        jobs.enqueue(session, "ledger")
    result = _worker(engine, mode).run(until_empty=True)
    assert result.dead == 1 and result.completed == 1
    with sessions() as session:
        row = session.get(TaskJob, job.id)
        assert row is not None and row.status == "dead" and row.attempts == 1
        assert "unknown task 'no_such_task'" in (row.last_error or "")


@pytest.mark.parametrize("mode", MODES)
def test_handler_asks_for_a_retry_later(engine: Engine, sessions: sessionmaker[Session], mode: str) -> None:
    with sessions.begin() as session:
        job = jobs.enqueue(session, "retry_later")
    _worker(engine, mode).run(until_empty=True)
    with sessions() as session:
        row = session.get(TaskJob, job.id)
        assert row is not None and row.status == "pending" and row.attempts == 1
        wait = row.run_at - session.scalar(select(func.now()))
        assert timedelta(minutes=59) < wait <= timedelta(hours=1)
        assert row.last_error == "RetryJob: not yet"


def test_heartbeats_keep_a_slow_job_from_being_reaped(engine: Engine, sessions: sessionmaker[Session]) -> None:
    with sessions.begin() as session:
        job = jobs.enqueue(session, "slow", {"seconds": 5})
    # The lease is far shorter than the job; the worker reaps every second.
    result = _worker(engine, "lease", lease=timedelta(seconds=2)).run(until_empty=True)
    assert (result.completed, result.lost) == (1, 0)
    with sessions() as session:
        assert [tuple(r) for r in session.execute(select(Ledger.job_id, Ledger.note))] == [(job.id, "attempt 1")]


def test_without_heartbeats_a_slow_job_is_reaped_and_its_completion_fenced(
    engine: Engine, sessions: sessionmaker[Session]
) -> None:
    with sessions.begin() as session:
        job = jobs.enqueue(session, "slow", {"seconds": 2.0, "first_attempt_only": True})
    worker = _worker(engine, "lease", lease=timedelta(seconds=1), heartbeat_interval=timedelta(hours=1))
    result = worker.run(until_empty=True)
    # The reaper took the job back mid-run; the first run's completion was refused
    # and its ledger write rolled back; the second attempt committed once.
    assert (result.lost, result.completed) == (1, 1)
    with sessions() as session:
        assert [tuple(r) for r in session.execute(select(Ledger.job_id, Ledger.note))] == [(job.id, "attempt 2")]


def test_stop_finishes_running_jobs_and_returns(engine: Engine, sessions: sessionmaker[Session]) -> None:
    with sessions.begin() as session:
        jobs.enqueue_many(session, [JobSpec("slow", {"seconds": 0.5}) for _ in range(6)])
    worker = _worker(engine, "lease", concurrency=2)
    thread = threading.Thread(target=worker.run)
    thread.start()
    deadline = time.monotonic() + 10
    while worker.result.completed == 0:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    worker.stop()
    thread.join(timeout=10)
    assert not thread.is_alive()
    with sessions() as session:
        assert session.scalar(select(func.count()).select_from(TaskJob).where(TaskJob.status == "running")) == 0
        done = session.scalar(select(func.count()).select_from(Ledger))
        assert done == worker.result.completed < 6


@pytest.mark.parametrize(
    ("kwargs", "parameter"),
    [({"concurrency": 0}, "concurrency"), ({"mode": "fast"}, "mode"), ({"queues": []}, "queues"),
     ({"lease": timedelta(0)}, "lease"), ({"poll_interval": 0}, "poll_interval")],
)
def test_bad_worker_arguments(engine: Engine, kwargs: dict[str, object], parameter: str) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        Worker(engine, jobs, tasks, **kwargs)  # type: ignore[arg-type]
    assert info.value.parameter == parameter


def test_registry_rejects_duplicates_and_detects_session_argument() -> None:
    registry = TaskRegistry()

    @registry.task
    def plain(job: object) -> None: ...

    @registry.task("named", max_attempts=2)
    def with_session(job: object, session: object) -> None: ...

    assert registry.get("plain").takes_session is False  # type: ignore[union-attr]
    named = registry.get("named")
    assert named is not None and named.takes_session and named.max_attempts == 2
    with pytest.raises(InvalidArgumentError, match="already registered"):
        registry.register("plain", plain)
    with pytest.raises(InvalidArgumentError) as info:
        registry.register("x", plain, max_attempts=0)
    assert info.value.parameter == "max_attempts"


def test_batched_completions_are_written_before_run_returns(engine: Engine, sessions: sessionmaker[Session]) -> None:
    with sessions.begin() as session:
        jobs.enqueue_many(session, [JobSpec("noop") for _ in range(2000)])
    worker = _worker(engine, "lease", concurrency=4)
    thread = threading.Thread(target=worker.run)
    thread.start()
    deadline = time.monotonic() + 30
    while worker.result.completed < 100:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    worker.stop()
    thread.join(timeout=30)
    assert not thread.is_alive()
    with sessions() as session:
        left = session.scalar(select(func.count()).select_from(TaskJob))
        running = session.scalar(select(func.count()).select_from(TaskJob).where(TaskJob.status == "running"))
    # Every job reported completed is gone from the table, and none is left running.
    assert running == 0 and left == 2000 - worker.result.completed


def test_a_task_can_opt_out_of_batched_completion() -> None:
    registry = TaskRegistry()
    registry.register("own", lambda job: None, batch_complete=False)
    registry.register("auto", lambda job: None)
    registry.register("session", lambda job, session: None)
    assert [t.completes_in_batch for t in registry] == [False, True, False]


def test_transaction_mode_runs_a_batch_in_one_commit_and_isolates_failures(
    engine: Engine, sessions: sessionmaker[Session]
) -> None:
    with sessions.begin() as session:
        good = jobs.enqueue_many(session, [JobSpec("ledger") for _ in range(4)])
        flaky = jobs.enqueue(session, "flaky", {"failures": 1})
        good += jobs.enqueue_many(session, [JobSpec("ledger") for _ in range(5)])
    commits: list[int] = []
    on_commit = lambda conn: commits.append(1)  # noqa: E731
    event.listen(engine, "commit", on_commit)
    try:
        worker = _worker(engine, "transaction", concurrency=1, batch_size=10)
        result = worker.run(until_empty=True)
    finally:
        event.remove(engine, "commit", on_commit)
    assert (result.completed, result.retried) == (10, 1)
    with sessions() as session:
        notes = dict(session.execute(select(Ledger.job_id, Ledger.note)).all())
    assert set(notes) == {j.id for j in good} | {flaky.id} and notes[flaky.id] == "attempt 2"
    # One commit for the batch of 10 (9 good, the failure recorded), one for the
    # retried job, plus the reaper's: far fewer than one per job.
    assert len(commits) <= 5


def test_lease_mode_can_claim_ahead_of_its_threads(
    engine: Engine, sessions: sessionmaker[Session], monkeypatch: pytest.MonkeyPatch
) -> None:
    with sessions.begin() as session:
        jobs.enqueue_many(session, [JobSpec("noop") for _ in range(120)])
    statements = recorded_own_sql(monkeypatch)  # the claims run on the worker's own engine
    result = _worker(engine, "lease", concurrency=2, batch_size=50).run(until_empty=True)
    claims = [s for s in statements if "FOR UPDATE SKIP LOCKED" in s]
    assert result.completed == 120
    # 120 jobs in claims of up to 50 (plus the reaper's and the last, empty, claim), not of 2.
    assert 3 <= len(claims) <= 8


def test_lease_mode_never_holds_more_than_its_claim_ahead_limit(
    engine: Engine, sessions: sessionmaker[Session]
) -> None:
    """With batch_size B a worker holds at most (CLAIMERS + 1) * B claimed jobs,
    counting the claims in flight: each handler sees how many rows its worker owns."""
    held: list[int] = []
    registry = TaskRegistry()

    @registry.task("count_held")
    def count_held(job: TaskJob, session: Session) -> None:
        held.append(int(session.scalar(
            select(func.count()).select_from(TaskJob).where(TaskJob.status == "running", TaskJob.locked_by == "w1")
        ) or 0))

    with sessions.begin() as session:
        jobs.enqueue_many(session, [JobSpec("count_held") for _ in range(300)])
    worker = Worker(engine, jobs, registry, concurrency=3, batch_size=7, name="w1", poll_interval=0.1)
    result = worker.run(until_empty=True)
    assert result.completed == 300 and len(held) == 300
    assert max(held) <= (CLAIMERS + 1) * 7
