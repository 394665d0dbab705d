"""Bad input, all of it: every public entry point against hostile or wrong values.

Each table row calls one entry point with one bad value and expects a typed
error (:class:`InvalidArgumentError`, or :class:`JobTableError` for models)
whose message starts with the parameter's name, raised before any statement
is sent (``recorded_sql`` stays empty), with every table of the database
exactly as it was (a snapshot of all rows before and after).
"""

from __future__ import annotations

import math
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import date, datetime, timedelta, timezone, tzinfo
from decimal import Decimal
from typing import Any, NoReturn

import pytest
from alembic.operations import Operations
from alembic.runtime.migration import MigrationContext
from jobapp import Base, EmailJob, ReportJob, TaskJob, User, emails, jobs, reports
from jobapp import tasks as app_tasks
from sqlalchemy import Engine, String, create_engine, select, text
from sqlalchemy.engine import URL, Connection
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker
from sqllog import recorded_sql

from sa_jobqueue import (
    Dedupe,
    InvalidArgumentError,
    JobMixin,
    JobQueueError,
    JobRepository,
    JobSpec,
    JobTableError,
    RetryPolicy,
    Task,
    TaskRegistry,
    Worker,
)
from sa_jobqueue.migrations import rename_job_table, reset_queue_storage, set_queue_storage
from sa_jobqueue.results import read_result, wait_for_result
from sa_jobqueue.spec import MAX_ERROR_LENGTH, MAX_PAYLOAD_BYTES, SCHEDULE_HORIZON, clean_error

UTC = timezone.utc
FUTURE = datetime(2030, 1, 1, tzinfo=UTC)
LEASE = timedelta(seconds=60)


# --------------------------------------------------------------------------- the harness


def snapshot(engine: Engine) -> dict[str, list[tuple[Any, ...]]]:
    """Every row of every table of the test schema, in primary key order."""
    with engine.connect() as conn:
        return {
            table.name: [tuple(row) for row in conn.execute(select(table).order_by(*table.primary_key.columns))]
            for table in Base.metadata.sorted_tables
        }


def _fail_briefly(exc: BaseException) -> NoReturn:
    """Fail with one line naming the exception and where it was raised.

    A full traceback through SQLAlchemy costs pytest half a second per row to render.
    """
    where = traceback.extract_tb(exc.__traceback__)[-1]
    pytest.fail(
        f"{type(exc).__name__} at {where.filename}:{where.lineno}: {str(exc)[:300]}", pytrace=False
    )


def refused(
    engine: Engine, call: Callable[[Session], object], parameter: str, error: type[JobQueueError] = InvalidArgumentError
) -> JobQueueError:
    """Run ``call`` on a fresh session; it must raise ``error`` naming ``parameter``,
    send nothing, and leave every table as it was."""
    before = snapshot(engine)
    with Session(engine, expire_on_commit=False) as session:
        with recorded_sql(engine) as sent:
            try:
                call(session)
            except error as exc:
                err: JobQueueError = exc
            except Exception as exc:
                _fail_briefly(exc)
            else:
                pytest.fail(f"no {error.__name__} raised", pytrace=False)
        assert sent == [], f"statements sent before the refusal: {sent}"
        session.rollback()
    assert snapshot(engine) == before
    assert str(err).startswith(f"{parameter}:"), str(err)
    if isinstance(err, InvalidArgumentError):
        assert err.parameter == parameter
        assert len(str(err)) < 1000, "an error message must not carry a huge value"
    return err


@dataclass
class World:
    """Jobs in every state the verbs care about, committed once for the module."""

    claimed: TaskJob
    pending: TaskJob
    dead_id: int
    email_claimed: EmailJob


def _truncate(engine: Engine) -> None:
    with engine.begin() as conn:
        conn.execute(text(f"TRUNCATE {', '.join(t.name for t in Base.metadata.sorted_tables)}"))


def _seed(engine: Engine) -> World:
    _truncate(engine)
    sessions = sessionmaker(engine, expire_on_commit=False)
    with sessions.begin() as session:
        jobs.enqueue(session, "noop", {"n": 1}, queue="seed-claim")
        pending = jobs.enqueue(session, "noop", {"n": 2}, queue="seed-pending", dedupe_key="seed")
        jobs.enqueue(session, "noop", {"n": 3}, queue="seed-dead")
        emails.enqueue(session, "noop", {"n": 4}, extra={"tenant_id": 7})
        reports.enqueue(session, "noop", {"n": 5})
        session.add(User(id=1, name="ada"))
    with sessions.begin() as session:
        [claimed] = jobs.claim(session, queues="seed-claim", worker="seed", lease=timedelta(hours=1))
        [to_kill] = jobs.claim(session, queues="seed-dead", worker="seed", lease=LEASE)
        jobs.fail(session, to_kill, "seeded", discard=True)
        [email_claimed] = emails.claim(session, worker="seed", lease=timedelta(hours=1))
        session.expunge_all()
    return World(claimed=claimed, pending=pending, dead_id=to_kill.id, email_claimed=email_claimed)


@pytest.fixture(scope="module")
def db(db_url: URL) -> Iterator[Engine]:
    """The shared test database under a name conftest does not truncate after
    each test: the refusal tests change nothing, so one seeding serves them all."""
    engine = create_engine(db_url, pool_size=2)
    yield engine
    _truncate(engine)
    engine.dispose()


@pytest.fixture(scope="module")
def _seeded() -> dict[str, Any]:
    return {}


@pytest.fixture
def world(db: Engine, _seeded: dict[str, Any]) -> World:
    """The seeded jobs; seeded again when a test that writes (and so
    truncates afterwards) has run since."""
    current = snapshot(db)
    if _seeded.get("snapshot") != current or not current["task_jobs"]:
        _seeded["world"] = _seed(db)
        _seeded["snapshot"] = snapshot(db)
    world: World = _seeded["world"]
    return world


# --------------------------------------------------------------------------- hostile values

NUL = "a\x00b"
SURROGATE = "caf\udce9"  # b"caf\xe9" (Latin-1, not UTF-8) decoded with surrogateescape
HIGH_SURROGATE = "\ud83d"  # half of an emoji's UTF-16 pair


def _nested(depth: int) -> list[Any]:
    value: list[Any] = []
    for _ in range(depth):
        value = [value]
    return value


_circular: list[Any] = []
_circular.append(_circular)


class _Opaque:
    pass


class _Pickler:
    """What a pickle exploit looks like: unpickling would run a shell command."""

    def __reduce__(self) -> tuple[Any, ...]:
        import os

        return (os.system, ("echo pwned",))


class _BadOffset(tzinfo):
    def utcoffset(self, dt: datetime | None) -> timedelta:
        return timedelta(hours=25)  # Python refuses offsets of a day or more


def _enqueue_row(kwargs: dict[str, Any], parameter: str, *marks: pytest.MarkDecorator, id: str) -> Any:
    return pytest.param(kwargs, parameter, marks=marks, id=id)


ENQUEUE = [
    # task, queue, dedupe_key: wrong types, empty, too long, NUL, surrogates
    *(
        _enqueue_row({name: value}, name, id=f"{name}-{label}")
        for name in ("task", "queue")
        for label, value in [
            ("int", 5), ("none", None), ("bytes", b"noop"), ("empty", ""), ("blank", " \t"),
            ("nul", NUL), ("surrogate", SURROGATE), ("high-surrogate", HIGH_SURROGATE), ("long", "t" * 129),
            ("nan", math.nan),
        ]
    ),
    *(
        _enqueue_row({"dedupe_key": value}, "dedupe_key", id=f"dedupe_key-{label}")
        for label, value in [
            ("int", 5), ("bytes", b"k"), ("empty", ""), ("nul", "k\x00"), ("surrogate", SURROGATE),
            ("long", "k" * 256),
            ("dedupe-empty", Dedupe("")), ("dedupe-int-key", Dedupe(5)),  # type: ignore[arg-type]
        ]
    ),
    # a Dedupe's options: only the documented words
    _enqueue_row({"dedupe_key": Dedupe("k", on_conflict="update")},  # type: ignore[arg-type]
                 "dedupe_key.on_conflict", id="dedupe-on_conflict"),
    _enqueue_row({"dedupe_key": Dedupe("k", until="running")},  # type: ignore[arg-type]
                 "dedupe_key.until", id="dedupe-until"),
    *(
        _enqueue_row({"dedupe_key": dedupe}, "dedupe_key.window", id=f"dedupe-window-{label}")
        for label, dedupe in [
            ("zero", Dedupe("k", window=timedelta(0))), ("seconds", Dedupe("k", window=60)),  # type: ignore[arg-type]
            ("negative", Dedupe("k", window=timedelta(hours=-1))),
            ("until-started", Dedupe("k", until="started", window=timedelta(hours=1))),
            # task_jobs deletes finished jobs: a window there cannot be kept
            ("table-keeps-no-finished-jobs", Dedupe("k", window=timedelta(hours=1))),
        ]
    ),
    # payload: not JSON, NaN and infinity, NUL and surrogates in keys and values, size
    *(
        _enqueue_row({"payload": value}, "payload", id=f"payload-{label}")
        for label, value in [
            ("object", _Opaque()), ("set", {1, 2}), ("frozenset", frozenset()), ("bytes", b"\x80abc"),
            ("bytearray", bytearray(b"x")), ("decimal", Decimal("1.5")), ("datetime", FUTURE),
            ("complex", 1j), ("function", len), ("pickle-exploit", {"x": _Pickler()}),
            ("nan", {"x": math.nan}), ("inf", [math.inf]), ("-inf", -math.inf),
            ("nul-value", {"a": NUL}), ("nul-key", {NUL: 1}), ("nul-deep", {"a": [{"b": ["ok", NUL]}]}),
            ("surrogate-value", {"a": SURROGATE}), ("surrogate-key", {SURROGATE: 1}),
            ("high-surrogate", [HIGH_SURROGATE]), ("int-key", {1: "one"}), ("none-key", {None: 1}),
            ("tuple-key", {(1, 2): 1}), ("circular", _circular), ("too-deep", _nested(100_000)),
            ("huge-int", 10**5000), ("too-big", {"blob": "x" * MAX_PAYLOAD_BYTES}),
            ("too-big-multibyte", "€" * (MAX_PAYLOAD_BYTES // 3)),
        ]
    ),
    # meta: a JSON object or None, checked as the payload is
    *(
        _enqueue_row({"meta": value}, "meta", id=f"meta-{label}")
        for label, value in [
            ("list", [1]), ("str", "trace"), ("int", 5), ("bytes", b"{}"), ("object", _Opaque()),
            ("set-value", {"a": {1}}), ("nan", {"x": math.nan}), ("nul-value", {"a": NUL}),
            ("surrogate-key", {SURROGATE: 1}), ("int-key", {1: "one"}),
            ("too-big", {"blob": "x" * (64 * 1024)}),
        ]
    ),
    # priority and max_attempts: wrong types, NaN, out of the column's range
    *(
        _enqueue_row({"priority": value}, "priority", id=f"priority-{label}")
        for label, value in [
            ("nan", math.nan), ("inf", math.inf), ("float", 1.5), ("str", "1"), ("bool", True), ("none", None),
            ("above-smallint", 2**15), ("below-smallint", -(2**15) - 1), ("huge", 10**30),
        ]
    ),
    *(
        _enqueue_row({"max_attempts": value}, "max_attempts", id=f"max_attempts-{label}")
        for label, value in [
            # None is no limit of the job's own (its task's applies): tests/test_max_attempts.py.
            ("zero", 0), ("negative", -3), ("above-int", 2**31), ("nan", math.nan), ("str", "3"),
            ("bool", True), ("float", 3.0),
        ]
    ),
    # run_at: naive, far future, far past, wrong types
    *(
        _enqueue_row({"run_at": value}, "run_at", id=f"run_at-{label}")
        for label, value in [
            ("naive", datetime(2030, 1, 1)), ("naive-max", datetime.max),
            ("max-utc", datetime.max.replace(tzinfo=UTC)),
            ("max-west", datetime.max.replace(tzinfo=timezone(timedelta(hours=-5)))),
            ("year-9999", datetime(9999, 1, 1, tzinfo=UTC)),
            ("min-east", datetime.min.replace(tzinfo=timezone(timedelta(hours=5)))),
            ("year-1", datetime(1, 1, 1, tzinfo=UTC)), ("bad-offset", datetime(2030, 1, 1, tzinfo=_BadOffset())),
            ("str", "2030-01-01T00:00:00Z"), ("date", date(2030, 1, 1)), ("epoch-number", 1_900_000_000),
        ]
    ),
    _enqueue_row({"run_at": FUTURE, "delay": 5}, "run_at", id="run_at-and-delay"),
    # delay: negative, NaN, infinity, overflowing, wrong types
    *(
        _enqueue_row({"delay": value}, "delay", id=f"delay-{label}")
        for label, value in [
            ("negative", -5), ("negative-timedelta", timedelta(seconds=-1)), ("nan", math.nan),
            ("inf", math.inf), ("-inf", -math.inf), ("1e300", 1e300), ("huge-int", 10**400),
            ("timedelta-max", timedelta.max), ("200-years", timedelta(days=365 * 200)),
            ("str", "5"), ("bool", True), ("list", [5]),
        ]
    ),
    # extra: unknown or job columns, wrong types
    *(
        _enqueue_row({"extra": value}, "extra", id=f"extra-{label}")
        for label, value in [
            ("unknown", {"no_such_column": 1}), ("job-column", {"status": "done"}), ("id", {"id": 1}),
            ("lock-token", {"lock_token": None}), ("list", ["x"]), ("int-key", {1: "x"}),
        ]
    ),
]


@pytest.mark.parametrize(("kwargs", "parameter"), ENQUEUE)
def test_enqueue_refuses(db: Engine, world: World, kwargs: dict[str, Any], parameter: str) -> None:
    args = {"task": "noop", "payload": {"ok": True}} | kwargs
    refused(db, lambda s: jobs.enqueue(s, args["task"], args["payload"], **{
        k: v for k, v in args.items() if k not in ("task", "payload")
    }), parameter)
    # In bulk: the good spec before the bad one is not sent either.
    refused(db, lambda s: jobs.enqueue_many(s, [JobSpec("noop"), JobSpec(**args)]), parameter)
    refused(db, lambda s: jobs.enqueue_many_report(s, [JobSpec("noop"), JobSpec(**args)]), parameter)


@pytest.mark.parametrize(
    ("value", "parameter"),
    [
        pytest.param({"tenant_id": NUL}, "extra", id="nul"),
        pytest.param({"tenant_id": SURROGATE}, "extra", id="surrogate"),
        pytest.param({"tenant_id": 1, "no_such": 2}, "extra", id="unknown"),
    ],
)
def test_enqueue_refuses_bad_extra_values(db: Engine, world: World, value: dict[str, Any], parameter: str) -> None:
    refused(db, lambda s: emails.enqueue(s, "noop", extra=value), parameter)




@pytest.mark.parametrize(
    ("call", "parameter"),
    [
        pytest.param(lambda s: jobs.enqueue_many(s, [None]), "jobs", id="item-none"),
        pytest.param(lambda s: jobs.enqueue_many(s, ["noop"]), "jobs", id="item-str"),
        pytest.param(lambda s: jobs.enqueue_many(s, [{"task": "noop"}]), "jobs", id="item-dict"),
        pytest.param(lambda s: jobs.enqueue_many(s, "noop"), "jobs", id="a-string"),
        pytest.param(lambda s: jobs.enqueue_many(s, None), "jobs", id="none"),
        pytest.param(lambda s: jobs.enqueue_many(s, 5), "jobs", id="int"),
        pytest.param(lambda s: jobs.enqueue_many(s, JobSpec("noop")), "jobs", id="one-spec"),
        pytest.param(lambda s: jobs.enqueue(None, "noop"), "session", id="enqueue-no-session"),
        pytest.param(lambda s: jobs.enqueue(s.get_bind(), "noop"), "session", id="enqueue-engine"),
        pytest.param(lambda s: jobs.stats(None), "session", id="stats-no-session"),
        pytest.param(lambda s: jobs.stats(s.get_bind()), "session", id="stats-engine"),
        pytest.param(lambda s: jobs.claim(None), "session", id="claim-no-session"),
    ],
)
def test_enqueue_many_and_sessions_refuse(
    db: Engine, world: World, call: Callable[[Session], object], parameter: str
) -> None:
    refused(db, call, parameter)


# --------------------------------------------------------------------------- claim and the fenced verbs


CLAIM = [
    *(
        pytest.param({"limit": value}, "limit", id=f"limit-{label}")
        for label, value in [
            ("zero", 0), ("negative", -1), ("float", 1.5), ("nan", math.nan), ("str", "1"), ("bool", True),
            ("none", None), ("above-int", 2**31), ("huge", 10**30),
        ]
    ),
    pytest.param({"queues": []}, "queues", id="queues-empty"),
    pytest.param({"queues": [""]}, "queues", id="queues-blank"),
    pytest.param({"queues": [5]}, "queues", id="queues-int-item"),
    pytest.param({"queues": ["q" * 129]}, "queues", id="queues-long"),
    pytest.param({"queues": [NUL]}, "queues", id="queues-nul"),
    pytest.param({"queues": SURROGATE}, "queues", id="queues-surrogate"),
    pytest.param({"queues": None}, "queues", id="queues-none"),
    pytest.param({"queues": 5}, "queues", id="queues-int"),
    pytest.param({"lease": timedelta(0)}, "lease", id="lease-zero"),
    pytest.param({"lease": timedelta(seconds=-1)}, "lease", id="lease-negative"),
    pytest.param({"lease": 60}, "lease", id="lease-number"),
    pytest.param({"lease": None}, "lease", id="lease-none"),
    pytest.param({"lease": timedelta.max}, "lease", id="lease-max"),
    pytest.param({"worker": ""}, "worker", id="worker-empty"),
    pytest.param({"worker": NUL}, "worker", id="worker-nul"),
    pytest.param({"worker": SURROGATE}, "worker", id="worker-surrogate"),
    pytest.param({"worker": 5}, "worker", id="worker-int"),
    pytest.param({"worker": "w" * 256}, "worker", id="worker-long"),
]


@pytest.mark.parametrize(("kwargs", "parameter"), CLAIM)
def test_claim_refuses(db: Engine, world: World, kwargs: dict[str, Any], parameter: str) -> None:
    refused(db, lambda s: jobs.claim(s, queues=kwargs.pop("queues", "seed-pending"), **kwargs), parameter)



Verb = Callable[[Session, World], object]


def _bad_jobs(
    verb: str, call: Callable[[Session, Any], object], parameter: str
) -> list[Any]:
    """One row per bad job; ``verb`` names the row (the sequence verbs get it in a list)."""
    return [
        pytest.param(lambda s, w, v=value: call(s, v(w)), parameter, id=f"{verb}-{label}")
        for label, value in [
            ("none", lambda w: None), ("int", lambda w: 5), ("str", lambda w: "job"),
            ("other-model", lambda w: w.email_claimed), ("not-claimed", lambda w: w.pending),
        ]
    ]


VERBS = [
    # complete, complete_many, fail, heartbeat: the jobs must be claimed jobs of this model
    *_bad_jobs("complete", lambda s, j: jobs.complete(s, j), "job"),
    *_bad_jobs("fail", lambda s, j: jobs.fail(s, j, "boom"), "job"),
    *_bad_jobs("complete_many-item", lambda s, j: jobs.complete_many(s, [j]), "jobs"),
    *_bad_jobs("heartbeat-item", lambda s, j: jobs.heartbeat(s, [j]), "jobs"),
    pytest.param(lambda s, w: jobs.complete_many(s, None), "jobs", id="complete_many-none"),
    pytest.param(lambda s, w: jobs.complete_many(s, 5), "jobs", id="complete_many-int"),
    pytest.param(lambda s, w: jobs.complete_many(s, "abc"), "jobs", id="complete_many-str"),
    pytest.param(lambda s, w: jobs.heartbeat(s, None), "jobs", id="heartbeat-none"),
    pytest.param(lambda s, w: jobs.heartbeat(s, w.claimed), "jobs", id="heartbeat-one-job"),
    # fail's options
    *(
        pytest.param(lambda s, w, k=kwargs: jobs.fail(s, w.claimed, "boom", **k), parameter, marks=marks, id=label)
        for label, kwargs, parameter, marks in [
            ("fail-delay-nan", {"delay": math.nan}, "delay", ()),
            ("fail-delay-negative", {"delay": timedelta(seconds=-1)}, "delay", ()),
            ("fail-delay-max", {"delay": timedelta.max}, "delay", ()),
            ("fail-delay-1e300", {"delay": 1e300}, "delay", ()),
            ("fail-delay-str", {"delay": "5"}, "delay", ()),
            ("fail-at-naive", {"at": datetime(2030, 1, 1)}, "at", ()),
            ("fail-at-max", {"at": datetime.max.replace(tzinfo=UTC)}, "at", ()),
            ("fail-at-year-9999", {"at": datetime(9999, 12, 31, tzinfo=UTC)}, "at", ()),
            ("fail-at-str", {"at": "2030-01-01"}, "at", ()),
            ("fail-max_attempts-zero", {"max_attempts": 0}, "max_attempts", ()),
            ("fail-max_attempts-above-int", {"max_attempts": 2**31}, "max_attempts", ()),
            ("fail-max_attempts-str", {"max_attempts": "3"}, "max_attempts", ()),
            ("fail-max_attempts-nan", {"max_attempts": math.nan}, "max_attempts", ()),
            ("fail-policy-str", {"policy": "fast"}, "policy", ()),
            ("fail-policy-none", {"policy": None}, "policy", ()),
            ("fail-discard-str", {"discard": "yes"}, "discard", ()),
            ("fail-discard-none", {"discard": None}, "discard", ()),
        ]
    ),
    # heartbeat's lease
    *(
        pytest.param(lambda s, w, v=value: jobs.heartbeat(s, [w.claimed], lease=v), "lease",
                     id=f"heartbeat-lease-{label}")
        for label, value in [
            ("zero", timedelta(0)), ("negative", timedelta(seconds=-5)), ("max", timedelta.max), ("number", 60),
        ]
    ),
    # reap
    *(
        pytest.param(lambda s, w, v=value: jobs.reap(s, limit=v), "limit", id=f"reap-limit-{label}")
        for label, value in [("zero", 0), ("negative", -1), ("nan", math.nan), ("above-int", 2**31), ("str", "1")]
    ),
    *(
        pytest.param(lambda s, w, v=value: jobs.reap(s, task_max_attempts=v), parameter, marks=marks,
                     id=f"reap-task_max_attempts-{label}")
        for label, value, parameter, marks in [
            ("zero", {"noop": 0}, "task_max_attempts['noop']", ()),
            ("above-int", {"noop": 2**31}, "task_max_attempts['noop']", ()),
            ("str-value", {"noop": "3"}, "task_max_attempts['noop']", ()),
            ("bool-value", {"noop": True}, "task_max_attempts['noop']", ()),
            ("nul-key", {NUL: 1}, "task_max_attempts", ()),
            ("int-key", {5: 1}, "task_max_attempts", ()),
            ("str", "noop", "task_max_attempts", ()),
            ("pairs", [("noop", 1)], "task_max_attempts", ()),
        ]
    ),
    # cancel and retry: ids
    *(
        pytest.param(lambda s, w, v=value, verb=verb: getattr(jobs, verb)(s, v), "job_id",
                     id=f"{verb}-{label}")
        for verb in ("cancel", "retry")
        for label, value in [
            ("none", None), ("str", "1"), ("float", 1.5), ("bool", True), ("above-bigint", 2**63), ("list", [1]),
        ]
    ),
    # purge
    *(
        pytest.param(lambda s, w, k=kwargs: reports.purge(s, **k), parameter, marks=marks, id=f"purge-{label}")
        for label, kwargs, parameter, marks in [
            ("pending", {"statuses": ["pending"]}, "statuses", ()),
            ("running", {"statuses": ["running", "dead"]}, "statuses", ()),
            ("unknown-status", {"statuses": ["nope"]}, "statuses", ()),
            ("int-status", {"statuses": [5]}, "statuses", ()),
            ("statuses-none", {"statuses": None}, "statuses", ()),
            ("statuses-empty", {"statuses": []}, "statuses", ()),
            ("limit-zero", {"limit": 0}, "limit", ()),
            ("limit-negative", {"limit": -1}, "limit", ()),
            ("limit-above-int", {"limit": 2**31}, "limit", ()),
            ("limit-str", {"limit": "10"}, "limit", ()),
            ("older_than-negative", {"older_than": timedelta(days=-1)}, "older_than", ()),
            ("older_than-number", {"older_than": 3600}, "older_than", ()),
            ("older_than-max", {"older_than": timedelta.max}, "older_than", ()),
            ("older_than-none", {"older_than": None}, "older_than", ()),
        ]
    ),
]


@pytest.mark.parametrize(("call", "parameter"), VERBS)
def test_verbs_refuse(db: Engine, world: World, call: Verb, parameter: str) -> None:
    refused(db, lambda s: call(s, world), parameter)


# --------------------------------------------------------------------------- models and tables


class OtherBase(DeclarativeBase):
    pass


class Plain(OtherBase):
    __tablename__ = "plain_rows"
    id: Mapped[int] = mapped_column(primary_key=True)


class LostIndexes(JobMixin, OtherBase):
    __tablename__ = "lost_indexes_jobs"
    __table_args__ = ()  # replaces JobMixin's: no claim, lease or dedupe index
    note: Mapped[str | None] = mapped_column(String(10))


class Unmapped(JobMixin):
    pass


@pytest.mark.parametrize(
    "model",
    [
        pytest.param(None, id="none"), pytest.param("task_jobs", id="table-name"), pytest.param(object, id="object"),
        pytest.param(User, id="mapped-not-job"), pytest.param(Plain, id="other-base"),
        pytest.param(TaskJob(), id="instance"), pytest.param(Unmapped, id="unmapped-mixin"),
        pytest.param(LostIndexes, id="lost-indexes"), pytest.param(TaskJob.__table__, id="table-object"),
    ],
)
def test_repository_refuses_models_that_are_not_job_tables(db: Engine, world: World, model: Any) -> None:
    refused(db, lambda s: JobRepository(model), "model", JobTableError)


# --------------------------------------------------------------------------- Worker options


WORKER_OPTIONS = [
    *(
        pytest.param({"concurrency": value}, "concurrency", id=f"concurrency-{label}")
        for label, value in [
            ("zero", 0), ("negative", -1), ("float", 1.5), ("nan", math.nan), ("str", "4"), ("bool", True),
            ("none", None), ("above-int", 2**31),
        ]
    ),
    *(
        pytest.param({"batch_size": value}, "batch_size", id=f"batch_size-{label}")
        for label, value in [("zero", 0), ("negative", -5), ("float", 2.5), ("str", "10"), ("above-int", 2**31)]
    ),
    pytest.param({"mode": "fast"}, "mode", id="mode-unknown"),
    pytest.param({"mode": None}, "mode", id="mode-none"),
    pytest.param({"lease": timedelta(0)}, "lease", id="lease-zero"),
    pytest.param({"lease": timedelta(seconds=-1)}, "lease", id="lease-negative"),
    pytest.param({"lease": 60}, "lease", id="lease-number"),
    pytest.param({"lease": timedelta.max}, "lease", id="lease-max"),
    pytest.param({"stall_timeout": timedelta(0)}, "stall_timeout", id="stall-zero"),
    pytest.param({"stall_timeout": 10}, "stall_timeout", id="stall-number"),
    pytest.param({"stall_timeout": timedelta.max}, "stall_timeout", id="stall-max"),
    pytest.param({"poll_interval": 0}, "poll_interval", id="poll-zero"),
    pytest.param({"poll_interval": -1.0}, "poll_interval", id="poll-negative"),
    pytest.param({"poll_interval": math.nan}, "poll_interval", id="poll-nan"),
    pytest.param({"poll_interval": math.inf}, "poll_interval", id="poll-inf"),
    pytest.param({"poll_interval": "1"}, "poll_interval", id="poll-str"),
    pytest.param({"poll_interval": True}, "poll_interval", id="poll-bool"),
    pytest.param({"heartbeat_interval": timedelta(seconds=-1)}, "heartbeat_interval", id="hb-negative"),
    pytest.param({"heartbeat_interval": 5}, "heartbeat_interval", id="hb-number"),
    pytest.param({"heartbeat_interval": timedelta.max}, "heartbeat_interval", id="hb-max"),
    pytest.param({"reap_interval": timedelta(seconds=-1)}, "reap_interval", id="reap-negative"),
    pytest.param({"reap_interval": 5}, "reap_interval", id="reap-number"),
    pytest.param({"queues": []}, "queues", id="queues-empty"),
    pytest.param({"queues": [""]}, "queues", id="queues-blank"),
    pytest.param({"queues": [5]}, "queues", id="queues-int-item"),
    pytest.param({"queues": [NUL]}, "queues", id="queues-nul"),
    pytest.param({"queues": [SURROGATE]}, "queues", id="queues-surrogate"),
    pytest.param({"queues": None}, "queues", id="queues-none"),
    pytest.param({"name": ""}, "name", id="name-empty"),
    pytest.param({"name": NUL}, "name", id="name-nul"),
    pytest.param({"name": 5}, "name", id="name-int"),
    pytest.param({"name": "n" * 256}, "name", id="name-long"),
    pytest.param({"bind": None}, "bind", id="bind-none"),
    pytest.param({"bind": "postgresql://u@h/d"}, "bind", id="bind-url"),
    pytest.param({"repositories": []}, "repositories", id="repositories-empty"),
    pytest.param({"repositories": [None]}, "repositories", id="repositories-none-item"),
    pytest.param({"repositories": TaskJob}, "repositories", id="repositories-model"),
    pytest.param({"repositories": None}, "repositories", id="repositories-none"),
    pytest.param({"tasks": None}, "tasks", id="tasks-none"),
    pytest.param({"tasks": {"noop": len}}, "tasks", id="tasks-dict"),
]


@pytest.mark.parametrize(("kwargs", "parameter"), WORKER_OPTIONS)
def test_worker_refuses(db: Engine, world: World, kwargs: dict[str, Any], parameter: str) -> None:
    args: dict[str, Any] = {"bind": db, "repositories": jobs, "tasks": app_tasks} | kwargs
    refused(db, lambda s: Worker(args.pop("bind"), args.pop("repositories"), args.pop("tasks"), **args), parameter)


# --------------------------------------------------------------------------- TaskRegistry, Task, RetryPolicy


def _handler(job: Any) -> None:
    pass


def _session_after_arguments(user_id: int, session: Session) -> None:
    """Asks for the session after its own argument: a type checker could not take it off enqueue's."""


REGISTER = [
    *(
        pytest.param({"name": value}, "name", id=f"name-{label}")
        for label, value in [
            ("empty", ""), ("blank", "  "), ("none", None), ("int", 5), ("nul", NUL), ("surrogate", SURROGATE),
            ("long", "n" * 129), ("bytes", b"x"),
        ]
    ),
    pytest.param({"handler": None}, "handler", id="handler-none"),
    pytest.param({"handler": 5}, "handler", id="handler-int"),
    pytest.param({"handler": _session_after_arguments}, "handler", id="handler-session-after-arguments"),
    pytest.param({"handler": min}, "handler", id="handler-no-signature"),
    pytest.param({"retry": "fast"}, "retry", id="retry-str"),
    pytest.param({"retry": None}, "retry", id="retry-none"),
    pytest.param({"retry": RetryPolicy}, "retry", id="retry-class"),
    *(
        pytest.param({"max_attempts": value}, "max_attempts", id=f"max_attempts-{label}")
        for label, value in [
            ("zero", 0), ("negative", -1), ("above-int", 2**31), ("str", "3"), ("bool", True), ("float", 2.0),
        ]
    ),
    pytest.param({"batch_complete": "no"}, "batch_complete", id="batch_complete-str"),
    pytest.param({"batch_complete": None}, "batch_complete", id="batch_complete-none"),
    pytest.param({"batch_complete": 1}, "batch_complete", id="batch_complete-int"),
    pytest.param({"repository": TaskJob}, "repository", id="repository-model"),
    pytest.param({"repository": "jobs"}, "repository", id="repository-str"),
    pytest.param({"queue": ""}, "queue", id="queue-empty"),
    pytest.param({"queue": NUL}, "queue", id="queue-nul"),
    pytest.param({"priority": 40_000}, "priority", id="priority-above"),
    pytest.param({"priority": "1"}, "priority", id="priority-str"),
]


@pytest.mark.parametrize(("kwargs", "parameter"), REGISTER)
def test_task_registry_refuses(db: Engine, kwargs: dict[str, Any], parameter: str) -> None:
    registry = TaskRegistry()
    args: dict[str, Any] = {"name": "noop", "handler": _handler} | kwargs
    refused(db, lambda s: registry.register(args.pop("name"), args.pop("handler"), **args), parameter)
    assert len(registry) == 0
    # The decorator form refuses the same options.
    options = {k: v for k, v in kwargs.items() if k not in ("name", "handler")}
    if options or ("name" in kwargs and kwargs["name"] is not None):  # task(None): the function's name
        name = kwargs.get("name", "noop")
        refused(db, lambda s: registry.task(name, **options)(_handler), parameter)
    assert len(registry) == 0


def _typed_task() -> Any:
    registry = TaskRegistry(repository=JobRepository(TaskJob))

    @registry.task
    def charge(order_id: int, *tags: str, note: str = "") -> None:
        pass

    return charge


TYPED_ENQUEUE = [
    pytest.param(lambda t, s: t.enqueue(s), "order_id", id="missing"),
    pytest.param(lambda t, s: t.enqueue(s, 1, nope=2), "nope", id="unknown-keyword"),
    pytest.param(lambda t, s: t.enqueue(s, 1, order_id=2), "order_id", id="twice"),
    pytest.param(lambda t, s: t.enqueue(s, object()), "order_id", id="not-json"),
    pytest.param(lambda t, s: t.enqueue(s, 1, b"x"), "tags", id="star-args-not-json"),
    pytest.param(lambda t, s: t.enqueue(s, float("inf")), "order_id", id="infinity"),
    pytest.param(lambda t, s: t.enqueue(s, 1, note=SURROGATE), "note", id="surrogate"),
    pytest.param(lambda t, s: t.enqueue(s, 1, note="x" * (1024 * 1024 + 1)), "note", id="argument-too-big"),
    pytest.param(lambda t, s: t.enqueue(s, 1, "x" * 600_000, note="x" * 600_000), "payload", id="too-big"),
    pytest.param(lambda t, s: t.enqueue(None, 1), "session", id="session-none"),
    pytest.param(lambda t, s: t.spec(1, note={1}), "note", id="spec-not-json"),
    pytest.param(lambda t, s: t.configure(queue=""), "queue", id="configure-queue"),
    pytest.param(lambda t, s: t.configure(priority=-40_000), "priority", id="configure-priority"),
    pytest.param(lambda t, s: t.configure(delay=-1), "delay", id="configure-delay"),
    pytest.param(lambda t, s: t.configure(max_attempts=0), "max_attempts", id="configure-max_attempts"),
    pytest.param(lambda t, s: t.configure(dedupe_key=NUL), "dedupe_key", id="configure-dedupe_key"),
    pytest.param(lambda t, s: t.configure(repository=TaskJob), "repository", id="configure-repository"),
    pytest.param(lambda t, s: t.configure(run_at=datetime(2030, 1, 1), delay=5), "run_at", id="configure-both"),
    pytest.param(lambda t, s: t.configure(extra={"nope": 1}).enqueue(s, 1), "extra", id="configure-extra"),
    pytest.param(lambda t, s: t.configure(meta=["trace"]), "meta", id="configure-meta"),
    pytest.param(lambda t, s: t.configure(meta={"a": NUL}), "meta", id="configure-meta-nul"),
]


@pytest.mark.parametrize(("call", "parameter"), TYPED_ENQUEUE)
def test_typed_enqueue_refuses(db: Engine, call: Callable[[Any, Session], object], parameter: str) -> None:
    task = _typed_task()
    refused(db, lambda s: call(task, s), parameter)


def test_a_registry_refuses_a_repository_that_is_not_one(db: Engine) -> None:
    refused(db, lambda s: TaskRegistry(repository=TaskJob), "repository")


def test_a_registry_refuses_middleware_that_is_not_a_list_of_callables(db: Engine) -> None:
    refused(db, lambda s: TaskRegistry(middleware="timed"), "middleware")  # type: ignore[arg-type]
    refused(db, lambda s: TaskRegistry(middleware=[None]), "middleware")  # type: ignore[list-item]
    refused(db, lambda s: TaskRegistry().use(5), "middleware")  # type: ignore[arg-type]


@pytest.mark.parametrize(("call", "parameter"), [
    pytest.param(lambda s: read_result(s, ReportJob, 0), "job_id", id="job_id-zero"),
    pytest.param(lambda s: read_result(s, ReportJob, "1"), "job_id", id="job_id-str"),
    pytest.param(lambda s: read_result(s, ReportJob, True), "job_id", id="job_id-bool"),
    pytest.param(lambda s: read_result(s, User, 1), "model", id="model-not-a-job-table"),
    pytest.param(lambda s: read_result(None, ReportJob, 1), "session", id="session-none"),
    pytest.param(lambda s: wait_for_result(s.get_bind(), ReportJob, 1, timeout=0), "timeout", id="timeout-zero"),
    pytest.param(lambda s: wait_for_result(s.get_bind(), ReportJob, 1, timeout=math.inf), "timeout", id="timeout-inf"),
    pytest.param(lambda s: wait_for_result(s.get_bind(), ReportJob, 1, timeout=1, poll_interval=0), "poll_interval",
                 id="poll_interval-zero"),
])
def test_results_refuse(db: Engine, call: Callable[[Session], object], parameter: str) -> None:
    refused(db, call, parameter)


def test_task_registry_refuses_a_second_registration_and_odd_lookups(db: Engine) -> None:
    registry = TaskRegistry()
    registry.register("noop", _handler)
    refused(db, lambda s: registry.register("noop", _handler), "name")
    assert registry.get(None) is None  # type: ignore[arg-type]
    assert [] not in registry
    assert registry.get("noop\x00") is None


@pytest.mark.parametrize(
    ("kwargs", "parameter"),
    [
        pytest.param({"name": ""}, "name", id="name-empty"),
        pytest.param({"name": NUL}, "name", id="name-nul"),
        pytest.param({"handler": None}, "handler", id="handler-none"),
        pytest.param({"takes_session": "yes"}, "takes_session", id="takes_session-str"),
        pytest.param({"retry": None}, "retry", id="retry-none"),
        pytest.param({"max_attempts": 0}, "max_attempts", id="max_attempts-zero"),
        pytest.param({"batch_complete": None}, "batch_complete", id="batch_complete-none"),
    ],
)
def test_task_refuses(db: Engine, kwargs: dict[str, Any], parameter: str) -> None:
    args: dict[str, Any] = {"name": "noop", "handler": _handler, "takes_session": False} | kwargs
    refused(db, lambda s: Task(**args), parameter)


RETRY_POLICY = [
    *(
        pytest.param({"base": value}, "base", id=f"base-{label}")
        for label, value in [
            ("negative", timedelta(seconds=-1)), ("number", 15), ("none", None), ("max", timedelta.max),
        ]
    ),
    *(
        pytest.param({"factor": value}, "factor", id=f"factor-{label}")
        for label, value in [
            ("below-one", 0.5), ("zero", 0), ("nan", math.nan), ("inf", math.inf), ("str", "2"), ("bool", True),
            ("none", None),
        ]
    ),
    *(
        pytest.param({"max_delay": value}, "max_delay", id=f"max_delay-{label}")
        for label, value in [
            ("below-base", timedelta(seconds=1)), ("negative", timedelta(seconds=-1)), ("number", 3600),
            ("max", timedelta.max), ("200-years", timedelta(days=365 * 200)),
        ]
    ),
    *(
        pytest.param({"jitter": value}, "jitter", id=f"jitter-{label}")
        for label, value in [
            ("negative", -0.1), ("one", 1), ("above-one", 1.5), ("nan", math.nan), ("inf", math.inf),
            ("str", "0.1"), ("bool", False),
        ]
    ),
]


@pytest.mark.parametrize(("kwargs", "parameter"), RETRY_POLICY)
def test_retry_policy_refuses(db: Engine, kwargs: dict[str, Any], parameter: str) -> None:
    refused(db, lambda s: RetryPolicy(**kwargs), parameter)


def test_retry_policy_delays_never_overflow() -> None:
    policy = RetryPolicy(base=timedelta(seconds=1), factor=1e10, max_delay=timedelta(days=30), jitter=0)
    assert policy.delay(1) == timedelta(seconds=1)
    for attempt in (2, 3, 40, 10**6, 2**31):
        assert policy.delay(attempt) == timedelta(days=30)
    assert RetryPolicy(base=timedelta(0), max_delay=timedelta(0)).delay(10**9) == timedelta(0)


# --------------------------------------------------------------------------- migration helpers


@pytest.fixture
def live_op(db: Engine, world: World) -> Iterator[Connection]:
    """``alembic.op`` bound to a real connection, in a transaction rolled back at the end."""
    with db.connect() as conn:
        with Operations.context(MigrationContext.configure(conn)):
            yield conn
        conn.rollback()


def _catalog(conn: Connection) -> list[tuple[Any, ...]]:
    """Names, kinds and storage parameters of every relation of the public schema."""
    return [
        tuple(row)
        for row in conn.execute(
            text(
                "SELECT relname, relkind, reloptions FROM pg_class "
                "WHERE relnamespace = 'public'::regnamespace ORDER BY relname"
            )
        )
    ]


MIGRATIONS = [
    *(
        pytest.param(lambda v=value: set_queue_storage(v), "table_name", id=f"set-table-{label}")
        for label, value in [
            ("empty", ""), ("none", None), ("int", 5), ("nul", "jobs\x00"), ("surrogate", SURROGATE),
            ("injection", "jobs; DROP TABLE users"), ("quote", 'jobs"; DROP TABLE users; --'),
            ("dollar", "$$jobs$$"), ("backslash", "jobs\\"), ("space", "my jobs"), ("dotted", "public.task_jobs"),
            ("non-ascii", "tâches"), ("too-long", "j" * 64), ("unknown", "no_such_table"),
            ("an-index", "ix_task_jobs_claim_v1"),
        ]
    ),
    pytest.param(
        lambda: set_queue_storage("task_jobs", schema="no_such_schema"), "table_name", id="set-unknown-schema"
    ),
    pytest.param(lambda: set_queue_storage("task_jobs", schema="a.b"), "schema", id="set-schema-dotted"),
    pytest.param(lambda: set_queue_storage("task_jobs", schema=NUL), "schema", id="set-schema-nul"),
    pytest.param(lambda: set_queue_storage("task_jobs", schema=5), "schema", id="set-schema-int"),
    *(
        pytest.param(
            lambda v=value: set_queue_storage("task_jobs", fillfactor=v), "fillfactor", id=f"set-value-{label}"
        )
        for label, value in [
            ("nan", math.nan), ("inf", math.inf), ("-inf", -math.inf), ("huge-int", 2**40),
            ("injection", "80) ; DROP TABLE users; --"), ("nul", "80\x00"), ("list", [80]), ("bytes", b"80"),
        ]
    ),
    pytest.param(lambda: set_queue_storage("task_jobs", **{"Bad-Name": 1}), "Bad-Name", id="set-parameter-name"),
    pytest.param(lambda: set_queue_storage("task_jobs", **{"x; DROP": 1}), "x; DROP", id="set-parameter-injection"),
    pytest.param(
        lambda: set_queue_storage("task_jobs", **{k: None for k in ("fillfactor", "autovacuum_vacuum_scale_factor",
                                                                    "autovacuum_vacuum_threshold",
                                                                    "autovacuum_analyze_scale_factor")}),
        "overrides", id="set-nothing-left",
    ),
    pytest.param(lambda: reset_queue_storage("no_such_table"), "table_name", id="reset-unknown-table"),
    pytest.param(lambda: reset_queue_storage("task_jobs", "fillfactor; DROP"), "parameters", id="reset-injection"),
    pytest.param(lambda: reset_queue_storage("task_jobs", 5), "parameters", id="reset-int"),
    pytest.param(lambda: reset_queue_storage("task_jobs", NUL), "parameters", id="reset-nul"),
    pytest.param(lambda: reset_queue_storage("task_jobs", schema="a.b"), "schema", id="reset-schema"),
    pytest.param(lambda: rename_job_table("no_such_table", "new_jobs"), "old", id="rename-unknown"),
    pytest.param(lambda: rename_job_table("task_jobs", "email_jobs"), "new", id="rename-onto-existing"),
    pytest.param(lambda: rename_job_table("task_jobs", "task_jobs"), "new", id="rename-same"),
    pytest.param(lambda: rename_job_table("task_jobs", "j" * 45), "new", id="rename-too-long"),
    pytest.param(lambda: rename_job_table("task_jobs", "x; DROP TABLE users"), "new", id="rename-injection"),
    pytest.param(lambda: rename_job_table("task_jobs\x00", "new_jobs"), "old", id="rename-nul"),
    pytest.param(lambda: rename_job_table(None, "new_jobs"), "old", id="rename-none"),
    pytest.param(lambda: rename_job_table("task_jobs", "new_jobs", schema="x'y"), "schema", id="rename-schema"),
]


@pytest.mark.parametrize(("call", "parameter"), MIGRATIONS)
def test_migration_helpers_refuse(db: Engine, live_op: Connection, call: Callable[[], None], parameter: str) -> None:
    before = _catalog(live_op)
    with recorded_sql(db) as sent, pytest.raises(InvalidArgumentError) as info:
        call()
    assert info.value.parameter == parameter
    assert str(info.value).startswith(f"{parameter}:")
    # At most a catalog lookup (a read) went out; nothing was altered.
    assert all(statement.lstrip().upper().startswith("SELECT") for statement in sent), sent
    assert _catalog(live_op) == before


def test_migration_helpers_still_work_online(live_op: Connection) -> None:
    set_queue_storage("task_jobs", fillfactor=90)
    assert "fillfactor=90" in {row[0]: row[2] for row in _catalog(live_op)}["task_jobs"]
    reset_queue_storage("task_jobs")
    assert {row[0]: row[2] for row in _catalog(live_op)}["task_jobs"] is None
    rename_job_table("report_jobs", "old_report_jobs")
    assert "old_report_jobs" in {row[0] for row in _catalog(live_op)}


# --------------------------------------------------------------------------- error text: recorded, never refused



class _Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no text for you")


def test_clean_error_repairs_and_shortens() -> None:
    assert clean_error("plain") == "plain"
    assert clean_error("a\x00b") == "a\ufffdb"
    assert clean_error(SURROGATE) == "caf\ufffd"
    assert clean_error(ValueError("boom")) == "boom"
    assert clean_error(_Unprintable()) == "<_Unprintable object; str() raised RuntimeError>"
    long = "HEAD" + "x" * 100_000 + "TAIL"
    short = clean_error(long)
    assert len(short) <= MAX_ERROR_LENGTH
    assert short.startswith("HEAD") and short.endswith("TAIL")
    cut = int(short.split("[")[1].split(" ")[0])
    assert len(short) - len(short.split("\n")[1]) - 2 + cut == len(long)  # the marker's count is exact
    for limit in (1, 10, 50, 200):
        assert len(clean_error(long, limit)) <= limit


@pytest.mark.parametrize(
    ("error", "stored"),
    [
        pytest.param("bad \x00 byte", "bad \ufffd byte", id="nul"),
        pytest.param(SURROGATE, "caf\ufffd", id="surrogate"),
        pytest.param("x" * 1_000_000, None, id="one-million-characters"),
        pytest.param(_Unprintable(), "<_Unprintable object; str() raised RuntimeError>",
                     id="unprintable"),
        pytest.param("'); DROP TABLE task_jobs; --", "'); DROP TABLE task_jobs; --", id="injection"),
    ],
)
def test_fail_always_records_the_error(
    sessions: sessionmaker[Session], world: World, error: object, stored: str | None
) -> None:
    try:
        with sessions.begin() as session:
            assert jobs.fail(session, world.claimed, error) == "pending"  # type: ignore[arg-type]
    except Exception as exc:
        _fail_briefly(exc)
    with sessions() as session:
        job = session.get(TaskJob, world.claimed.id)
        assert job is not None and job.status == "pending" and job.last_error is not None
        assert len(job.last_error) <= MAX_ERROR_LENGTH
        if stored is not None:
            assert job.last_error == stored


def test_a_worker_records_a_handler_error_with_a_nul_byte(engine: Engine, sessions: sessionmaker[Session]) -> None:
    registry = TaskRegistry()

    @registry.task(max_attempts=1)
    def nul_error(job: Any) -> None:
        raise RuntimeError("bad \x00 byte")

    with sessions.begin() as session:
        job = jobs.enqueue(session, "nul_error")
    Worker(engine, jobs, registry, concurrency=1, poll_interval=0.05).run(until_empty=True)
    with sessions() as session:
        stored = session.get(TaskJob, job.id)
        assert stored is not None and stored.status == "dead"
        assert "bad \ufffd byte" in (stored.last_error or "")


# --------------------------------------------------------------------------- limits that hold at their edge


def test_run_at_and_delay_inside_the_horizon_are_accepted(sessions: sessionmaker[Session]) -> None:
    edge = datetime.now(UTC) + SCHEDULE_HORIZON - timedelta(days=1)
    with sessions.begin() as session:
        far = jobs.enqueue(session, "noop", run_at=edge)
        late = jobs.enqueue(session, "noop", delay=SCHEDULE_HORIZON)
        old = jobs.enqueue(session, "noop", run_at=datetime.now(UTC) - SCHEDULE_HORIZON + timedelta(days=1))
    with sessions() as session:
        assert session.get(TaskJob, far.id).run_at == edge  # type: ignore[union-attr]
        assert session.get(TaskJob, late.id).run_at.year >= datetime.now(UTC).year + 99  # type: ignore[union-attr]
        assert session.get(TaskJob, old.id) is not None
