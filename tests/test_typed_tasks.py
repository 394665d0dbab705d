"""Tasks as typed objects (sa_jobqueue.task, .arguments, .configured): the
decorator returns the task, enqueue binds and checks the handler's own
arguments and stores them by name, the worker calls the handler with them
(and with the JobContext and the session it asks for), options go through
configure() and never clash with the handler's parameters, the job form of
older handlers still runs, and the types are checked by mypy and pyright."""

from __future__ import annotations

import shutil
import subprocess
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from jobapp import Ledger, TaskJob
from sqlalchemy import Engine, event, select
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker
from sqlalchemy.orm import Session

from sa_jobqueue import (
    ConfiguredTask,
    InvalidArgumentError,
    JobContext,
    JobRepository,
    RetryPolicy,
    Task,
    TaskRegistry,
    Worker,
)
from sa_jobqueue.aio import AsyncJobRepository, AsyncWorker

ROOT = Path(__file__).resolve().parent.parent
TYPED = Path(__file__).with_name("typecheck") / "typed_tasks.py"
jobs = JobRepository(TaskJob)
QUICK = RetryPolicy(base=timedelta(0), max_delay=timedelta(0), jitter=0)


def _rows(engine: Engine) -> list[TaskJob]:
    with Session(engine) as session:
        return list(session.scalars(select(TaskJob).order_by(TaskJob.id)))


def _notes(engine: Engine) -> dict[int, str | None]:
    with Session(engine) as session:
        return {row.job_id: row.note for row in session.scalars(select(Ledger))}


def _drain(engine: Engine, registry: TaskRegistry, **options: Any) -> None:
    Worker(engine, jobs, registry, listen=False, poll_interval=0.05, **options).run(until_empty=True)


def test_the_decorator_returns_the_task_still_callable_as_the_function() -> None:
    registry = TaskRegistry()

    @registry.task
    def add(x: int, y: int = 2) -> int:
        return x + y

    assert isinstance(add, Task)
    assert registry.get("add") is add
    assert add(1) == 3 and add(1, y=5) == 6
    assert add.parameters.form == "arguments" and not add.takes_session


def test_arguments_are_stored_by_name_and_given_back_as_python_values(engine: Engine) -> None:
    registry = TaskRegistry(repository=jobs)

    @registry.task
    def record(session: Session, ctx: JobContext, name: str, tags: list[str], count: int = 1) -> None:
        session.add(Ledger(job_id=ctx.id, note=f"{name}:{','.join(tags)}:{count}:{ctx.attempt}:{ctx.queue}"))

    with Session(engine) as session, session.begin():
        first = record.enqueue(session, "ada", ["a", "b"])
        second = record.enqueue(session, name="bob", tags=[], count=3)
    assert first.payload == {"name": "ada", "tags": ["a", "b"]}  # only what was given: defaults apply at run time
    assert second.payload == {"name": "bob", "tags": [], "count": 3}
    _drain(engine, registry)
    assert _notes(engine) == {first.id: "ada:a,b:1:1:default", second.id: "bob::3:1:default"}
    assert _rows(engine) == []


def test_a_bad_call_names_the_parameter_and_writes_nothing(engine: Engine) -> None:
    registry = TaskRegistry(repository=jobs)

    @registry.task
    def charge(order_id: int, *, note: str = "") -> None:
        pass

    statements: list[str] = []

    def seen(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        statements.append(statement)

    event.listen(engine, "before_cursor_execute", seen)
    try:
        with Session(engine) as session, session.begin():
            for call, parameter in [
                (lambda: charge.enqueue(session), "order_id"),
                (lambda: charge.enqueue(session, 1, 2), "args"),
                (lambda: charge.enqueue(session, 1, colour="red"), "colour"),
                (lambda: charge.enqueue(session, {1, 2}), "order_id"),
                (lambda: charge.enqueue(session, 1, note="\x00"), "note"),
                (lambda: charge.enqueue(session, float("nan")), "order_id"),
                (lambda: charge.configure(queue=""), "queue"),
                (lambda: charge.configure(priority=40_000), "priority"),
                (lambda: charge.configure(run_at=datetime(2030, 1, 1)), "run_at"),
                (lambda: charge.configure(dedupe_key=""), "dedupe_key"),
                (lambda: charge.configure(repository="jobs"), "repository"),
            ]:
                with pytest.raises(InvalidArgumentError) as raised:
                    call()
                assert raised.value.parameter == parameter, raised.value
    finally:
        event.remove(engine, "before_cursor_execute", seen)
    assert not [s for s in statements if "INSERT" in s]
    assert _rows(engine) == []


def test_options_go_through_configure_and_never_clash_with_the_handlers_parameters(engine: Engine) -> None:
    registry = TaskRegistry(repository=jobs)

    # Parameters named like the job's options are the handler's own.
    @registry.task(queue="billing", priority=3)
    def bill(queue: str, priority: int, session: str, delay: float) -> None:
        pass

    run_at = datetime.now(timezone.utc) + timedelta(hours=1)
    with Session(engine) as session, session.begin():
        plain = bill.enqueue(session, queue="q", priority=9, session="s", delay=1.5)
        configured = bill.configure(queue="urgent", max_attempts=2, dedupe_key="k1").configure(priority=-5)
        assert isinstance(configured, ConfiguredTask)
        special = configured.enqueue(session, "q", 1, "s", 0.0)
        again = configured.enqueue(session, "other", 2, "s", 0.0)  # the same live dedupe key: that job
        later = bill.configure(run_at=run_at).enqueue(session, "q", 1, "s", 0.0)
    assert (plain.queue, plain.priority, plain.payload) == (
        "billing", 3, {"queue": "q", "priority": 9, "session": "s", "delay": 1.5})
    assert (special.queue, special.priority, special.max_attempts, special.dedupe_key) == ("urgent", -5, 2, "k1")
    assert again.id == special.id
    assert later.run_at == run_at


def test_spec_feeds_enqueue_many(engine: Engine) -> None:
    registry = TaskRegistry(repository=jobs)

    @registry.task
    def write(session: Session, ctx: JobContext, note: str) -> None:
        session.add(Ledger(job_id=ctx.id, note=note))

    with Session(engine) as session, session.begin():
        made = jobs.enqueue_many(session, [write.spec(f"n{i}") for i in range(5)]
                                 + [write.configure(priority=-1).spec(note="first")])
    _drain(engine, registry)
    assert sorted(_notes(engine).values()) == ["first", "n0", "n1", "n2", "n3", "n4"]
    assert [j.priority for j in made] == [0, 0, 0, 0, 0, -1]


def test_each_kind_of_parameter_round_trips(engine: Engine) -> None:
    registry = TaskRegistry(repository=jobs)
    seen: list[tuple[Any, ...]] = []

    @registry.task
    def shapes(a: int, /, b: str, *rest: int, c: bool = False, **more: Any) -> None:
        seen.append((a, b, rest, c, more))

    with Session(engine) as session, session.begin():
        job = shapes.enqueue(session, 1, "two", 3, 4, c=True, d={"e": None})
    assert job.payload == {"a": 1, "b": "two", "rest": [3, 4], "c": True, "d": {"e": None}}
    _drain(engine, registry)
    assert seen == [(1, "two", (3, 4), True, {"d": {"e": None}})]


def test_the_wire_format_is_a_name_and_a_json_object(engine: Engine) -> None:
    """A job written by name (older code, the CLI, another language) runs a typed handler."""
    registry = TaskRegistry()

    @registry.task(retry=QUICK, max_attempts=1)
    def greet(session: Session, ctx: JobContext, name: str) -> None:
        session.add(Ledger(job_id=ctx.id, note=f"hello {name}"))

    with Session(engine) as session, session.begin():
        good = jobs.enqueue(session, "greet", {"name": "ada"})
        missing = jobs.enqueue(session, "greet", {})
        not_object = jobs.enqueue(session, "greet", ["ada"])
    _drain(engine, registry)
    assert _notes(engine) == {good.id: "hello ada"}
    dead = {row.id: row for row in _rows(engine)}
    assert dead[missing.id].status == "dead" and "name" in (dead[missing.id].last_error or "")
    assert dead[not_object.id].status == "dead" and "JSON object" in (dead[not_object.id].last_error or "")


def test_handlers_in_the_job_form_still_run(engine: Engine) -> None:
    registry = TaskRegistry(repository=jobs)

    @registry.task
    def old(job: TaskJob, session: Session) -> None:
        session.add(Ledger(job_id=job.id, note=str(job.payload["n"])))

    assert old.parameters.form == "job" and old.takes_session
    with Session(engine) as session, session.begin():
        job = jobs.enqueue(session, "old", {"n": 7})
        with pytest.raises(InvalidArgumentError) as raised:
            old.enqueue(session, {"n": 8})
    assert raised.value.parameter == "task"
    _drain(engine, registry)
    assert _notes(engine) == {job.id: "7"}


def test_a_task_without_a_job_table_says_how_to_give_one(engine: Engine) -> None:
    registry = TaskRegistry()

    @registry.task
    def lonely(n: int) -> None:
        pass

    with Session(engine) as session, session.begin():
        with pytest.raises(InvalidArgumentError) as raised:
            lonely.enqueue(session, 1)
        assert raised.value.parameter == "repository"
        job = lonely.configure(repository=jobs).enqueue(session, 1)
    assert job.task == "lonely"


def test_a_periodic_schedule_stacks_on_the_task() -> None:
    registry = TaskRegistry()

    @registry.periodic("*/5 * * * *", payload={"n": 1})
    @registry.task
    def tick(n: int) -> None:
        pass

    assert isinstance(tick, Task)
    assert [(p.task, p.payload) for p in registry.periodic_tasks] == [("tick", {"n": 1})]


@pytest.mark.parametrize("handler_form", ["context-first", "session-first"])
def test_the_session_asked_for_commits_once_with_the_completion(engine: Engine, handler_form: str) -> None:
    registry = TaskRegistry(repository=jobs)
    if handler_form == "context-first":
        @registry.task(name="write", retry=QUICK)
        def write(ctx: JobContext, session: Session, fail: bool) -> None:
            session.add(Ledger(job_id=ctx.id, note="written"))
            if fail and ctx.attempt == 1:
                raise RuntimeError("first attempt fails after writing")
    else:
        @registry.task(name="write", retry=QUICK)
        def write(session: Session, ctx: JobContext, fail: bool) -> None:  # type: ignore[misc]  # the other form
            session.add(Ledger(job_id=ctx.id, note="written"))
            if fail and ctx.attempt == 1:
                raise RuntimeError("first attempt fails after writing")

    with Session(engine) as session, session.begin():
        ok = write.enqueue(session, False)
        retried = write.enqueue(session, fail=True)
    _drain(engine, registry)
    assert _notes(engine) == {ok.id: "written", retried.id: "written"}  # a failed attempt's write rolled back
    assert _rows(engine) == []


# -- asyncio ---------------------------------------------------------------------

pytest_anyio = pytest.mark.anyio


@pytest_anyio
async def test_enqueue_async_and_the_async_worker(async_engine: AsyncEngine, engine: Engine) -> None:
    registry = TaskRegistry(repository=AsyncJobRepository(TaskJob))

    @registry.task
    async def note(ctx: JobContext, session: AsyncSession, text: str) -> None:
        session.add(Ledger(job_id=ctx.id, note=text))

    @registry.task
    def sync_note(session: Session, ctx: JobContext, text: str) -> None:
        session.add(Ledger(job_id=ctx.id, note=f"sync {text}"))

    sessions = async_sessionmaker(async_engine, expire_on_commit=False)
    async with sessions.begin() as session:
        first = await note.enqueue_async(session, "one")
        second = await note.configure(priority=-1).enqueue_async(session, text="two")
        third = await sync_note.enqueue_async(session, "three")
        with pytest.raises(InvalidArgumentError) as raised:
            await note.enqueue_async(session, "x", "y")  # type: ignore[call-arg]  # checked at run time too
        assert raised.value.parameter == "args"
    with Session(engine) as sync_session, pytest.raises(InvalidArgumentError) as refused:
        await note.enqueue_async(sync_session, "x")
    assert refused.value.parameter == "session"
    assert second.priority == -1
    await AsyncWorker(async_engine, AsyncJobRepository(TaskJob), registry, sync_bind=engine, listen=False,
                      poll_interval=0.05).run(until_empty=True)
    assert _notes(engine) == {first.id: "one", second.id: "two", third.id: "sync three"}


def test_an_async_handler_asking_for_a_sync_session_is_refused() -> None:
    registry = TaskRegistry()

    async def wrong(session: Session, n: int) -> None:
        pass

    def also_wrong(session: AsyncSession, n: int) -> None:
        pass

    for handler in (wrong, also_wrong):
        with pytest.raises(InvalidArgumentError) as raised:
            registry.register(handler.__name__, handler)
        assert raised.value.parameter == "handler"


# -- the types ---------------------------------------------------------------------


def _marked_lines() -> set[int]:
    return {n for n, line in enumerate(TYPED.read_text().splitlines(), 1) if line.rstrip().endswith("# error")}


def test_mypy_rejects_exactly_the_wrong_calls(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-incremental", "--cache-dir", str(tmp_path), str(TYPED)],
        capture_output=True, text=True, cwd=ROOT)
    reported = {int(line.split(":")[1]) for line in done.stdout.splitlines() if ": error:" in line}
    assert reported == _marked_lines(), done.stdout


def test_pyright_rejects_exactly_the_wrong_calls() -> None:
    pyright = shutil.which("pyright", path=str(Path(sys.executable).parent))
    if pyright is None or shutil.which("node") is None:
        pytest.skip("pyright (the test extra) and Node.js are needed to run pyright")
    done = subprocess.run([pyright, "--pythonpath", sys.executable, str(TYPED)], capture_output=True, text=True,
                          cwd=ROOT, timeout=600)
    reported = {int(line.split(":")[1]) for line in done.stdout.splitlines() if " - error:" in line}
    assert reported == _marked_lines(), done.stdout
