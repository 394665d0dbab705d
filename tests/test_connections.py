"""Connections made the way the application's engine makes them, and the
errors that get a worker-engine connection discarded (sa_jobqueue/connections.py)."""

from __future__ import annotations

import asyncio
import gc
import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
import pytest
from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.engine import URL
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.pool import QueuePool
from sqlalchemy.util import greenlet_spawn
from waiting import wait_for

from sa_jobqueue import InvalidArgumentError
from sa_jobqueue.connections import is_fatal_to_connection, own_session, raw_connect, worker_engine


@contextmanager
def _disposing(*engines: Engine) -> Iterator[None]:
    try:
        yield
    finally:
        for engine in engines:
            engine.dispose()


def _backend_exists(engine: Engine, pid: int) -> bool:
    with engine.connect() as conn:
        return bool(conn.execute(text("SELECT count(*) FROM pg_stat_activity WHERE pid = :pid"), {"pid": pid}).scalar())


def _application_name_of(engine: Engine, pid: int) -> str | None:
    with engine.connect() as conn:
        return conn.execute(
            text("SELECT application_name FROM pg_stat_activity WHERE pid = :pid"), {"pid": pid}
        ).scalar()


def _pid(conn: Any) -> int:
    return int(conn.execute(text("SELECT pg_backend_pid()")).scalar_one())


# -- connecting as the engine does ------------------------------------------------


def test_the_worker_engine_connects_with_the_apps_connect_args(db_url: URL, engine: Engine) -> None:
    app = create_engine(db_url, connect_args={"options": "-c application_name=sajq_probe"})
    own = worker_engine(app, pool_size=1, name="probe")
    with _disposing(own, app):
        with own.connect() as conn:
            assert conn.execute(text("SHOW application_name")).scalar() == "sajq_probe"
            pid = _pid(conn)
        # As the server sees it, from outside.
        assert _application_name_of(engine, pid) == "sajq_probe"
        assert raw_connect(app)().execute("SHOW application_name").fetchone() == ("sajq_probe",)


def test_the_apps_creator_makes_the_worker_connections(libpq_url: str, engine: Engine) -> None:
    made: list[psycopg.Connection[Any]] = []

    def creator() -> psycopg.Connection[Any]:
        conn = psycopg.connect(libpq_url, application_name="sajq_creator")
        made.append(conn)
        return conn

    app = create_engine("postgresql+psycopg://", creator=creator)
    own = worker_engine(app, pool_size=1, name="creator")
    with _disposing(own, app):
        with own.connect() as conn:
            assert conn.execute(text("SHOW application_name")).scalar() == "sajq_creator"
            dbapi_connection: Any = conn.connection.dbapi_connection
            assert dbapi_connection is made[-1]
            pid = _pid(conn)
        assert _application_name_of(engine, pid) == "sajq_creator"
        with raw_connect(app)() as raw:
            assert raw is made[-1]
            assert raw.execute("SHOW application_name").fetchone() == ("sajq_creator",)


def test_do_connect_and_pool_connect_events_of_the_app_apply(db_url: URL) -> None:
    app = create_engine(db_url)

    @event.listens_for(app, "do_connect")
    def token(dialect: Any, record: Any, cargs: Any, cparams: dict[str, Any]) -> None:
        cparams["application_name"] = "sajq_do_connect"  # as an IAM token hook sets the password

    @event.listens_for(app, "connect")
    def tag(dbapi_connection: Any, record: Any) -> None:
        with dbapi_connection.cursor() as cursor:
            cursor.execute("SELECT set_config('sajq.tag', 'from-connect-event', false)")
        dbapi_connection.commit()

    own = worker_engine(app, pool_size=1, name="events")
    with _disposing(own, app):
        with own.connect() as conn:
            assert conn.execute(text("SHOW application_name")).scalar() == "sajq_do_connect"
            assert conn.execute(text("SELECT current_setting('sajq.tag')")).scalar() == "from-connect-event"
        with raw_connect(app)() as raw:
            assert raw.execute("SELECT current_setting('application_name'), current_setting('sajq.tag')").fetchone() \
                == ("sajq_do_connect", "from-connect-event")


def test_the_worker_engine_has_the_apps_dialect_options_and_execution_options_in_autocommit(db_url: URL) -> None:
    app = create_engine(db_url, json_deserializer=lambda raw: {"decoded by": "the app", "value": json.loads(raw)})
    marked = app.execution_options(sajq_marker="from the app")
    own = worker_engine(marked, pool_size=1, name="options")
    with _disposing(own, app):
        assert own.dialect is app.dialect
        assert own.get_execution_options()["sajq_marker"] == "from the app"
        with own.connect() as conn:
            value = conn.execute(text("SELECT CAST(:doc AS json)"), {"doc": '{"a": 1}'}).scalar()
            assert value == {"decoded by": "the app", "value": {"a": 1}}
            # Autocommit: each statement is a transaction of its own.
            first = conn.execute(text("SELECT txid_current()")).scalar()
            assert conn.execute(text("SELECT txid_current()")).scalar() != first
        with app.connect() as conn:  # the app's engine is unchanged
            first = conn.execute(text("SELECT txid_current()")).scalar()
            assert conn.execute(text("SELECT txid_current()")).scalar() == first


def _pooled_in_autocommit(own: Engine) -> bool:
    """Use a connection of ``own`` and give it back; then whether the
    connection the pool holds is still in autocommit (checked out raw: no
    Connection is built, so nothing sets it on the way out)."""
    with own.connect() as conn:
        conn.execute(text("SELECT 1"))
    raw = own.raw_connection()
    try:
        return bool(raw.dbapi_connection.autocommit)  # type: ignore[union-attr]
    finally:
        raw.close()


@pytest.mark.parametrize("driver", ["psycopg", "psycopg-async", "asyncpg"])
def test_the_worker_engines_connections_are_put_in_autocommit_once_not_at_each_checkout(
    db_url: URL, driver: str
) -> None:
    """Set at each Connection and reset at each checkin, the autocommit cost
    every checkout two driver calls, and under asyncio an await inside
    ``Connection()`` where a cancelled task lost the connection unchecked-in."""
    if driver == "psycopg":
        app = create_engine(db_url, isolation_level="SERIALIZABLE")
        own = worker_engine(app, pool_size=1, name="autocommit")
        with _disposing(own, app):
            assert _pooled_in_autocommit(own)
            with own.connect() as conn:  # the app's isolation level does not reach the worker's
                first = conn.execute(text("SELECT txid_current()")).scalar()
                assert conn.execute(text("SELECT txid_current()")).scalar() != first
        return
    async_app = create_async_engine(db_url.set(drivername="postgresql+" + driver.removesuffix("-async")))
    own = worker_engine(async_app.sync_engine, pool_size=1, name="autocommit")

    async def check() -> bool:
        try:
            return await greenlet_spawn(_pooled_in_autocommit, own)
        finally:
            await greenlet_spawn(own.dispose)
            await async_app.dispose()

    assert asyncio.run(check())


# -- a pool of its own --------------------------------------------------------------


def test_an_exhausted_app_pool_never_blocks_the_worker_engine(db_url: URL) -> None:
    app = create_engine(db_url, pool_size=1, max_overflow=0, pool_timeout=0.5)
    own = worker_engine(app, pool_size=1, name="own-pool")
    with _disposing(own, app):
        assert own.pool is not app.pool and isinstance(app.pool, QueuePool)
        with app.connect() as held:  # every connection of the app's pool is checked out
            held.execute(text("SELECT 1"))
            for _ in range(3):  # new connections, not only a pooled one
                with own.connect() as conn:
                    assert conn.execute(text("SELECT 1")).scalar() == 1
                own.dispose()
            raw = raw_connect(app)()
            raw.close()
            assert app.pool.checkedout() == 1


def test_pool_events_of_the_worker_engine_stay_out_of_the_apps_pool(db_url: URL) -> None:
    app = create_engine(db_url)
    own = worker_engine(app, pool_size=1, name="own-events")
    seen: list[str] = []
    event.listen(own, "connect", lambda *args: seen.append("worker"))
    with _disposing(own, app):
        with app.connect() as conn:
            conn.execute(text("SELECT 1"))
        assert seen == []
        with own.connect() as conn:
            conn.execute(text("SELECT 1"))
        assert seen == ["worker"]


def test_disposing_the_worker_engine_leaves_the_apps_pool_alone(db_url: URL, engine: Engine) -> None:
    app = create_engine(db_url, pool_size=2)
    with _disposing(app):
        with app.connect() as conn:
            app_pid = _pid(conn)
        own = worker_engine(app, pool_size=1, name="dispose")
        with own.connect() as conn:
            own_pid = _pid(conn)
        own.dispose()
        wait_for(lambda: not _backend_exists(engine, own_pid), 30, "the worker connection's backend to exit")
        assert isinstance(app.pool, QueuePool) and app.pool.checkedin() == 1
        with app.connect() as conn:  # the app's pooled connection is still there, and works
            assert _pid(conn) == app_pid
        assert _backend_exists(engine, app_pid)


def test_raw_connect_hands_over_a_connection_no_pool_holds(db_url: URL) -> None:
    app = create_engine(db_url, pool_size=1, max_overflow=0, pool_timeout=0.5)
    with _disposing(app):
        connect = raw_connect(app)
        first, second = connect(), connect()  # more than the app's pool holds: it is not in play
        assert isinstance(app.pool, QueuePool) and app.pool.checkedout() == 0
        gc.collect()  # nothing closes them behind the caller's back
        for conn in (first, second):
            own_session(conn, "sajq_owned")
            assert conn.autocommit
            assert conn.execute("SHOW application_name").fetchone() == ("sajq_owned",)
            conn.close()


def test_raw_connect_needs_psycopg_3() -> None:
    with pytest.raises(InvalidArgumentError) as info:
        raw_connect(create_engine("sqlite://"))
    assert info.value.parameter == "engine"


def test_worker_engine_checks_its_arguments(engine: Engine) -> None:
    for kwargs, parameter in [
        ({"pool_size": 0, "name": "x"}, "pool_size"),
        ({"pool_size": True, "name": "x"}, "pool_size"),
        ({"pool_size": 1, "name": "x", "max_overflow": -1}, "max_overflow"),
        ({"pool_size": 1, "name": ""}, "name"),
    ]:
        with pytest.raises(InvalidArgumentError) as info:
            worker_engine(engine, **kwargs)  # type: ignore[arg-type]
        assert info.value.parameter == parameter


# -- errors that end a connection ---------------------------------------------------


def _raised(engine: Engine, *statements: str) -> DBAPIError:
    with pytest.raises(DBAPIError) as info, engine.connect() as conn:
        for statement in statements:
            conn.execute(text(statement))
    return info.value


def test_is_fatal_to_connection_on_real_errors(engine: Engine, libpq_url: str) -> None:
    read_only = _raised(engine, "SET TRANSACTION READ ONLY", "CREATE TABLE sajq_never (x int)")
    assert read_only.orig is not None and read_only.orig.sqlstate == "25006"  # type: ignore[attr-defined]
    assert is_fatal_to_connection(read_only)
    assert is_fatal_to_connection(read_only.orig)
    try:
        raise RuntimeError("while claiming") from read_only
    except RuntimeError as wrapped:
        assert is_fatal_to_connection(wrapped)

    # OperationalErrors of a healthy connection: a statement timeout...
    timeout = _raised(engine, "SET statement_timeout = 1", "SELECT pg_sleep(1)")
    assert isinstance(timeout.orig, psycopg.errors.QueryCanceled)
    assert isinstance(timeout.orig, psycopg.OperationalError)
    assert not is_fatal_to_connection(timeout)
    # ...and errors of the statement itself.
    assert not is_fatal_to_connection(_raised(engine, "SELECT 1 / 0"))
    assert not is_fatal_to_connection(ValueError("not a database error"))

    # The client's own: the connection is gone.
    conn = psycopg.connect(libpq_url)
    conn.close()
    with pytest.raises(psycopg.OperationalError) as closed:
        conn.execute("SELECT 1")
    assert closed.value.sqlstate is None
    assert is_fatal_to_connection(closed.value)


@pytest.mark.anyio
async def test_is_fatal_to_connection_on_real_asyncpg_errors(db_url: URL, engine: Engine) -> None:
    from sqlalchemy.ext.asyncio import create_async_engine

    made = create_async_engine(db_url.set(drivername="postgresql+asyncpg"))
    try:
        with pytest.raises(DBAPIError) as read_only:
            async with made.connect() as conn:
                await conn.execute(text("SET TRANSACTION READ ONLY"))
                await conn.execute(text("CREATE TABLE sajq_never (x int)"))
        assert getattr(read_only.value.orig, "sqlstate", None) == "25006"
        assert is_fatal_to_connection(read_only.value) and is_fatal_to_connection(read_only.value.orig)
        with pytest.raises(DBAPIError) as division:
            async with made.connect() as conn:
                await conn.execute(text("SELECT 1 / 0"))
        assert not is_fatal_to_connection(division.value)
        with pytest.raises(DBAPIError) as terminated:  # the server ended the session
            async with made.connect() as conn:
                pid = (await conn.execute(text("SELECT pg_backend_pid()"))).scalar_one()
                with engine.connect() as other:
                    other.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
                wait_for(lambda: _backend_gone(engine, pid), 30, "the backend to exit")
                await conn.execute(text("SELECT 1"))
        assert is_fatal_to_connection(terminated.value)
    finally:
        await made.dispose()


def _backend_gone(engine: Engine, pid: int) -> bool:
    with engine.connect() as conn:
        return conn.execute(text("SELECT count(*) FROM pg_stat_activity WHERE pid = :pid"), {"pid": pid}).scalar() == 0


def test_a_read_only_connection_is_discarded_and_the_next_use_gets_a_writable_one(
    create_database: Callable[[], URL], engine: Engine
) -> None:
    url = create_database()  # of its own: the setting below would hit every test of the shared one
    app = create_engine(url)
    own = worker_engine(app, pool_size=1, name="read-only")
    with _disposing(own, app):
        with app.begin() as conn:
            conn.execute(text("CREATE TABLE t (x int)"))
            conn.execute(text(f'ALTER DATABASE "{url.database}" SET default_transaction_read_only = on'))
        app.dispose()  # sessions started from now on are read-only, as on a standby after a failover

        with pytest.raises(DBAPIError) as failed, own.connect() as conn:
            first_pid = _pid(conn)
            conn.execute(text("INSERT INTO t VALUES (1)"))
        assert failed.value.orig is not None and failed.value.orig.sqlstate == "25006"  # type: ignore[attr-defined]
        assert failed.value.connection_invalidated

        # The application's engine keeps SQLAlchemy's own rules: the same
        # error does not invalidate its connection.
        with pytest.raises(DBAPIError) as app_failed, app.connect() as conn:
            conn.execute(text("INSERT INTO t VALUES (1)"))
        assert not app_failed.value.connection_invalidated

        with engine.begin() as admin:
            admin.execute(text(f'ALTER DATABASE "{url.database}" RESET default_transaction_read_only'))
        with own.connect() as conn:  # a new session, writable again
            assert _pid(conn) != first_pid
            conn.execute(text("INSERT INTO t VALUES (2)"))
        with app.connect() as conn:
            assert conn.execute(text("SELECT x FROM t")).scalars().all() == [2]


def test_a_terminated_backend_is_replaced_on_the_next_use(db_url: URL, engine: Engine) -> None:
    app = create_engine(db_url)
    own = worker_engine(app, pool_size=1, name="terminated")
    with _disposing(own, app):
        with own.connect() as conn:
            pid = _pid(conn)
        with engine.connect() as admin:
            assert admin.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid}).scalar()
        wait_for(lambda: not _backend_exists(engine, pid), 30, "the terminated backend to exit")

        with pytest.raises(DBAPIError) as failed, own.connect() as conn:
            conn.execute(text("SELECT 1"))  # the pooled connection: its server is gone
        assert failed.value.connection_invalidated
        assert is_fatal_to_connection(failed.value)
        with own.connect() as conn:
            assert _pid(conn) != pid
            assert conn.execute(text("SELECT 1")).scalar() == 1
