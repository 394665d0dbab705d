"""The jobs' sessions in lease mode: a fresh session per job, on the connection
its slot holds while it has work (sa_jobqueue/worker/job_sessions.py)."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from jobapp import Ledger, TaskJob, jobs
from sqlalchemy import Engine, create_engine, func, select, text
from sqlalchemy.orm import Session, sessionmaker
from waiting import terminate_backend, wait_for

from sa_jobqueue import JobSpec, TaskRegistry, Worker


def _seen_by(tasks: TaskRegistry) -> list[dict[str, Any]]:
    """Register ``look``: it records what its session is, then writes a ledger row."""
    seen: list[dict[str, Any]] = []

    @tasks.task
    def look(job: TaskJob, session: Session) -> None:
        connection = session.connection(bind_arguments={"mapper": TaskJob})  # binds need to be told the table
        seen.append({
            "job": job.id,
            "pid": connection.scalar(select(func.pg_backend_pid())),
            "isolation": connection.scalar(text("SELECT current_setting('transaction_isolation')")),
            "session": session.hash_key,
            "info": dict(session.info),
            "identity": len(session.identity_map),
            "bind": session.get_bind(TaskJob),
        })
        session.info["job"] = job.id  # must not reach the next job's session
        session.add(Ledger(job_id=job.id))
        session.flush()  # the row is now in this session's identity map

    return seen


def test_a_slots_jobs_share_its_connection_and_never_a_session(
    engine: Engine, sessions: sessionmaker[Session]
) -> None:
    tasks = TaskRegistry()
    seen = _seen_by(tasks)
    with sessions.begin() as session:
        jobs.enqueue_many(session, [JobSpec("look") for _ in range(6)])
    result = Worker(engine, jobs, tasks, concurrency=1, batch_size=6, poll_interval=0.1).run(until_empty=True)
    assert result.completed == 6
    assert len({s["pid"] for s in seen}) == 1  # one connection for the slot's consecutive jobs
    assert len({s["session"] for s in seen}) == 6  # a new session for each
    assert all(s["info"] == {} and s["identity"] == 0 for s in seen)
    assert all(s["bind"] is engine for s in seen)  # as anywhere else: the Engine, not the held connection
    with sessions() as session:
        assert session.scalar(select(func.count()).select_from(Ledger)) == 6


@pytest.mark.parametrize("mode", ["lease", "transaction"])
def test_job_transactions_are_read_committed_whatever_the_engine_default(db_url: Any, mode: str) -> None:
    engine = create_engine(db_url, isolation_level="REPEATABLE READ")
    try:
        tasks = TaskRegistry()
        seen = _seen_by(tasks)
        with Session(engine) as session, session.begin():
            jobs.enqueue_many(session, [JobSpec("look") for _ in range(4)])
        result = Worker(engine, jobs, tasks, concurrency=1, mode=mode, poll_interval=0.1).run(until_empty=True)
        assert result.completed == 4
        assert {s["isolation"] for s in seen} == {"read committed"}
        with engine.connect() as conn:  # the pool's connections are the engine's again
            assert conn.scalar(text("SELECT current_setting('transaction_isolation')")) == "repeatable read"
    finally:
        with engine.begin() as conn:
            conn.execute(text("TRUNCATE task_jobs, ledger"))
        engine.dispose()


def test_an_idle_slot_gives_its_connection_back_to_the_pool(engine: Engine, sessions: sessionmaker[Session]) -> None:
    tasks = TaskRegistry()
    seen = _seen_by(tasks)
    worker = Worker(engine, jobs, tasks, concurrency=2, poll_interval=0.1)
    runner = threading.Thread(target=worker.run)
    runner.start()
    try:
        with sessions.begin() as session:
            jobs.enqueue_many(session, [JobSpec("look") for _ in range(3)])
        wait_for(lambda: len(seen) == 3, 30, "three jobs run")
        # Nothing waits: the slots' connections are all back in the application's pool.
        wait_for(lambda: engine.pool.checkedout() == 0, 30, "the slots' connections back in the pool")  # type: ignore[attr-defined]
    finally:
        worker.stop()
        runner.join(30)
    assert not runner.is_alive()


def test_a_connection_a_job_made_unusable_is_replaced(
    engine: Engine, sessions: sessionmaker[Session], libpq_url: str
) -> None:
    tasks = TaskRegistry()
    pids: list[int] = []
    killer = create_engine(engine.url)

    @tasks.task
    def lose_connection(job: TaskJob, session: Session) -> None:
        pid = session.scalar(select(func.pg_backend_pid()))
        assert pid is not None
        pids.append(pid)
        if len(pids) == 1:  # the first job's connection is terminated under it
            terminate_backend(killer, pid, "the job's backend gone")
            session.execute(text("SELECT 1"))  # fails: the connection is gone
        session.add(Ledger(job_id=job.id))
        session.flush()

    try:
        with sessions.begin() as session:
            first = jobs.enqueue(session, "lose_connection")
            jobs.enqueue_many(session, [JobSpec("lose_connection") for _ in range(3)])
        result = Worker(engine, jobs, tasks, concurrency=1, batch_size=4, poll_interval=0.1).run(until_empty=True)
    finally:
        killer.dispose()
    assert result.completed == 3 and result.retried == 1
    assert pids[0] not in pids[1:]  # the next jobs ran on a new connection
    with sessions() as session:
        row = session.get(TaskJob, first.id)
        assert row is not None and row.status == "pending" and row.attempts == 1
        assert "terminat" in (row.last_error or "") or "closed" in (row.last_error or "")


def test_a_sessionmaker_with_binds_gets_a_connection_per_job(engine: Engine, sessions: sessionmaker[Session]) -> None:
    tasks = TaskRegistry()
    seen = _seen_by(tasks)
    with sessions.begin() as session:
        jobs.enqueue_many(session, [JobSpec("look") for _ in range(3)])
    per_table = sessionmaker(binds={TaskJob: engine, Ledger: engine}, expire_on_commit=False)
    result = Worker(per_table, jobs, tasks, concurrency=1, listen=False, poll_interval=0.1).run(until_empty=True)
    assert result.completed == 3
    assert all(isinstance(s["bind"], Engine) for s in seen)  # its sessions choose their own connections
    assert {s["isolation"] for s in seen} == {"read committed"}


def test_a_session_a_handler_opens_on_its_bind_is_a_session_of_its_own(
    engine: Engine, sessions: sessionmaker[Session]
) -> None:
    """``Session(session.get_bind())`` in a handler (an audit row that must
    commit whatever the job does, a session a buggy handler leaves open) gets
    a connection of its own from the pool: its commit commits, even when the
    job then fails, and one it leaves open does not touch the job's
    transaction, whose completion commits."""
    tasks = TaskRegistry()
    backends: dict[str, set[int]] = {"job": set(), "own": set()}
    left_open: list[Session] = []

    @tasks.task(max_attempts=1)
    def audited(job: TaskJob, session: Session) -> None:
        backends["job"].add(session.scalar(select(func.pg_backend_pid())) or 0)
        own = Session(session.get_bind())
        backends["own"].add(own.scalar(select(func.pg_backend_pid())) or 0)
        if job.payload.get("leave_open"):
            left_open.append(own)  # idle in transaction until the test closes it
            return
        with own:
            own.add(Ledger(job_id=job.id, note="audit"))
            own.commit()
        raise RuntimeError("the job fails after its audit row committed")

    try:
        with sessions.begin() as session:
            failing = jobs.enqueue(session, "audited")
            kept = jobs.enqueue(session, "audited", payload={"leave_open": True})
        result = Worker(engine, jobs, tasks, concurrency=1, batch_size=2, listen=False,
                        poll_interval=0.1).run(until_empty=True)
    finally:
        for own in left_open:
            own.close()
    assert result.completed == 1 and result.dead == 1
    assert not backends["job"] & backends["own"]  # never the job's connection
    with sessions() as session:
        assert session.scalar(select(Ledger.note).where(Ledger.job_id == failing.id)) == "audit"
        assert session.get(TaskJob, kept.id) is None  # completed: its completion committed
        dead = session.get(TaskJob, failing.id)
        assert dead is not None and dead.status == "dead"
