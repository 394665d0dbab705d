"""The application the fault suite runs: a job table, an effects ledger, the
handlers, and a CLI that runs one worker process.

    python tests/chaos/chaosapp.py work URL --mode lease|transaction|aio[tx]_psycopg|aio[tx]_asyncpg
        --concurrency 4 --lease 3 [--no-listen] [--pgbouncer]
        [--batch-size N] [--pool-size N --max-overflow N --pool-timeout S | --null-pool] [--log-level INFO]
    python tests/chaos/chaosapp.py produce URL --producer N --seconds 20 --keys 60 --per-call 12

The worker runs until SIGTERM/SIGINT, then prints its WorkerResult as JSON.
Modes ``aio_psycopg`` and ``aio_asyncpg`` run the asyncio worker on that
driver, with ``async def`` handlers that do what the sync ones do;
``aiotx_psycopg`` and ``aiotx_asyncpg`` run it in transaction mode.
``--pool-size``, ``--max-overflow`` and ``--pool-timeout`` size the
application's engine (the jobs' sessions); by default it has
``concurrency + 1`` connections, 2 more at peaks, and waits 30 s for one;
``--null-pool`` makes it open a connection per session instead.
``produce`` is one producer of the bulk-dedupe scenario: it calls
``enqueue_many`` with overlapping dedupe keys in a shuffled order for a
while, then prints what it did as JSON (see :func:`_produce`).

Each handler call first appends ``job_id attempt pid time`` to a run log of
its own process (``$CHAOS_RUNLOG/runs-<pid>.log``, written with one
``write(2)`` so that a SIGKILL loses nothing the kernel has), then writes one
``chaos_effects`` row in the job's own session. ``chaos_effects.job_id`` is
deliberately not unique: a job whose effect committed twice has two rows
there, instead of failing on a key. The run log tells how often a handler
started; the effects tell how often its database effect committed.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import os
import random
import signal
import sys
import threading
import time
import uuid
from dataclasses import asdict
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import BigInteger, DateTime, Engine, Integer, create_engine, func, select, text
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column
from sqlalchemy.pool import NullPool

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from sa_jobqueue import JobMixin, JobRepository, JobSpec, RetryPolicy, TaskRegistry, Worker  # noqa: E402
from sa_jobqueue.urls import psycopg_url  # noqa: E402


class Base(DeclarativeBase):
    pass


class ChaosJob(JobMixin, Base):
    """Completed jobs are deleted (the default): a finished job is either
    gone with exactly one effect, or ``dead``."""

    __tablename__ = "chaos_jobs"


class Effect(Base):
    """One row per committed run of a handler; ``job_id`` is not unique on purpose."""

    __tablename__ = "chaos_effects"
    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    job_id: Mapped[int] = mapped_column(BigInteger, index=True)
    attempt: Mapped[int] = mapped_column(Integer)
    pid: Mapped[int] = mapped_column(Integer)
    at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.clock_timestamp())


class Batch(Base):
    """The ids of one enqueued batch, inserted in the batch's own transaction:
    after a failed commit, its presence tells whether the batch committed."""

    __tablename__ = "chaos_batches"
    batch: Mapped[int] = mapped_column(Integer, primary_key=True)
    ids: Mapped[list[int]] = mapped_column(ARRAY(BigInteger))


jobs = JobRepository(ChaosJob)
tasks = TaskRegistry()
# Fast retries, so that a job failed by a fault (a killed connection) runs
# again within a second or two instead of the default 15 s.
FAST = RetryPolicy(base=timedelta(milliseconds=100), max_delay=timedelta(seconds=1), jitter=0.1)
STORM = RetryPolicy(base=timedelta(0), max_delay=timedelta(0), jitter=0)
MAX_ATTEMPTS = 25

_runlog_fd: int | None = None


def _record_start(job: ChaosJob) -> None:
    global _runlog_fd
    directory = os.environ.get("CHAOS_RUNLOG")
    if not directory:
        return
    if _runlog_fd is None:
        _runlog_fd = os.open(Path(directory) / f"runs-{os.getpid()}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.write(_runlog_fd, f"{job.id} {job.attempts} {os.getpid()} {time.time():.6f}\n".encode())


HOLD_QUERY = "SELECT 'chaos-hold'"
LEAK_QUERY = "SELECT 'chaos-leak'"
log = logging.getLogger("chaosapp")

# Sessions that handlers with ``payload.leak`` opened and did not close (this process's).
_leaked: list[Session] = []
_leak_lock = threading.Lock()


def _leak(session: Session, keep: int) -> None:
    """What a buggy handler does: open a Session of its own on the app's engine,
    run a query in it and keep it open (a checked-out connection, idle in
    transaction). Once ``keep`` are held, the next such handler closes them
    all instead, which gives their connections back to the pool."""
    with _leak_lock:
        released = list(_leaked) if len(_leaked) >= keep else []
        if released:
            _leaked.clear()
    if released:
        for extra in released:
            extra.close()  # a connection the server ended meanwhile is discarded by the pool
        log.warning("chaos leak: released %s leaked session(s)", len(released))
        return
    # The job's session holds a connection of the pool already: at most
    # pool_size - 1 can leak, so one is always left for the next job.
    extra = Session(session.get_bind())
    try:
        extra.execute(text(LEAK_QUERY))  # checks out a connection and keeps it
    except BaseException:
        extra.close()  # the pool had none left: this handler fails (and is retried)
        raise
    with _leak_lock:
        _leaked.append(extra)
        held = len(_leaked)
    log.warning("chaos leak: leaked a session (%s held)", held)


def _run(job: ChaosJob, session: Session) -> None:
    _record_start(job)
    if job.payload.get("leak"):
        _leak(session, int(job.payload["leak"]))
    if job.payload.get("hold"):
        # Open the job's transaction on its connection before sleeping, so a
        # test can find this backend (its last query) and stall its connection.
        session.execute(text(HOLD_QUERY))
    time.sleep(float(job.payload.get("sleep", 0)))
    if job.attempts <= int(job.payload.get("fail", 0)):
        raise RuntimeError(f"planned failure at attempt {job.attempts}")
    session.add(Effect(job_id=job.id, attempt=job.attempts, pid=os.getpid()))
    session.flush()


@tasks.task(retry=FAST, max_attempts=MAX_ATTEMPTS)
def effect(job: ChaosJob, session: Session) -> None:
    """Sleep ``payload.sleep`` seconds (with ``payload.hold``: in an open transaction),
    fail the first ``payload.fail`` attempts, then write the effect."""
    _run(job, session)


@tasks.task(retry=STORM, max_attempts=MAX_ATTEMPTS)
def storm(job: ChaosJob, session: Session) -> None:
    """As ``effect``, retried at once after each failure."""
    _run(job, session)


def connect_args(*, pgbouncer: bool, application_name: str = "chaos-worker") -> dict[str, Any]:
    """The engine's libpq options: what the fault suite recommends (docs/operations.md)."""
    args: dict[str, Any] = {
        "connect_timeout": 5,
        # A vanished peer (host down, packets dropped) fails a connection within
        # keepalives_idle + interval * count = 11 s when idle, or tcp_user_timeout
        # when data sent stays unacknowledged.
        "keepalives": 1, "keepalives_idle": 5, "keepalives_interval": 2, "keepalives_count": 3,
        "tcp_user_timeout": 10_000,
        "application_name": application_name,
    }
    if pgbouncer:
        # PgBouncer before 1.21 cannot track prepared statements in transaction
        # pooling, and refuses the "options" startup parameter.
        args["prepare_threshold"] = None
    else:
        # A session stuck in a transaction (a client that stalled, froze or
        # vanished mid-job) gives its row locks back after 20 s.
        args["options"] = "-c idle_in_transaction_session_timeout=20s"
    return args


def make_engine(url: str, *, concurrency: int, pgbouncer: bool, pool_size: int | None = None,
                max_overflow: int = 2, pool_timeout: float = 30, null_pool: bool = False) -> Engine:
    args = connect_args(pgbouncer=pgbouncer, application_name=f"chaos-worker-{os.getpid()}")
    if null_pool:  # a new connection for every session
        return create_engine(psycopg_url(url), poolclass=NullPool, pool_pre_ping=True, connect_args=args)
    return create_engine(
        psycopg_url(url), pool_size=concurrency + 1 if pool_size is None else pool_size,
        max_overflow=max_overflow, pool_timeout=pool_timeout, pool_pre_ping=True, connect_args=args,
    )


async_tasks = TaskRegistry()


async def _run_async(job: ChaosJob, session: Any) -> None:
    """``_run`` in an async def handler, on the job's AsyncSession."""
    import asyncio

    _record_start(job)
    if job.payload.get("hold"):
        # As _run: open the job's transaction on its connection before sleeping.
        await session.execute(text(HOLD_QUERY))
    await asyncio.sleep(float(job.payload.get("sleep", 0)))
    if job.attempts <= int(job.payload.get("fail", 0)):
        raise RuntimeError(f"planned failure at attempt {job.attempts}")
    session.add(Effect(job_id=job.id, attempt=job.attempts, pid=os.getpid()))
    await session.flush()


async_tasks.register("effect", _run_async, retry=FAST, max_attempts=MAX_ATTEMPTS)
async_tasks.register("storm", _run_async, retry=STORM, max_attempts=MAX_ATTEMPTS)


def _work_async(args: argparse.Namespace, driver: str, mode: str) -> None:
    """The asyncio worker (modes aio_<driver>: lease mode, aiotx_<driver>: transaction mode), with the
    connection settings of connect_args."""
    import asyncio

    from sqlalchemy.ext.asyncio import create_async_engine

    from sa_jobqueue.aio import AsyncWorker

    name = f"chaos-worker-{os.getpid()}"
    if driver == "psycopg":
        options: dict[str, Any] = connect_args(pgbouncer=args.pgbouncer, application_name=name)
    elif args.pgbouncer:  # docs/asyncio.md: no prepared statements; PgBouncer refuses other startup settings
        options = {"timeout": 5, "server_settings": {"application_name": name}, "statement_cache_size": 0,
                   "prepared_statement_cache_size": 0,
                   "prepared_statement_name_func": lambda: f"__asyncpg_{uuid.uuid4()}__"}
    else:  # asyncpg: its own names; it has no TCP keepalive settings
        options = {"timeout": 5, "server_settings": {"application_name": name,
                                                     "idle_in_transaction_session_timeout": "20s"}}
    url = psycopg_url(args.url).set(drivername=f"postgresql+{driver}")

    async def main() -> dict[str, Any]:
        # A hung worker's tasks, into its log (the harness sends SIGUSR2 before SIGUSR1's thread stacks).
        asyncio.get_running_loop().add_signal_handler(signal.SIGUSR2, _dump_tasks)
        if args.null_pool:  # a new connection for every session
            engine = create_async_engine(url, poolclass=NullPool, pool_pre_ping=True, connect_args=options)
        else:
            engine = create_async_engine(url, pool_size=args.concurrency + 1, max_overflow=2, pool_pre_ping=True,
                                         connect_args=options)
        worker = AsyncWorker(engine, jobs, async_tasks, concurrency=args.concurrency, mode=mode,  # type: ignore[arg-type]
                             lease=timedelta(seconds=args.lease), poll_interval=args.poll, listen=args.listen,
                             batch_size=args.batch_size)
        try:
            return asdict(await worker.run())
        finally:
            await engine.dispose()

    print(json.dumps({"pid": os.getpid(), **asyncio.run(main())}), flush=True)


def _dump_tasks() -> None:
    """Print every asyncio task of the running loop with its stack, to stderr."""
    import asyncio
    for task in asyncio.all_tasks():
        print(f"--- task {task.get_name()}: {task!r}"[:500], file=sys.stderr)
        task.print_stack(file=sys.stderr)
    sys.stderr.flush()


def _work(args: argparse.Namespace) -> None:
    if args.mode.startswith(("aio_", "aiotx_")):
        kind, driver = args.mode.split("_")
        _work_async(args, driver, "transaction" if kind == "aiotx" else "lease")
        return
    engine = make_engine(args.url, concurrency=args.concurrency, pgbouncer=args.pgbouncer,
                         pool_size=args.pool_size, max_overflow=args.max_overflow, pool_timeout=args.pool_timeout,
                         null_pool=args.null_pool)
    worker = Worker(
        engine, jobs, tasks, concurrency=args.concurrency, mode=args.mode,
        lease=timedelta(seconds=args.lease), poll_interval=args.poll, listen=args.listen,
        batch_size=args.batch_size,
    )
    result = worker.run()
    print(json.dumps({"pid": os.getpid(), **asdict(result)}), flush=True)


def _produce(args: argparse.Namespace) -> None:
    """One producer: for ``--seconds``, call ``enqueue_many`` with ``--per-call``
    specs whose dedupe keys are drawn from ``k0`` … ``k<keys-1>`` (a few of
    them twice) in a shuffled order, each call in its own transaction with a
    ``chaos_batches`` row (batch ``--batch-base + n``) listing the ids it
    returned; the transaction stays open a moment after the insert, so the
    keys it wrote overlap other producers' transactions. Every error is
    counted, by SQLSTATE (40P01 is a deadlock), and the producer goes on.

    Prints {"producer", "calls", "committed", "rows", "inserted", "deduped",
    "errors": {sqlstate: n}, "messages": [...], "wrong_key": n}: ``inserted``
    counts returned jobs created by the call's own transaction (their
    ``created_at`` is its ``now()``), ``deduped`` those that a live job of
    another transaction (or an earlier row of the call) stood for, and
    ``wrong_key`` returned jobs whose dedupe key is not the spec's.
    """
    rng = random.Random(f"{args.seed}:producer:{args.producer}")
    engine = create_engine(psycopg_url(args.url), pool_size=1, pool_pre_ping=True,
                           connect_args=connect_args(pgbouncer=False,
                                                     application_name=f"chaos-producer-{args.producer}"))
    stats: dict[str, Any] = {"producer": args.producer, "calls": 0, "committed": 0, "rows": 0, "inserted": 0,
                             "deduped": 0, "wrong_key": 0, "errors": {}, "messages": []}
    deadline = time.monotonic() + args.seconds
    n = 0
    try:
        while time.monotonic() < deadline:
            keys = [f"k{k}" for k in rng.sample(range(args.keys), args.per_call)]
            keys += rng.sample(keys, 2)  # repeats within one call
            rng.shuffle(keys)
            specs = [JobSpec("effect", {"key": key, "producer": args.producer, "sleep": round(rng.uniform(0, 0.01), 4)},
                             dedupe_key=key, max_attempts=25) for key in keys]
            stats["calls"] += 1
            try:
                with Session(engine) as session, session.begin():
                    now = session.execute(select(func.now())).scalar_one()
                    rows = jobs.enqueue_many(session, specs)
                    session.add(Batch(batch=args.batch_base + n, ids=[row.id for row in rows]))
                    session.flush()
                    time.sleep(rng.uniform(0, 0.02))  # hold the new keys' row locks a moment
                stats["committed"] += 1
                stats["rows"] += len(rows)
                fresh = {row.id for row in rows if row.created_at == now}
                stats["inserted"] += len(fresh)
                stats["deduped"] += sum(row.id not in fresh for row in rows)
                stats["wrong_key"] += sum(row.dedupe_key != key for row, key in zip(rows, keys, strict=True))
            except DBAPIError as exc:
                state = getattr(exc.orig, "sqlstate", None) or type(exc.orig).__name__
                stats["errors"][state] = stats["errors"].get(state, 0) + 1
                if len(stats["messages"]) < 5:
                    stats["messages"].append(str(exc.orig).strip()[:500])
            n += 1
            time.sleep(rng.uniform(0, 0.05))
    finally:
        engine.dispose()
    print(json.dumps(stats), flush=True)


def main() -> None:
    # SIGUSR1 dumps every thread's stack to the log: the harness sends it to a
    # worker that did not stop after SIGTERM before it kills it.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)  # an asyncio worker dumps its tasks on it; others ignore it
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(process)d %(name)s %(levelname)s %(message)s")
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    work = sub.add_parser("work")
    work.add_argument("url")
    work.add_argument("--mode", default="lease")
    work.add_argument("--concurrency", type=int, default=4)
    work.add_argument("--lease", type=float, default=3.0)
    work.add_argument("--poll", type=float, default=0.5)
    work.add_argument("--no-listen", dest="listen", action="store_false")
    work.add_argument("--pgbouncer", action="store_true")
    work.add_argument("--batch-size", type=int, default=None)
    work.add_argument("--pool-size", type=int, default=None)
    work.add_argument("--max-overflow", type=int, default=2)
    work.add_argument("--pool-timeout", type=float, default=30.0)
    work.add_argument("--null-pool", action="store_true", help="the app's engine opens a connection per session")
    work.add_argument("--log-level", default="WARNING", help="of the sa_jobqueue loggers")
    produce = sub.add_parser("produce")
    produce.add_argument("url")
    produce.add_argument("--producer", type=int, required=True)
    produce.add_argument("--seed", default="0")
    produce.add_argument("--seconds", type=float, default=20.0)
    produce.add_argument("--keys", type=int, default=60)
    produce.add_argument("--per-call", type=int, default=12)
    produce.add_argument("--batch-base", type=int, required=True)
    args = parser.parse_args()
    if args.command == "produce":
        _produce(args)
        return
    logging.getLogger("sa_jobqueue").setLevel(args.log_level)
    _work(args)


if __name__ == "__main__":
    main()
