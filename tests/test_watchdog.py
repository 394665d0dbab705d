"""The watchdog frees a connection stalled behind a half-open path, and never
interrupts a statement the server is running (sa_jobqueue/watchdog.py)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import psycopg
import pytest
from sqlalchemy.engine import URL
from tcpproxy import TcpProxy

from sa_jobqueue.watchdog import Watchdog


def _upstream(url: URL) -> tuple[str, int] | str:
    """Where the server listens: a TCP address, or its Unix socket's path."""
    host = url.query.get("host") or url.host or "/var/run/postgresql"
    host = host if isinstance(host, str) else host[0]
    port = url.port or 5432
    return f"{host}/.s.PGSQL.{port}" if host.startswith("/") else (host, port)


@pytest.fixture
def proxied(db_url: URL) -> Iterator[tuple[TcpProxy, str]]:
    """A TCP proxy in front of the test database, and a libpq URL through it."""
    with TcpProxy(_upstream(db_url)) as proxy:
        url = db_url.set(drivername="postgresql", host="127.0.0.1", port=proxy.port, query={})
        yield proxy, url.render_as_string(hide_password=False)


def _in_thread(conn: psycopg.Connection[object], query: str) -> tuple[threading.Thread, list[object]]:
    outcome: list[object] = []

    def run() -> None:
        try:
            outcome.append(conn.execute(query).fetchall())
        except psycopg.Error as exc:
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def test_a_stalled_statement_fails_and_its_backend_is_terminated(proxied: tuple[TcpProxy, str]) -> None:
    proxy, url = proxied
    watchdog = Watchdog(url, after=1.0, interval=0.2)
    with psycopg.connect(url) as conn:
        conn.execute("SELECT 1")  # a transaction is open: the server side holds it
        pid = conn.info.backend_pid
        watchdog.watch(conn)
        watchdog.start()
        try:
            assert proxy.half_open() == 1
            thread, outcome = _in_thread(conn, "SELECT 2")
            thread.join(30)
            assert not thread.is_alive(), "the stalled statement was never freed"
        finally:
            watchdog.stop()
    assert len(outcome) == 1 and isinstance(outcome[0], psycopg.OperationalError)
    assert watchdog.freed == 1
    with psycopg.connect(url, autocommit=True) as other:
        assert other.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone() == (0,)


def test_a_long_statement_is_left_alone(proxied: tuple[TcpProxy, str]) -> None:
    proxy, url = proxied
    watchdog = Watchdog(url, after=0.3, interval=0.1)
    with psycopg.connect(url) as conn:
        watchdog.watch(conn)
        watchdog.start()
        try:
            thread, outcome = _in_thread(conn, "SELECT 7 FROM pg_sleep(2.5)")
            thread.join(30)
        finally:
            watchdog.stop()
    assert not thread.is_alive() and outcome == [[(7,)]]
    assert watchdog.freed == 0


def test_a_busy_connection_is_left_alone(proxied: tuple[TcpProxy, str]) -> None:
    """A connection that sends statement after statement, each read late (as
    a thread starved of the GIL does), looks "in progress" at every look while
    its backend is idle between statements: its backend's state keeps
    changing, so it is no stall."""
    _, url = proxied
    watchdog = Watchdog(url, after=0.5, interval=0.05)
    with psycopg.connect(url) as conn:
        pgconn = conn.pgconn
        assert pgconn.exec_(b"BEGIN").status == psycopg.pq.ExecStatus.COMMAND_OK
        watchdog.watch(conn)
        watchdog.start()
        try:
            deadline = time.monotonic() + 3.0
            while time.monotonic() < deadline:
                pgconn.send_query(b"SELECT 1")
                time.sleep(0.2)  # the reply arrived long ago; nobody reads it yet
                statuses = []
                while (result := pgconn.get_result()) is not None:
                    statuses.append(result.status)
                assert statuses == [psycopg.pq.ExecStatus.TUPLES_OK], "the connection was shut down"
        finally:
            watchdog.stop()
        pgconn.exec_(b"ROLLBACK")
    assert watchdog.freed == 0
