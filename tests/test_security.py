"""Security guarantees (docs/security.md): JSON-only payloads, values only as
bound parameters, no password in any text the library produces, and a
payload size limit. Every test runs on the real PostgreSQL of the suite.
"""

from __future__ import annotations

import ast
import logging
import threading
import time
import traceback
from collections.abc import Iterator
from datetime import datetime, timezone
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from jobapp import Base, TaskJob, User, jobs
from jobapp import tasks as app_tasks
from sqlalchemy import Engine, create_engine, func, select, text
from sqlalchemy.orm import Session, sessionmaker
from sqllog import recorded_sql

from sa_jobqueue import InvalidArgumentError, JobSpec, TaskRegistry, Worker, psycopg_url
from sa_jobqueue.spec import MAX_PAYLOAD_BYTES, to_row

PACKAGE = Path(__file__).resolve().parent.parent / "sa_jobqueue"


# --------------------------------------------------------------------------- payloads are JSON, only JSON

_reduced: list[str] = []


class _Exploit:
    """Pickling (or unpickling) this would call back; JSON never does."""

    def __reduce__(self) -> tuple[Any, ...]:
        _reduced.append("__reduce__")
        return (print, ("pwned",))

    def __getstate__(self) -> dict[str, Any]:
        _reduced.append("__getstate__")
        return {}


@pytest.mark.parametrize(
    "payload",
    [
        pytest.param(_Exploit(), id="object-with-reduce"),
        pytest.param({"job": _Exploit()}, id="nested-object"),
        pytest.param({1, 2, 3}, id="set"),
        pytest.param(frozenset({"a"}), id="frozenset"),
        pytest.param(b"\x80\x04\x95", id="bytes-pickle-header"),
        pytest.param(bytearray(b"x"), id="bytearray"),
        pytest.param(memoryview(b"x"), id="memoryview"),
        pytest.param(Decimal("0.1"), id="decimal"),
        pytest.param(datetime(2030, 1, 1, tzinfo=timezone.utc), id="datetime"),
        pytest.param(3 + 4j, id="complex"),
        pytest.param(print, id="function"),
        pytest.param(TaskJob, id="class"),
        pytest.param(Ellipsis, id="ellipsis"),
    ],
)
def test_payloads_that_are_not_json_are_refused(engine: Engine, payload: Any) -> None:
    with Session(engine) as session, recorded_sql(engine) as sent:
        with pytest.raises(InvalidArgumentError) as info:
            jobs.enqueue(session, "noop", payload)
    assert info.value.parameter == "payload"
    assert str(info.value).startswith("payload: ")
    assert sent == []
    assert _reduced == [], "the payload was pickled"
    with Session(engine) as session:
        assert session.scalar(select(func.count()).select_from(TaskJob)) == 0


def test_payloads_are_stored_as_jsonb_and_come_back_as_plain_json(sessions: sessionmaker[Session]) -> None:
    class Mapping(dict[str, Any]):
        pass

    pickled_looking = "gASVIAAAAAAAAACMCGJ1aWx0aW5zlIwFcHJpbnSUk5SMBXB3bmVklIWUUpQu"
    with sessions.begin() as session:
        data_type = session.scalar(text(
            "SELECT data_type FROM information_schema.columns "
            "WHERE table_name = 'task_jobs' AND column_name = 'payload'"
        ))
        assert data_type == "jsonb"
        job = jobs.enqueue(session, "noop", Mapping(pair=(1, 2), blob=pickled_looking, n=1.5, ok=True, none=None))
    with sessions() as session:
        stored = session.get(TaskJob, job.id)
        assert stored is not None
        assert stored.payload == {"pair": [1, 2], "blob": pickled_looking, "n": 1.5, "ok": True, "none": None}
        assert type(stored.payload) is dict and type(stored.payload["pair"]) is list


def test_the_package_never_unpickles_or_evaluates() -> None:
    """No module imports a deserializer that can run code, or calls eval/exec."""
    forbidden_modules = {"pickle", "cPickle", "dill", "marshal", "shelve", "yaml", "jsonpickle", "cloudpickle"}
    for path in sorted(PACKAGE.glob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                names = {(node.module or "").split(".")[0]}
            else:
                names = set()
            assert not names & forbidden_modules, f"{path.name} imports {names & forbidden_modules}"
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                assert node.func.id not in ("eval", "exec"), f"{path.name}:{node.lineno} calls {node.func.id}"


# --------------------------------------------------------------------------- values are bound, never spliced

EVIL = [
    "'); DROP TABLE task_jobs; --",
    "x'; DELETE FROM users WHERE ''='",
    "$$; DROP TABLE ledger; $$",
    "$q$ DROP TABLE users $q$",
    "\\'; DROP TABLE users; --\\",
    '"; DROP TABLE "users"; --',
    "%s %(task)s :task ? $1 {0} {}",
    "/* open comment -- \\x00 \\u0000 literally",
    "default'; LISTEN sa_jobqueue_task_jobs; NOTIFY sa_jobqueue_task_jobs, 'x",
    "Robert'); DROP TABLE Students;--  ünïcødé ✓ 🚀 ",
    "tab\there\nnewline\r\x7f\\\\",
]


def _tables(session: Session) -> set[str]:
    rows = session.execute(text("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")).scalars()
    return set(rows) & {t.name for t in Base.metadata.sorted_tables}


@pytest.mark.parametrize("evil", EVIL)
def test_sql_metacharacters_are_plain_values_in_every_string_field(
    engine: Engine, sessions: sessionmaker[Session], evil: str
) -> None:
    with sessions.begin() as session:
        session.add(User(id=1, name="ada"))
    payload = {evil: evil, "list": [evil], "nested": {evil: [evil, {"k": evil}]}}
    with recorded_sql(engine) as sent:
        with sessions.begin() as session:
            one = jobs.enqueue(session, evil, payload, queue=evil, dedupe_key=evil)
            [again, two] = jobs.enqueue_many(session, [
                JobSpec(evil, queue=evil, dedupe_key=evil),  # the same live key: the same job
                JobSpec(evil, {evil: 1}, queue=evil, dedupe_key=evil + "2"),
            ])
            assert again.id == one.id
        with sessions.begin() as session:
            claimed = jobs.claim(session, queues=[evil, "default"], worker=evil, limit=10)
            assert sorted(j.id for j in claimed) == sorted([one.id, two.id])
            for job in claimed:
                assert (job.task, job.queue, job.locked_by) == (evil, evil, evil)
            session.expunge_all()
        with sessions.begin() as session:
            for job in claimed:
                assert jobs.fail(session, job, evil, discard=True) == "dead"
        with sessions() as session:
            [stats] = jobs.stats(session)
            assert (stats.queue, stats.status, stats.count) == (evil, "dead", 2)
        with sessions.begin() as session:
            assert jobs.retry(session, one.id)
            assert jobs.cancel(session, one.id)
    for statement in sent:
        assert evil not in statement, f"a value reached the SQL text: {statement}"
    with sessions() as session:
        stored = session.get(TaskJob, one.id)
        assert stored is not None
        assert (stored.task, stored.queue, stored.dedupe_key, stored.status) == (evil, evil, evil, "cancelled")
        assert stored.payload == payload
        assert stored.last_error == evil
        assert _tables(session) == {t.name for t in Base.metadata.sorted_tables}
        assert session.scalar(select(func.count()).select_from(User)) == 1


@pytest.mark.parametrize("evil", [EVIL[0], EVIL[2], EVIL[6]])
def test_sql_metacharacters_through_a_worker(engine: Engine, sessions: sessionmaker[Session], evil: str) -> None:
    registry = TaskRegistry()
    seen: list[tuple[Any, ...]] = []

    def handler(job: TaskJob) -> None:
        seen.append((job.task, job.queue, job.locked_by, job.payload))
        raise RuntimeError(evil)

    registry.register(evil, handler, max_attempts=1)
    with sessions.begin() as session:
        job = jobs.enqueue(session, evil, {evil: evil}, queue=evil)
    result = Worker(engine, jobs, registry, queues=[evil], name=evil, concurrency=1, poll_interval=0.05).run(
        until_empty=True
    )
    assert result.dead == 1
    assert seen == [(evil, evil, evil, {evil: evil})]
    with sessions() as session:
        stored = session.get(TaskJob, job.id)
        assert stored is not None and stored.status == "dead"
        assert evil in (stored.last_error or "")
        assert _tables(session) == {t.name for t in Base.metadata.sorted_tables}


# --------------------------------------------------------------------------- passwords stay secret

SECRET = "s3cret"
SECRET_URL = f"postgresql://user:{SECRET}@127.0.0.1:1/x"  # nothing listens on port 1


def _exception_texts(exc: BaseException) -> list[str]:
    texts = ["".join(traceback.format_exception(exc))]
    seen: BaseException | None = exc
    while seen is not None:
        texts += [str(seen), repr(seen)]
        seen = seen.__cause__ or seen.__context__
    return texts


@pytest.fixture
def secret_engine() -> Iterator[Engine]:
    engine = create_engine(psycopg_url(SECRET_URL), connect_args={"connect_timeout": 5})
    yield engine
    engine.dispose()


def test_urls_and_reprs_hide_the_password(secret_engine: Engine) -> None:
    texts: list[str] = []
    for given in (SECRET_URL, SECRET_URL.replace("postgresql", "postgres", 1), psycopg_url(SECRET_URL)):
        url = psycopg_url(given)
        texts += [str(url), repr(url), url.render_as_string(), f"{url}"]
    worker = Worker(secret_engine, jobs, app_tasks, concurrency=1)
    texts += [repr(secret_engine), repr(jobs), repr(worker), str(worker), repr(vars(worker)), repr(app_tasks)]
    with pytest.raises(InvalidArgumentError) as info:
        Worker(SECRET_URL, jobs, app_tasks)  # type: ignore[arg-type]
    texts += _exception_texts(info.value)
    for text_ in texts:
        assert SECRET not in text_, text_


def test_connection_errors_and_logs_never_carry_the_password(
    secret_engine: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    texts: list[str] = []
    with pytest.raises(Exception) as info:
        with Session(secret_engine) as session, session.begin():
            jobs.enqueue(session, "noop")
    texts += _exception_texts(info.value)

    # A worker that cannot connect logs its failed claims and reaps...
    Worker(secret_engine, jobs, app_tasks, concurrency=1, poll_interval=0.05).run(until_empty=True)
    # ...and its listener logs its failed connections.
    worker = Worker(secret_engine, jobs, app_tasks, concurrency=1, poll_interval=0.05)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not any(r.name == "sa_jobqueue.listener" for r in caplog.records):
        time.sleep(0.05)
    worker.stop()
    thread.join(30)
    assert not thread.is_alive()

    names = {record.name for record in caplog.records}
    assert {"sa_jobqueue.worker", "sa_jobqueue.listener"} <= names, names
    formatter = logging.Formatter("%(name)s %(levelname)s %(message)s")
    texts += [formatter.format(record) for record in caplog.records]
    texts += [repr(record.args) for record in caplog.records]
    for text_ in texts:
        assert SECRET not in text_, text_


# --------------------------------------------------------------------------- the payload size limit


def test_the_payload_limit_counts_utf8_bytes_of_compact_json(engine: Engine, sessions: sessionmaker[Session]) -> None:
    ascii_at = "x" * (MAX_PAYLOAD_BYTES - 2)  # plus its two quotes: exactly the limit
    euro_at = "€" * ((MAX_PAYLOAD_BYTES - 2) // 3)  # three bytes each
    with sessions.begin() as session:
        kept = jobs.enqueue_many(session, [JobSpec("noop", ascii_at), JobSpec("noop", euro_at)])
    for over in (ascii_at + "x", euro_at + "€", {"a": ascii_at}):
        with Session(engine) as session, recorded_sql(engine) as sent:
            with pytest.raises(InvalidArgumentError) as info:
                jobs.enqueue_many(session, [JobSpec("noop", {"small": 1}), JobSpec("noop", over)])
            assert sent == []
        assert info.value.parameter == "payload"
        assert f"limit of {MAX_PAYLOAD_BYTES}" in str(info.value)
        assert len(str(info.value)) < 300  # the message does not echo the payload
    with sessions.begin() as session:
        claimed = jobs.claim(session, limit=10)
        assert sorted(j.id for j in claimed) == sorted(j.id for j in kept)
        assert {j.payload for j in claimed} == {ascii_at, euro_at}


def test_the_payload_limit_can_be_lowered_per_call() -> None:
    spec = JobSpec("noop", {"blob": "x" * 100})
    assert to_row(spec, frozenset())["payload"] == {"blob": "x" * 100}
    with pytest.raises(InvalidArgumentError, match="payload: is 111 bytes as JSON, more than the limit of 50"):
        to_row(spec, frozenset(), max_payload_bytes=50)
