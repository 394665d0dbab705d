"""Grouped commits (sa_jobqueue/worker/group.py): the jobs of ``group_commit``
tasks share transactions in lease mode, and a SAVEPOINT per group in
transaction mode (worker/transaction.py); each job's writes still commit
exactly once with its completion, whatever fails in its group."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from datetime import timedelta
from uuid import uuid4

import pytest
from jobapp import Ledger, TaskJob, jobs
from sqlalchemy import Engine, event, func, select, text, update
from sqlalchemy.orm import Session, sessionmaker
from waiting import wait_for

from sa_jobqueue import InvalidArgumentError, JobSpec, TaskRegistry, Worker
from sa_jobqueue.worker.group import batch_parts, group_sizes
from sa_jobqueue.worker.slots import Slots

COUNT = 20


def _enqueue(sessions: sessionmaker[Session], task: str, count: int = COUNT) -> list[int]:
    with sessions.begin() as session:
        return [j.id for j in jobs.enqueue_many(session, [JobSpec(task, max_attempts=1) for _ in range(count)])]


def _ledger(sessions: sessionmaker[Session]) -> dict[int, str | None]:
    with sessions() as session:
        return {row.job_id: row.note for row in session.scalars(select(Ledger))}


def _status(sessions: sessionmaker[Session], job_id: int) -> str | None:
    with sessions() as session:
        return session.scalar(select(TaskJob.status).where(TaskJob.id == job_id))


def _worker(engine: Engine, tasks: TaskRegistry, **options: object) -> Worker:
    options = {"concurrency": 2, "batch_size": COUNT, "poll_interval": 0.1, **options}
    return Worker(engine, jobs, tasks, **options)  # type: ignore[arg-type]


def _grouped_ledger_task(tasks: TaskRegistry, runs: Counter[int], fail: set[int] | None = None) -> None:
    """``write``: a ledger row noting the transaction; raises for the ids in ``fail``."""

    @tasks.task(group_commit=True)
    def write(job: TaskJob, session: Session) -> None:
        runs[job.id] += 1
        if fail and job.id in fail:
            raise RuntimeError(f"job {job.id} fails")
        session.add(Ledger(job_id=job.id, note=str(session.scalar(text("SELECT txid_current()")))))


def _grouped_task_meddling_once(
    tasks: TaskRegistry, runs: Counter[int], sessions: sessionmaker[Session], target: int,
    meddle: Callable[[TaskJob, Session], None],
) -> None:
    """``write``: a ledger row per job; the first run of job ``target`` first
    calls ``meddle`` with a transaction of another session, committed after."""

    @tasks.task(group_commit=True)
    def write(job: TaskJob, session: Session) -> None:
        runs[job.id] += 1
        if job.id == target and runs[job.id] == 1:
            with sessions.begin() as other:
                meddle(job, other)
        session.add(Ledger(job_id=job.id, note="job"))


def test_grouped_jobs_share_transactions_and_commit_once(engine: Engine, sessions: sessionmaker[Session]) -> None:
    tasks, runs = TaskRegistry(), Counter[int]()
    _grouped_ledger_task(tasks, runs)
    ids = _enqueue(sessions, "write")
    result = _worker(engine, tasks).run(until_empty=True)
    assert result.completed == COUNT
    ledger = _ledger(sessions)
    assert sorted(ledger) == ids
    assert len(set(ledger.values())) == 2  # two slots, one group (and one transaction) each
    assert set(runs.values()) == {1}
    with sessions() as session:
        assert session.scalar(select(func.count()).select_from(TaskJob)) == 0


def test_a_task_without_group_commit_keeps_a_transaction_per_job(
    engine: Engine, sessions: sessionmaker[Session]
) -> None:
    tasks = TaskRegistry()

    @tasks.task
    def write(job: TaskJob, session: Session) -> None:
        session.add(Ledger(job_id=job.id, note=str(session.scalar(text("SELECT txid_current()")))))

    _enqueue(sessions, "write")
    assert _worker(engine, tasks).run(until_empty=True).completed == COUNT
    assert len(set(_ledger(sessions).values())) == COUNT


def test_a_failing_handler_is_recorded_alone_and_the_others_commit_once(
    engine: Engine, sessions: sessionmaker[Session]
) -> None:
    tasks, runs = TaskRegistry(), Counter[int]()
    ids = _enqueue(sessions, "write")
    bad = {ids[5], ids[15]}  # one in each slot's group
    _grouped_ledger_task(tasks, runs, fail=bad)
    result = _worker(engine, tasks).run(until_empty=True)
    assert (result.completed, result.dead) == (COUNT - 2, 2)
    assert sorted(_ledger(sessions)) == sorted(set(ids) - bad)
    assert all(_status(sessions, i) == "dead" for i in bad)
    assert max(runs.values()) <= 2  # a grouped handler runs twice at most
    assert all(runs[i] == 1 for i in bad)  # the one to blame is not run again


@pytest.mark.parametrize("mode", ["lease", "transaction"])
def test_a_flush_failure_rolls_the_group_back_and_each_job_runs_alone(
    engine: Engine, sessions: sessionmaker[Session], mode: str
) -> None:
    """A write that fails only at the group's flush has no handler to blame
    yet: every job runs again alone, where the culprit's own flush fails."""
    tasks, runs = TaskRegistry(), Counter[int]()
    ids = _enqueue(sessions, "write")
    with sessions.begin() as session:
        session.add(Ledger(job_id=ids[3], note="taken"))  # job 3's insert will violate the primary key

    @tasks.task(group_commit=True)
    def write(job: TaskJob, session: Session) -> None:
        runs[job.id] += 1
        session.add(Ledger(job_id=job.id, note="job"))

    result = _worker(engine, tasks, mode=mode).run(until_empty=True)
    assert (result.completed, result.dead) == (COUNT - 1, 1)
    ledger = _ledger(sessions)
    assert sorted(ledger) == ids and ledger[ids[3]] == "taken"
    assert _status(sessions, ids[3]) == "dead"
    assert max(runs.values()) == 2 and runs[ids[3]] == 2


@pytest.mark.parametrize("mode", ["lease", "transaction"])
def test_a_deadline_in_a_group_settles_that_job_and_reruns_the_others(
    engine: Engine, sessions: sessionmaker[Session], mode: str
) -> None:
    """The deadline cancels the group's statement on the server, in whichever
    handler it runs: nobody else is blamed, the others commit once."""
    tasks, runs = TaskRegistry(), Counter[int]()
    ids = _enqueue(sessions, "write", 6)
    slow = ids[2]

    @tasks.task(group_commit=True, timeout=timedelta(seconds=1))
    def write(job: TaskJob, session: Session) -> None:
        runs[job.id] += 1
        if job.id == slow:
            session.execute(text("SELECT pg_sleep(60)"))
        session.add(Ledger(job_id=job.id, note="job"))

    result = _worker(engine, tasks, concurrency=1, batch_size=6, mode=mode).run(until_empty=True)
    assert (result.completed, result.dead) == (5, 1)
    assert sorted(_ledger(sessions)) == sorted(set(ids) - {slow})
    assert _status(sessions, slow) == "dead"
    assert runs[slow] == 1 and max(runs.values()) <= 2


def test_a_cancel_asked_for_in_a_group_ends_that_job_cancelled_and_the_others_commit(
    engine: Engine, sessions: sessionmaker[Session]
) -> None:
    tasks, runs = TaskRegistry(), Counter[int]()
    ids = _enqueue(sessions, "write", 6)
    victim = ids[1]

    def cancel(job: TaskJob, other: Session) -> None:
        assert jobs.cancel(other, job.id)
        other.commit()
        # The worker tells the job through NOTIFY (or its next heartbeat).
        wait_for(lambda: job.cancel_requested_at is not None, 30, "the cancel to reach the running job")

    _grouped_task_meddling_once(tasks, runs, sessions, victim, cancel)

    result = _worker(engine, tasks, concurrency=1, batch_size=6, listen=True,
                     heartbeat_interval=timedelta(seconds=0.5)).run(until_empty=True)
    assert (result.completed, result.cancelled) == (5, 1)
    assert sorted(_ledger(sessions)) == sorted(set(ids) - {victim})
    assert _status(sessions, victim) == "cancelled"


def test_a_lost_lease_in_a_group_loses_that_job_only(engine: Engine, sessions: sessionmaker[Session]) -> None:
    """The fence refuses one job of the group (another worker took it over):
    its writes never commit; the others run again and commit once."""
    tasks, runs = TaskRegistry(), Counter[int]()
    ids = _enqueue(sessions, "write", 6)
    stolen = ids[4]

    def steal(job: TaskJob, other: Session) -> None:  # as a reap and a new claim by another worker would
        other.execute(update(TaskJob).where(TaskJob.id == job.id).values(lock_token=uuid4(), locked_by="other"))

    _grouped_task_meddling_once(tasks, runs, sessions, stolen, steal)

    result = _worker(engine, tasks, concurrency=1, batch_size=6).run(until_empty=True)
    assert (result.completed, result.lost) == (5, 1)
    assert sorted(_ledger(sessions)) == sorted(set(ids) - {stolen})
    assert runs[stolen] == 1
    assert _status(sessions, stolen) == "running"  # the other worker's now


# -- transaction mode: a SAVEPOINT per group instead of one per job ---------------------


def _savepoints(engine: Engine, run: Callable[[], object]) -> list[str]:
    """The SAVEPOINT statements the engine's connections sent during ``run()``."""
    sent: list[str] = []

    def look(conn: object, cursor: object, statement: str, *rest: object) -> None:
        if statement.startswith("SAVEPOINT"):
            sent.append(statement)

    event.listen(engine, "before_cursor_execute", look)
    try:
        run()
    finally:
        event.remove(engine, "before_cursor_execute", look)
    return sent


def test_in_transaction_mode_consecutive_grouped_jobs_share_one_savepoint(
    engine: Engine, sessions: sessionmaker[Session]
) -> None:
    tasks, runs = TaskRegistry(), Counter[int]()
    _grouped_ledger_task(tasks, runs)

    @tasks.task
    def alone(job: TaskJob, session: Session) -> None:
        session.add(Ledger(job_id=job.id, note="alone"))

    ids = _enqueue(sessions, "write", 10) + _enqueue(sessions, "alone", 1) + _enqueue(sessions, "write", 9)
    worker = _worker(engine, tasks, concurrency=1, mode="transaction")
    sent = _savepoints(engine, lambda: worker.run(until_empty=True))
    assert len(sent) == 3  # the ten, the one alone, the nine: the batch of 20 in claim order
    assert sorted(_ledger(sessions)) == ids
    assert set(runs.values()) == {1}


def test_in_transaction_mode_a_failing_grouped_handler_is_recorded_alone(
    engine: Engine, sessions: sessionmaker[Session]
) -> None:
    tasks, runs = TaskRegistry(), Counter[int]()
    ids = _enqueue(sessions, "write")
    bad = {ids[5], ids[15]}
    _grouped_ledger_task(tasks, runs, fail=bad)
    result = _worker(engine, tasks, concurrency=1, mode="transaction").run(until_empty=True)
    assert (result.completed, result.dead) == (COUNT - 2, 2)
    assert sorted(_ledger(sessions)) == sorted(set(ids) - bad)
    assert all(_status(sessions, i) == "dead" for i in bad)
    assert all(runs[i] == 1 for i in bad) and max(runs.values()) <= 2
    assert all(runs[i] == 2 for i in ids[:5])  # ran in the group, rolled back with it, then alone


def test_in_transaction_mode_a_stop_in_a_group_commits_what_ran_and_hands_back_the_rest(
    engine: Engine, sessions: sessionmaker[Session]
) -> None:
    tasks, worker = TaskRegistry(), []
    ids = _enqueue(sessions, "write", 5)

    @tasks.task(group_commit=True)
    def write(job: TaskJob, session: Session) -> None:
        session.add(Ledger(job_id=job.id, note="job"))
        if job.id == ids[1]:
            worker[0].stop()  # the group runs no further job

    worker.append(_worker(engine, tasks, concurrency=1, batch_size=5, mode="transaction"))
    result = worker[0].run()
    assert (result.completed, result.handed_back) == (2, 3)
    assert sorted(_ledger(sessions)) == ids[:2]
    assert all(_status(sessions, i) == "pending" for i in ids[2:])


@pytest.mark.parametrize("bad", ["yes", 1, None])
def test_group_commit_must_be_a_bool(bad: object) -> None:
    with pytest.raises(InvalidArgumentError) as raised:
        TaskRegistry().register("t", lambda job, session: None, group_commit=bad)  # type: ignore[arg-type]
    assert raised.value.parameter == "group_commit"


def test_group_commit_needs_a_handler_that_takes_the_session() -> None:
    with pytest.raises(InvalidArgumentError) as raised:
        TaskRegistry().register("t", lambda job: None, group_commit=True)
    assert raised.value.parameter == "group_commit"


# -- pure decisions ---------------------------------------------------------------


@pytest.mark.parametrize(("count", "concurrency", "sizes"), [
    (0, 4, []), (1, 4, [1]), (3, 4, [1, 1, 1]), (32, 4, [8, 8, 8, 8]), (10, 4, [3, 3, 3, 1]),
    (100, 4, [25, 25, 25, 25]), (300, 2, [50] * 6), (7, 1, [7]),
])
def test_group_sizes_spread_a_claim_over_the_slots(count: int, concurrency: int, sizes: list[int]) -> None:
    assert group_sizes(count, concurrency) == sizes
    assert sum(sizes) == count


@pytest.mark.parametrize(("kinds", "parts"), [
    ("", []), ("s", ["s"]), ("g", ["G:g"]), ("ggsgg", ["G:gg", "s", "G:gg"]), ("ssg", ["s", "s", "G:g"]),
    ("ggggg", ["G:gg", "G:gg", "G:g"]),  # at most two per group here
])
def test_a_batch_runs_as_groups_of_consecutive_grouped_jobs_and_single_jobs(kinds: str, parts: list[str]) -> None:
    jobs = list(kinds)  # "g": a job of a group_commit task, "s": any other
    shown = [("G:" if is_group else "") + "".join(part) for is_group, part in batch_parts(jobs, "g".__eq__, most=2)]
    assert shown == parts


def test_slots_count_a_group_by_its_weight() -> None:
    gate, started = threading.Event(), threading.Event()

    def group(_: object) -> bool:
        started.set()
        return gate.wait(30)

    slots = Slots(1, name="t", on_done=lambda _: None)
    slots.submit(group, "first", weight=5)
    slots.submit(group, "second", weight=3)
    assert started.wait(30)
    assert len(slots) == 8
    assert slots.take_unstarted() == [("second",)]
    assert len(slots) == 5
    gate.set()
    assert slots.wait_idle(30)
    assert slots.take_results() == (1, 0, 0)
    slots.close()
