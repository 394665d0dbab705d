"""Operations a deployment needs (issue 13): paused queues, the workers'
presence, and the progress of a running job; both drivers, both modes, real
worker processes for what crosses processes."""

from __future__ import annotations

import asyncio
import contextlib
import io
import math
import os
import signal
import threading
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import jobapp
import pytest
from jobapp import TaskJob
from sqlalchemy import Engine, create_engine, select, text
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.orm import Session, sessionmaker
from test_docs import DOCS, python_blocks, section
from waiting import wait_for

from sa_jobqueue import (
    InvalidArgumentError,
    JobContext,
    JobRepository,
    JobSpec,
    Progress,
    TaskRegistry,
    Worker,
    list_workers,
    pause_queue,
    paused_queues,
    progress_of,
    report_progress,
    resume_queue,
)
from sa_jobqueue.aio import AsyncWorker
from sa_jobqueue.worker.context import claimable

jobs = JobRepository(TaskJob)


# -- what the loop claims from (pure) --------------------------------------------


def test_claimable_leaves_out_paused_queues_and_keeps_the_order() -> None:
    assert claimable(["a", "b", "c"], frozenset({"b"})) == ["a", "c"]
    assert claimable(["a", "b"], frozenset({"a", "b"})) == []
    assert claimable(["a", "b"], frozenset({"z"})) == ["a", "b"]


# -- the verbs ---------------------------------------------------------------------


def test_pause_and_resume_commit_with_the_callers_transaction(engine: Engine, sessions: sessionmaker[Session]) -> None:
    with sessions.begin() as session:
        assert pause_queue(session, jobs, "mail", by="ops") is True
        assert pause_queue(session, TaskJob, "mail") is False  # already: no error, nothing changed
    with sessions() as session:
        assert paused_queues(session) == {"task_jobs": {"mail"}}
        assert paused_queues(session, ["email_jobs"]) == {}
    with sessions() as session, session.begin():
        assert resume_queue(session, jobs, "mail") is True
        session.rollback()
    with sessions.begin() as session:
        assert paused_queues(session) == {"task_jobs": {"mail"}}  # the rolled back resume changed nothing
        assert resume_queue(session, jobs, "mail") is True
        assert resume_queue(session, jobs, "mail") is False


@pytest.mark.parametrize(
    ("call", "parameter"),
    [
        (lambda s: pause_queue(s, jobs, ""), "queue"),
        (lambda s: pause_queue(s, jobs, "q\x00"), "queue"),
        (lambda s: pause_queue(s, jobs, "q", by="x" * 256), "by"),
        (lambda s: pause_queue(s, object(), "q"), "jobs"),
        (lambda s: resume_queue(s, jobs, 7), "queue"),
        (lambda s: pause_queue("not a session", jobs, "q"), "session"),
    ],
)
def test_bad_pause_arguments_raise_naming_them_and_write_nothing(
    engine: Engine, sessions: sessionmaker[Session], call: Any, parameter: str
) -> None:
    with sessions.begin() as session:
        with pytest.raises(InvalidArgumentError) as info:
            call(session)
        assert info.value.parameter == parameter
    with sessions() as session:
        assert paused_queues(session) == {}


def _jobapp_log(tmp_path: Path, n: int = 0) -> str:
    path = tmp_path / f"proc-{n}.log"
    return path.read_text() if path.exists() else ""


def _statuses(sessions: sessionmaker[Session], ids: list[int]) -> list[str]:
    with sessions() as session:
        return list(session.scalars(select(TaskJob.status).where(TaskJob.id.in_(ids))))


def _finished(sessions: sessionmaker[Session], ids: list[int]) -> bool:
    return _statuses(sessions, ids) == []  # task_jobs deletes finished jobs


@pytest.mark.parametrize("mode", ["lease", "transaction"])
def test_a_worker_process_stops_claiming_a_queue_paused_while_it_runs_and_resumes_it(
    engine: Engine, sessions: sessionmaker[Session], spawn: Any, libpq_url: str, tmp_path: Path, mode: str
) -> None:
    worker = spawn("work", libpq_url, "--mode", mode, "--queues", "default,other", "--poll", "0.2")
    wait_for(lambda: any(w.alive for w in _workers(sessions)), 30, "the worker's presence")
    with sessions.begin() as session:
        pause_queue(session, jobs, "default")
    wait_for(lambda: "queue default of task_jobs is paused" in _jobapp_log(tmp_path), 30,
             "the worker to read the pause")
    # Enqueued first at the same priority: unpaused, these would be claimed before the others.
    with sessions.begin() as session:
        held = [j.id for j in jobs.enqueue_many(session, [JobSpec("noop") for _ in range(5)])]
        others = [j.id for j in jobs.enqueue_many(session, [JobSpec("noop", queue="other") for _ in range(5)])]
    wait_for(lambda: _finished(sessions, others), 30, "the other queue's jobs")
    assert _statuses(sessions, held) == ["pending"] * 5
    with sessions.begin() as session:
        resume_queue(session, jobs, "default")
    wait_for(lambda: _finished(sessions, held), 30, "the resumed queue's jobs")
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(timeout=60) == 0


# -- presence ---------------------------------------------------------------------


def _workers(sessions: sessionmaker[Session]) -> list[Any]:
    with sessions() as session:
        return list_workers(session)


def _gate() -> tuple[TaskRegistry, threading.Event]:
    registry, release = TaskRegistry(), threading.Event()

    @registry.task
    def reporting(job: TaskJob, session: Session) -> None:
        report_progress(job, 0.25, "a quarter")
        report_progress(job, 0.5, "half way")
        release.wait(60)

    @registry.task
    def reporting_ctx(ctx: JobContext) -> None:
        report_progress(ctx.job, 0.75, "from the context")
        release.wait(60)

    return registry, release


@pytest.mark.parametrize("mode", ["lease", "transaction"])
def test_a_running_worker_shows_itself_and_its_jobs_progress_and_withdraws_at_a_clean_stop(
    engine: Engine, sessions: sessionmaker[Session], mode: str
) -> None:
    registry, release = _gate()
    with sessions.begin() as session:
        first = jobs.enqueue(session, "reporting").id
        second = jobs.enqueue(session, "reporting_ctx").id
    # batch_size 1: in transaction mode each job its own batch, so both run at once.
    worker = Worker(engine, jobs, registry, mode=mode, concurrency=2, poll_interval=0.05, name="w-presence",
                    lease=timedelta(seconds=3), heartbeat_interval=timedelta(seconds=0.2), batch_size=1)
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        def both_reported() -> bool:
            mine = [w for w in _workers(sessions) if w.name == "w-presence"]
            return bool(mine) and {(r["id"], (r["progress"] or {}).get("fraction")) for r in mine[0].running} == {
                (first, 0.5), (second, 0.75)}

        wait_for(both_reported, 30, "the presence row with both jobs' progress")
        (me,) = [w for w in _workers(sessions) if w.name == "w-presence"]
        assert me.alive and me.pid == os.getpid() and me.driver == "threads" and me.mode == mode
        assert me.tables == ["task_jobs"] and me.queues == ["default"] and me.concurrency == 2
        assert {r["task"] for r in me.running} == {"reporting", "reporting_ctx"}
        assert all(r["since"] and r["queue"] == "default" and r["attempt"] == 1 for r in me.running)
        if mode == "lease":  # the heartbeat writes it to the job's row too
            def row_progress() -> Progress | None:
                with sessions() as session:
                    return progress_of(session.get(TaskJob, first))

            wait_for(lambda: row_progress() == Progress(0.5, "half way"), 30, "the heartbeat to write progress")
        else:  # the row is locked by the job's own transaction, and stays as claimed
            with sessions() as session:
                assert session.scalar(select(TaskJob.progress).where(TaskJob.id == first)) is None
    finally:
        release.set()
        worker.stop()
        thread.join(timeout=60)
    assert not thread.is_alive()
    assert [w for w in _workers(sessions) if w.name == "w-presence"] == []


def test_a_killed_worker_process_stays_listed_as_gone(
    engine: Engine, sessions: sessionmaker[Session], spawn: Any, libpq_url: str
) -> None:
    victim = spawn("work", libpq_url, "--lease", "1", "--poll", "0.1")
    wait_for(lambda: any(w.pid == victim.pid and w.alive for w in _workers(sessions)), 30, "the worker's presence")
    victim.send_signal(signal.SIGKILL)
    victim.wait(timeout=30)
    # Three missed beats (of lease / 3) later it is gone, and its row is kept to show it.
    wait_for(lambda: any(w.pid == victim.pid and not w.alive for w in _workers(sessions)), 30,
             "the killed worker to be listed as gone")


def test_workers_without_the_operations_tables_run_jobs_and_say_so_once(
    create_database: Any, caplog: pytest.LogCaptureFixture
) -> None:
    own = create_engine(create_database())
    jobapp.Base.metadata.create_all(own)  # no sa_jobqueue_workers, no sa_jobqueue_paused_queues
    try:
        with Session(own) as session, session.begin():
            jobs.enqueue_many(session, [JobSpec("noop") for _ in range(3)])
        with caplog.at_level("WARNING", logger="sa_jobqueue.worker"):
            result = Worker(own, jobs, jobapp.tasks, poll_interval=0.05, listen=False).run(until_empty=True)
        assert result.completed == 3
        warned = [r.getMessage() for r in caplog.records if "sa_jobqueue_" in r.getMessage()]
        assert len([m for m in warned if "sa_jobqueue_workers" in m]) == 1, warned
        assert len([m for m in warned if "sa_jobqueue_paused_queues" in m]) == 1, warned
    finally:
        own.dispose()


# -- progress ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "parameter"),
    [((-0.1,), "fraction"), ((1.5,), "fraction"), ((math.nan,), "fraction"), ((True,), "fraction"),
     (("half",), "fraction"), ((0.5, "x" * 201), "message"), ((0.5, 7), "message"), ((0.5, "a\x00"), "message")],
)
def test_bad_progress_raises_naming_the_parameter_and_keeps_the_last_report(args: tuple[Any, ...],
                                                                            parameter: str) -> None:
    job = TaskJob(id=1, queue="default", task="t", attempts=1)
    job.lock_token = None
    report_progress(job, 0.3, "ok")
    with pytest.raises(InvalidArgumentError) as info:
        report_progress(job, *args)
    assert info.value.parameter == parameter
    assert progress_of(job) == Progress(0.3, "ok")


def test_the_claim_clears_the_progress_of_an_earlier_attempt(engine: Engine, sessions: sessionmaker[Session]) -> None:
    with sessions.begin() as session:
        job_id = jobs.enqueue(session, "noop").id
        session.execute(text("UPDATE task_jobs SET progress = '{\"fraction\": 0.9, \"message\": \"old\"}'"))
    with sessions.begin() as session:
        (claimed,) = jobs.claim(session, limit=1)
        assert claimed.id == job_id and claimed.progress is None and progress_of(claimed) is None
    with sessions() as session:  # SQL NULL, not the JSON null
        assert session.scalar(text("SELECT progress IS NULL FROM task_jobs WHERE id = :id"), {"id": job_id}) is True


def test_the_heartbeat_writes_progress_only_for_an_owned_running_job(
    engine: Engine, sessions: sessionmaker[Session]
) -> None:
    from sa_jobqueue.progress import record_progress

    with sessions.begin() as session:
        jobs.enqueue_many(session, [JobSpec("noop"), JobSpec("noop")])
    with sessions.begin() as session:
        mine, lost = jobs.claim(session, limit=2)
    with sessions.begin() as session:
        session.execute(text("UPDATE task_jobs SET lock_token = gen_random_uuid() WHERE id = :id"), {"id": lost.id})
    report_progress(mine, 0.4, "mine")
    report_progress(lost, 0.4, "not mine any more")
    with sessions.begin() as session:
        assert record_progress(session, TaskJob.__table__, [mine, lost]) == {mine.id}
    with sessions() as session:
        rows = {r.id: r.progress for r in session.execute(select(TaskJob.id, TaskJob.progress))}
    assert rows == {mine.id: {"fraction": 0.4, "message": "mine"}, lost.id: None}


# -- the asyncio worker -------------------------------------------------------------


@pytest.mark.anyio
async def test_the_asyncio_worker_shows_itself_honours_a_pause_and_reports_progress(
    async_engine: AsyncEngine, engine: Engine, sessions: sessionmaker[Session], running: list[asyncio.Task[Any]]
) -> None:
    registry, release = TaskRegistry(), asyncio.Event()

    @registry.task
    async def reporting(job: TaskJob) -> None:
        report_progress(job, 0.5, "async half")
        await release.wait()

    with sessions.begin() as session:
        pause_queue(session, jobs, "default")
        paused = jobs.enqueue(session, "reporting").id
        other = jobs.enqueue(session, "reporting", queue="other").id
    worker = AsyncWorker(async_engine, jobs, registry, queues=["default", "other"], poll_interval=0.05,
                         listen=False, name="aio-presence", lease=timedelta(seconds=3),
                         heartbeat_interval=timedelta(seconds=0.2))
    task = asyncio.get_running_loop().create_task(worker.run(handle_signals=False))
    running.append(task)

    def reported() -> bool:
        mine = [w for w in _workers(sessions) if w.name == "aio-presence"]
        return bool(mine) and [(r["id"], r["progress"]) for r in mine[0].running] == [
            (other, {"fraction": 0.5, "message": "async half"})]

    deadline = time.monotonic() + 30
    while not reported():
        assert time.monotonic() < deadline, "the asyncio worker's presence with the job's progress"
        await asyncio.sleep(0.05)
    (me,) = [w for w in _workers(sessions) if w.name == "aio-presence"]
    assert me.driver == "asyncio" and me.alive
    assert _statuses(sessions, [paused]) == ["pending"]
    release.set()
    worker.stop()
    await asyncio.wait_for(task, 60)
    assert [w for w in _workers(sessions) if w.name == "aio-presence"] == []


# -- docs/operations.md's blocks ---------------------------------------------------


def test_the_operations_pages_blocks_run(engine: Engine, sessions: sessionmaker[Session]) -> None:
    """"Pausing a queue" and "Workers: who is alive" run as shown, with a worker alive for the second."""
    (pausing,) = python_blocks(section(DOCS / "operations.md", "## Pausing a queue"))
    exec(compile(pausing, "docs/operations.md, pausing", "exec", dont_inherit=True),
         {"engine": engine, "emails": jobapp.emails})
    with sessions() as session:
        assert paused_queues(session) == {}  # paused, checked, resumed
    (listing,) = python_blocks(section(DOCS / "operations.md", "## Workers: who is alive, and what each runs"))
    worker = Worker(engine, jobs, TaskRegistry(), poll_interval=0.05, name="docs-worker")
    thread = threading.Thread(target=worker.run)
    thread.start()
    printed = io.StringIO()
    try:
        wait_for(lambda: any(w.name == "docs-worker" for w in _workers(sessions)), 30, "the worker's presence")
        with contextlib.redirect_stdout(printed):
            exec(compile(listing, "docs/operations.md, workers", "exec", dont_inherit=True), {"engine": engine})
    finally:
        worker.stop()
        thread.join(timeout=60)
    assert "docs-worker alive ['default'] 0 running" in printed.getvalue()
    (counted,) = python_blocks(section(DOCS / "operations.md", "## Throughput: what the workers finished"))
    from sa_jobqueue.throughput import add_finished

    with sessions.begin() as session:
        add_finished(session, {("email_jobs", "default"): [3, 1]})
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(counted, "docs/operations.md, throughput", "exec", dont_inherit=True), {"engine": engine})
    assert "3 done, 1 failed" in printed.getvalue()


# -- throughput ----------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["lease", "transaction"])
def test_the_workers_count_what_they_finished_per_minute_for_the_overview(
    engine: Engine, sessions: sessionmaker[Session], mode: str
) -> None:
    from sa_jobqueue import RetryPolicy
    from sa_jobqueue.throughput import per_minute

    registry = TaskRegistry()

    @registry.task
    def fine(job: TaskJob) -> None:
        pass

    @registry.task(retry=RetryPolicy(base=timedelta(0), max_delay=timedelta(0), jitter=0), max_attempts=2)
    def fails_once(job: TaskJob) -> None:
        if job.attempts == 1:
            raise RuntimeError("first attempt")

    with sessions.begin() as session:
        jobs.enqueue_many(session, [JobSpec("fine") for _ in range(3)] + [JobSpec("fine", queue="other")])
        jobs.enqueue(session, "fails_once")
    worker = Worker(engine, jobs, registry, mode=mode, queues=["default", "other"], poll_interval=0.05,
                    listen=False)
    result = worker.run(until_empty=True)
    assert (result.completed, result.retried) == (5, 1)
    with sessions() as session:  # the stop wrote its last counts
        minutes = per_minute(session, "task_jobs")
        by_queue = dict(session.execute(text(
            "SELECT queue, sum(completed) || '/' || sum(failed) FROM sa_jobqueue_throughput GROUP BY queue")).all())
    assert len(minutes) == 60 and minutes[-1].start > minutes[0].start
    assert (sum(m.done for m in minutes), sum(m.failed for m in minutes)) == (5, 1)
    assert by_queue == {"default": "4/1", "other": "1/0"}


def test_counts_a_beat_could_not_write_are_written_by_a_later_one() -> None:
    from sa_jobqueue.worker.books import Books

    books = Books()
    job = TaskJob(id=1, queue="q", task="t", attempts=1)
    books.tally(job, "completed")
    taken = books.take_tally()
    assert taken == {("task_jobs", "q"): [1, 0]} and books.take_tally() == {}
    books.tally(job, "failed")
    books.give_back_tally(taken)  # the write failed
    assert books.take_tally() == {("task_jobs", "q"): [1, 1]}


def test_jobs_held_released_and_tallied_together_are_as_one_at_a_time() -> None:
    """Books.hold_all / release_all / tally_all (a claim's jobs, a batched write's) leave the books
    as hold / release / tally of each job would."""
    from sa_jobqueue.worker.books import Books

    one, many = Books(), Books()
    claimed = [TaskJob(id=n, queue="q" if n % 3 else "r", task="t", attempts=1, lock_token=uuid.uuid4())
               for n in range(1, 8)]
    for job in claimed:
        one.hold("repo", job)
    held = many.hold_all("repo", claimed)
    assert [h.job for h in held] == claimed and all(h.repo == "repo" for h in held)
    assert [h.job for h in many.held()] == [h.job for h in one.held()] == claimed
    for job in claimed[:4]:
        one.release(job)
        one.tally(job, "completed")
    many.release_all(claimed[:4])
    many.tally_all(claimed[:4], "completed")
    one.tally(claimed[4], "failed")
    many.tally_all([claimed[4]], "failed")
    assert [h.job for h in many.held()] == [h.job for h in one.held()] == claimed[4:]
    assert many.take_tally() == one.take_tally() == {("task_jobs", "q"): [3, 1], ("task_jobs", "r"): [1, 0]}
