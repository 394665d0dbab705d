"""The watchdog frees a connection of the engine it watches stalled behind a
half-open path, never interrupts a statement the server is running, and
leaves other engines' connections alone (sa_jobqueue/watchdog.py)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from jobapp import Ledger, TaskJob, jobs
from psycopg.rows import tuple_row
from sqlalchemy import Connection, Engine, create_engine, event, select, text
from sqlalchemy.engine import URL
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session, sessionmaker
from tcpproxy import TcpProxy, local_port
from waiting import wait_for

from sa_jobqueue import RetryPolicy, TaskRegistry, Worker
from sa_jobqueue.connections import raw_connect, worker_engine
from sa_jobqueue.watchdog import Watchdog

_STATEMENT_EVENTS = ("before_cursor_execute", "after_cursor_execute", "before_execute", "after_execute")


def _upstream(url: URL) -> tuple[str, int] | str:
    """Where the server listens: a TCP address, or its Unix socket's path."""
    host = url.query.get("host") or url.host or "/var/run/postgresql"
    host = host if isinstance(host, str) else host[0]
    port = url.port or 5432
    return f"{host}/.s.PGSQL.{port}" if host.startswith("/") else (host, port)


@pytest.fixture
def proxied(db_url: URL) -> Iterator[tuple[TcpProxy, Engine]]:
    """A TCP proxy in front of the test database, and an app engine through it."""
    with TcpProxy(_upstream(db_url)) as proxy:
        app = create_engine(db_url.set(host="127.0.0.1", port=proxy.port, query={}))
        try:
            yield proxy, app
        finally:
            proxy.stop()  # first: frees whatever is still frozen, so that nothing below waits
            app.dispose()


@pytest.fixture
def watched(proxied: tuple[TcpProxy, Engine]) -> Iterator[Callable[..., tuple[Engine, Watchdog]]]:
    """Factory: a worker engine of the proxied app engine, and a watchdog
    watching it (not started); both are stopped and disposed at the end."""
    made: list[tuple[Engine, Watchdog, Callable[[], None]]] = []

    def make(**kwargs: Any) -> tuple[Engine, Watchdog]:
        _, app = proxied
        own = worker_engine(app, pool_size=2, name="watched")
        watchdog = Watchdog(raw_connect(app), **kwargs)
        made.append((own, watchdog, watchdog.watch_engine(own)))
        return own, watchdog

    yield make
    for own, watchdog, unwatch in made:
        watchdog.stop()
        unwatch()
        own.dispose()


def _in_thread(conn: Connection, query: str) -> tuple[threading.Thread, list[object]]:
    outcome: list[object] = []

    def run() -> None:
        try:
            outcome.append([tuple(row) for row in conn.execute(text(query))])
        except DBAPIError as exc:
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def _backend_exists(engine: Engine, pid: int) -> bool:
    with engine.connect() as conn:
        return bool(conn.execute(text("SELECT count(*) FROM pg_stat_activity WHERE pid = :pid"), {"pid": pid}).scalar())


def _pid(conn: Connection) -> int:
    return int(conn.execute(text("SELECT pg_backend_pid()")).scalar_one())


def test_a_stalled_statement_fails_and_its_backend_is_terminated(
    proxied: tuple[TcpProxy, Engine], watched: Callable[..., tuple[Engine, Watchdog]], engine: Engine
) -> None:
    proxy, _ = proxied
    own, watchdog = watched(after=1.0, interval=0.2)
    with own.connect() as conn:
        pid = _pid(conn)
        watchdog.start()
        assert proxy.half_open() == 1
        thread, outcome = _in_thread(conn, "SELECT 2")
        thread.join(30)
        assert not thread.is_alive(), "the stalled statement was never freed"
    [error] = outcome
    assert isinstance(error, DBAPIError) and isinstance(error.orig, psycopg.OperationalError)
    assert error.connection_invalidated
    assert watchdog.freed == 1
    # `engine` reaches the server directly. The backend was told to go; it exits when it gets to it.
    wait_for(lambda: not _backend_exists(engine, pid), 30, "the terminated backend to exit")


def test_a_long_statement_is_left_alone(watched: Callable[..., tuple[Engine, Watchdog]]) -> None:
    own, watchdog = watched(after=0.3, interval=0.1)
    with own.connect() as conn:
        conn.execute(text("SELECT 1"))
        watchdog.start()
        thread, outcome = _in_thread(conn, "SELECT 7 FROM pg_sleep(2.5)")
        thread.join(30)
    assert not thread.is_alive() and outcome == [[(7,)]]
    assert watchdog.looks > 0 and watchdog.freed == 0


def test_a_busy_connection_is_left_alone(watched: Callable[..., tuple[Engine, Watchdog]]) -> None:
    """Statement after statement, each reply read late (as a thread starved
    of the GIL does): the connection has a statement in flight far longer
    than ``after`` in total, its backend idle for most of it, but no single
    statement waits that long and the backend's state keeps changing, so it
    is no stall."""
    own, watchdog = watched(after=1.0, interval=0.05)
    late: list[float] = []

    def read_late(cursor: Any) -> Any:
        # Called inside execute() once the reply is in: the statement is still
        # in flight for the watchdog while its backend already sits idle.
        time.sleep(0.2)
        late.append(time.monotonic())
        return tuple_row(cursor)

    with own.connect() as conn:
        conn.execute(text("SELECT 1"))  # connected and the dialect initialized, before the hook
        conn.connection.dbapi_connection.row_factory = read_late  # type: ignore[union-attr]
        try:
            watchdog.start()
            deadline = time.monotonic() + 4.0
            while time.monotonic() < deadline:
                conn.execute(text("SELECT 1"))
        finally:
            conn.connection.dbapi_connection.row_factory = tuple_row  # type: ignore[union-attr]
    assert len(late) > 5
    assert watchdog.freed == 0


def test_a_jobs_connection_is_watched_while_the_job_holds_it(proxied: tuple[TcpProxy, Engine]) -> None:
    """``watch_jobs``: a connection of the application's engine is watched
    from ``own(connection)`` until its undo; one given back is not."""
    proxy, app = proxied
    watchdog = Watchdog(raw_connect(app), after=1.0, interval=0.2)
    own = watchdog.watch_jobs()
    try:
        with app.connect() as held, app.connect() as released:
            for conn in (held, released):
                conn.execute(text("SELECT 1"))
            watch_held = own(held)
            own(released).release()
            watchdog.start()
            assert proxy.half_open() == 2
            released_thread, released_outcome = _in_thread(released, "SELECT 1")
            held_thread, held_outcome = _in_thread(held, "SELECT 2")
            held_thread.join(30)
            assert not held_thread.is_alive(), "the job's stalled statement was never freed"
            watch_held.release()
            looked = watchdog.looks
            wait_for(lambda: watchdog.looks >= looked + 3, 30, "three more looks of the watchdog")
            assert released_thread.is_alive() and released_outcome == []
            assert watchdog.freed == 1
            proxy.stop()
            released_thread.join(30)
            assert not released_thread.is_alive()
        [error] = held_outcome
        assert isinstance(error, DBAPIError) and error.connection_invalidated
    finally:
        watchdog.stop()


@pytest.mark.parametrize("mode", ["lease", "transaction"])
def test_a_jobs_commit_stalled_on_the_network_is_freed(
    proxied: tuple[TcpProxy, Engine], engine: Engine, mode: str
) -> None:
    """psycopg sends COMMIT from the connection, not a cursor: the worker
    marks it in flight, so a COMMIT behind a half-open path is freed like a
    statement. The first run's COMMIT stalls (its backend's connection alone
    is frozen, in ``before_commit``); the watchdog ends it, nothing of that
    run commits, and the job runs again and completes. Unwatched, the COMMIT
    would wait forever and the job with it."""
    proxy, app = proxied
    sessions = sessionmaker(app, expire_on_commit=False)
    registry = TaskRegistry()
    ports: list[int] = []
    runs: list[int] = []

    @registry.task(retry=RetryPolicy(base=timedelta(0), jitter=0.0))
    def commit_stalls_once(job: TaskJob, session: Session) -> None:
        runs.append(job.id)
        # The port of the job connection's own side, which the proxy sees as
        # its client (the server's client_port would be -1 over a Unix socket).
        ports.append(local_port(session.connection().connection.dbapi_connection.fileno()))  # type: ignore[union-attr]
        session.add(Ledger(job_id=job.id))

    frozen: list[int] = []

    @event.listens_for(sessions, "before_commit")
    def stall_the_first_commit(session: Session) -> None:
        if ports and not frozen:
            frozen.append(proxy.half_open(client_ports={ports[0]}))

    with Session(engine) as session, session.begin():
        job = jobs.enqueue(session, "commit_stalls_once")
    worker = Worker(sessions, jobs, registry, mode=mode, concurrency=1, poll_interval=0.05,
                    stall_timeout=timedelta(seconds=1), shutdown_timeout=timedelta(seconds=5))
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        def ledger_rows() -> int:
            with Session(engine) as session:
                return len(session.scalars(select(Ledger.job_id).where(Ledger.job_id == job.id)).all())

        wait_for(lambda: ledger_rows() == 1, 60, "the job to complete after its stalled COMMIT was freed")
    finally:
        worker.stop()
        thread.join(30)
    assert not thread.is_alive()
    assert frozen == [1] and len(runs) == 2  # the stalled run committed nothing; the second did
    with Session(engine) as session:
        assert session.get(TaskJob, job.id) is None  # completed once


@pytest.mark.parametrize("mode", ["lease", "transaction"])
def test_a_session_stalled_in_the_pools_checkout_is_given_up(
    db_url: URL, engine: Engine, caplog: pytest.LogCaptureFixture, mode: str
) -> None:
    """The app's pool keeps one connection, pre-pinged at checkout. A first
    job runs on it; then that connection alone goes half-open, in the pool.
    The next checkout stalls in the ping (outside any statement the watchdog
    sees): after ``stall_timeout`` the worker replaces the slot's thread (lease
    mode: and hands the job back unstarted; transaction mode: the batch had
    claimed nothing), and the job runs on a new connection. Transaction mode
    waited in the checkout for as long as the path stayed half-open."""
    with TcpProxy(_upstream(db_url)) as proxy:
        app = create_engine(db_url.set(host="127.0.0.1", port=proxy.port, query={}), pool_size=1, max_overflow=1,
                            pool_pre_ping=True)
        try:
            registry = TaskRegistry()
            runs: list[tuple[int, int]] = []
            ports: list[int] = []

            @registry.task
            def write(job: TaskJob, session: Session) -> None:
                runs.append((job.id, job.attempts))
                ports.append(local_port(session.connection().connection.dbapi_connection.fileno()))  # type: ignore[union-attr]
                session.add(Ledger(job_id=job.id))

            def completed(job_id: int) -> bool:
                with Session(engine) as session:
                    return session.get(TaskJob, job_id) is None and bool(
                        session.scalars(select(Ledger.job_id).where(Ledger.job_id == job_id)).all())

            frozen: list[int] = []

            @event.listens_for(app, "checkin")
            def freeze_in_the_pool(*args: object) -> None:
                # As the first job's connection is back in the pool, and before
                # another checkout (a transaction-mode probe) can take it.
                if ports and not frozen:
                    frozen.append(proxy.half_open(client_ports={ports[0]}))

            with Session(engine) as session, session.begin():
                first = jobs.enqueue(session, "write").id
            worker = Worker(sessionmaker(app, expire_on_commit=False), jobs, registry, mode=mode, concurrency=1,
                            poll_interval=0.05, listen=False, stall_timeout=timedelta(seconds=1),
                            shutdown_timeout=timedelta(seconds=5))
            thread = threading.Thread(target=worker.run, daemon=True)
            with caplog.at_level("ERROR", logger="sa_jobqueue.worker"):
                thread.start()
                try:
                    wait_for(lambda: completed(first), 60, "the first job to complete")
                    wait_for(lambda: bool(frozen), 30, "the first job's connection frozen as it went back to the pool")
                    assert frozen == [1]
                    with Session(engine) as session, session.begin():
                        second = jobs.enqueue(session, "write").id
                    wait_for(lambda: completed(second), 60, "the second job to complete on a new connection")
                finally:
                    worker.stop()
                    thread.join(30)
                    proxy.stop()  # the stalled ping fails; its replaced thread gives the connection back and ends
            assert not thread.is_alive()
            assert runs == [(first, 1), (second, 1)]  # its attempt not spent on the stalled checkout
            assert ports[1] != ports[0]
            assert any("waited 1 s for a connection; its thread is replaced" in r.getMessage()
                       for r in caplog.records)
        finally:
            proxy.stop()
            app.dispose()


def test_a_watched_connection_keeps_its_own_cursor_class(db_url: URL) -> None:
    """An application that makes client-side-binding cursors (``ClientCursor``,
    as behind PgBouncer) keeps them while a job holds the connection."""
    app = create_engine(db_url, connect_args={"cursor_factory": psycopg.ClientCursor})
    own = Watchdog(raw_connect(app), after=1.0).watch_jobs()
    try:
        with app.connect() as conn:
            dbapi_connection = conn.connection.dbapi_connection
            assert dbapi_connection is not None
            watch = own(conn)
            watched = type(dbapi_connection.cursor())
            assert issubclass(watched, psycopg.ClientCursor) and watched is not psycopg.ClientCursor
            assert conn.execute(text("SELECT :n"), {"n": 3}).scalar() == 3
            watch.release()
            assert type(dbapi_connection.cursor()) is psycopg.ClientCursor
    finally:
        app.dispose()


def test_watched_connections_share_one_cursor_class(db_url: URL) -> None:
    """Every watched connection of a process makes its cursors with the same
    class (one per cursor class it extends), whichever watchdog watches it: a
    class per connection makes the call sites that touch cursors see many
    types, which CPython runs on its slower path (a drain at 16 threads ran
    about 10% slower). That each statement still counts for its own
    connection alone is held by the test above of a held and a released
    connection."""
    app = create_engine(db_url, pool_size=3)
    first, second = (Watchdog(raw_connect(app), after=1.0) for _ in range(2))
    try:
        with app.connect() as a, app.connect() as b, app.connect() as c:
            conns = [conn.connection.dbapi_connection for conn in (a, b, c)]
            watches = [first.watch_jobs()(a), first.watch_jobs()(b), second.watch_jobs()(c)]
            watched = {type(conn.cursor()) for conn in conns if conn is not None}
            assert len(watched) == 1 and watched != {psycopg.Cursor}
            assert [conn.execute(text("SELECT :n"), {"n": n}).scalar() for n, conn in enumerate((a, b, c))] == [0, 1, 2]
            for watch in watches:
                watch.release()
            assert {type(conn.cursor()) for conn in conns if conn is not None} == {psycopg.Cursor}
    finally:
        app.dispose()


@pytest.mark.parametrize("mode", ["lease", "transaction"])
def test_a_running_worker_adds_no_statement_event_to_the_applications_engine(db_url: URL, mode: str) -> None:
    """A statement event on an engine puts every statement of it (the
    application's own too) on SQLAlchemy's slower path with events, about a
    sixth of a transaction-mode drain: the worker's watchdog watches its jobs'
    connections through their cursors instead."""
    app = create_engine(db_url)
    registry = TaskRegistry()
    running = threading.Event()
    release = threading.Event()
    seen: list[list[str]] = []

    @registry.task
    def look(job: TaskJob, session: Session) -> None:
        session.execute(text("SELECT 1"))
        seen.append([name for name in _STATEMENT_EVENTS if list(getattr(app.dispatch, name))])
        running.set()
        release.wait(60)

    with Session(app) as session, session.begin():
        jobs.enqueue(session, "look")
    worker = Worker(app, jobs, registry, mode=mode, concurrency=1, poll_interval=0.05)
    assert worker.options.stall_timeout is not None  # the watchdog is on by default
    thread = threading.Thread(target=worker.run, kwargs={"until_empty": True}, daemon=True)
    thread.start()
    try:
        assert running.wait(60), "the job never ran"
    finally:
        release.set()
        thread.join(60)
        app.dispose()
    assert seen == [[]]
    assert worker.result.completed == 1


def test_only_the_watched_engines_connections_are_freed(
    proxied: tuple[TcpProxy, Engine], watched: Callable[..., tuple[Engine, Watchdog]]
) -> None:
    """The app's connection stalls first and longest, on the same server:
    were it watched, it would be freed no later than the worker's."""
    proxy, app = proxied
    own, watchdog = watched(after=1.0, interval=0.2)
    with app.connect() as app_conn, own.connect() as own_conn:
        app_conn.execute(text("SELECT 1"))
        own_conn.execute(text("SELECT 1"))
        watchdog.start()
        assert proxy.half_open() == 2
        app_thread, app_outcome = _in_thread(app_conn, "SELECT 1")
        own_thread, own_outcome = _in_thread(own_conn, "SELECT 2")
        own_thread.join(30)
        assert not own_thread.is_alive(), "the worker engine's stalled statement was never freed"
        looked = watchdog.looks
        # Three more looks: time enough to suspect the app's statement and confirm it twice.
        wait_for(lambda: watchdog.looks >= looked + 3, 30, "three more looks of the watchdog")
        assert app_thread.is_alive() and app_outcome == []
        assert watchdog.freed == 1
        proxy.stop()  # the app's stalled statement fails once its socket closes
        app_thread.join(30)
        assert not app_thread.is_alive()
    assert isinstance(own_outcome[0], DBAPIError)
