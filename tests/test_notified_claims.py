"""A notification sends its claim at once, from the listener's thread (or from
the claimer whose claim was out when it came), not at the worker loop's next
pass; and a lease-mode worker's claimers claim on connections they hold
(sa_jobqueue/worker/threaded.py, sa_jobqueue/worker/lease.py)."""

from __future__ import annotations

import threading
from typing import Any

from jobapp import TaskJob, jobs
from sqlalchemy import Engine, create_engine, func, select, text
from sqlalchemy.orm import Session, sessionmaker
from waiting import terminate_backend, wait_for

from sa_jobqueue import TaskRegistry, Worker, signals
from sa_jobqueue.listener import LISTENER_APPLICATION_NAME


def _listening(engine: Engine) -> bool:
    with engine.connect() as conn:
        return bool(conn.scalar(select(func.count()).select_from(text("pg_stat_activity"))
                                .where(text("application_name = :name")), {"name": LISTENER_APPLICATION_NAME}))


def test_a_notified_job_runs_while_the_loops_thread_is_busy(engine: Engine, sessions: sessionmaker[Session]) -> None:
    tasks = TaskRegistry()
    second_started = threading.Event()
    loop_held = threading.Event()
    release = threading.Event()

    @tasks.task
    def first(job: TaskJob) -> None:  # no session: the loop's thread writes its completion
        pass

    @tasks.task
    def second(job: TaskJob) -> None:
        second_started.set()

    def hold_the_loop(sender: Any, job: Any, **extra: Any) -> None:
        if job.task == "first" and threading.current_thread() is runner:
            loop_held.set()
            release.wait(120)

    # A poll interval far past the test's time: only a notification finds a job.
    worker = Worker(engine, jobs, tasks, concurrency=2, poll_interval=300)
    runner = threading.Thread(target=worker.run)
    signals.job_succeeded.connect(hold_the_loop, weak=False)
    runner.start()
    try:
        wait_for(lambda: _listening(engine), 30, "the worker's listener")
        with sessions.begin() as session:
            jobs.enqueue(session, "first")
        wait_for(loop_held.is_set, 30, "the loop's thread held in the receiver of first's completion")
        with sessions.begin() as session:
            jobs.enqueue(session, "second")
        wait_for(second_started.is_set, 30, "second to start while the loop's thread is held")
        assert not release.is_set()
    finally:
        release.set()
        worker.stop()
        runner.join(60)
        signals.job_succeeded.disconnect(hold_the_loop)
    assert not runner.is_alive()
    assert worker.result.completed == 2


def _claimer_backends(engine: Engine) -> set[int]:
    """The backends whose last statement was a claim of task_jobs."""
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT pid FROM pg_stat_activity WHERE query LIKE 'WITH picked AS%'"
                                 " AND query LIKE '%task_jobs%' AND pid <> pg_backend_pid()"))
        return {row.pid for row in rows}


def test_a_claimers_connection_is_held_and_replaced_when_the_server_drops_it(
    engine: Engine, sessions: sessionmaker[Session]
) -> None:
    tasks = TaskRegistry()
    done: list[int] = []

    @tasks.task
    def mark(job: TaskJob) -> None:
        done.append(job.id)

    killer = create_engine(engine.url)
    worker = Worker(engine, jobs, tasks, concurrency=1, poll_interval=0.1)
    runner = threading.Thread(target=worker.run)
    runner.start()
    try:
        for n in range(3):
            with sessions.begin() as session:
                jobs.enqueue(session, "mark")
            wait_for(lambda n=n: len(done) == n + 1, 30, f"job {n + 1} run")  # type: ignore[misc]
        # One connection per claimer thread, kept from claim to claim.
        held = _claimer_backends(killer)
        assert 1 <= len(held) <= 2
        for pid in held:
            terminate_backend(killer, pid, "the claimer's backend gone")
        with sessions.begin() as session:
            jobs.enqueue(session, "mark")
        # The claim on the dropped connection fails and is logged; the next
        # one checks out a new connection.
        wait_for(lambda: len(done) == 4, 60, "the job after the drop run")
        replaced = _claimer_backends(killer)
        assert replaced and not (replaced & held)
    finally:
        worker.stop()
        runner.join(60)
        killer.dispose()
    assert not runner.is_alive()
    assert worker.result.completed == 4

