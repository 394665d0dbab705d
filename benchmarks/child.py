"""The benchmark's processes: an sa_jobqueue worker, the two raw psycopg loops, producers.

Started by ``run.py``, one process per measurement, so that the CPU time and
peak RSS each reports are its own::

    python benchmarks/child.py sajq     DSN --path a|b|c|g|t --concurrency C [--service] [--rss-at N,...] [--sleep S]
                                        [--record] [--pooler]
    python benchmarks/child.py sajq-async DSN --path a|b|c|g|t --driver psycopg|asyncpg --concurrency C [--sleep S]
    python benchmarks/child.py textbook DSN --concurrency C [--ledger]
    python benchmarks/child.py textbook-session | grouped-session DSN --concurrency C [--group N]
    python benchmarks/child.py batch    DSN --concurrency C [--service]
    python benchmarks/child.py batch-session DSN --concurrency C
    python benchmarks/child.py produce-sajq | produce-raw DSN --jobs 200 --gap 0.02

Protocol on stdin/stdout, every line of ours prefixed with ``@@``: the child
connects, prints ``@@ready`` and waits for ``go``; a drain then runs until the
queue is empty, a service (``--service``) until the line ``stop``. The child
ends by printing ``@@`` and one JSON object: ``seconds`` (wall time of the
measured part), ``cpu`` (user + system seconds of the whole process in it),
``hwm_kb`` (peak RSS, VmHWM), and what the role adds (the worker's result,
the ids it finished, the handler start times).

Execution paths of the sa_jobqueue worker:

* ``a``: lease mode, a handler without a session (batched completion);
* ``b``: lease mode, a handler that writes one ledger row in the job's session;
* ``c``: transaction mode, the same ledger handler;
* ``g``: path b's handler registered with ``group_commit=True`` (lease mode);
* ``t``: the same in transaction mode (a SAVEPOINT per group, not per job).

``sajq-async`` runs the asyncio worker (``AsyncWorker``) on the same paths
with ``async def`` handlers; ``--sleep S`` makes each handler wait S seconds
first (``asyncio.sleep``, or ``time.sleep`` in the thread worker): the
I/O-bound workload.

Clocks: ``time.monotonic()`` is CLOCK_MONOTONIC, shared by all processes of
the machine, so a producer's commit time and a worker's handler start time
can be subtracted.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import resource
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import psycopg  # noqa: E402
from common import (  # noqa: E402
    BATCH_CLAIM,
    BATCH_DELETE,
    CHANNEL,
    LEDGER,
    LEDGER_INSERT,
    QUEUE,
    RAW_INSERT,
    TEXTBOOK_CLAIM,
    TEXTBOOK_DELETE,
    sqlalchemy_url,
)

BATCH = 100  # rows per claim of the raw batch loop
TASK = "bench"


def say(line: str) -> None:
    sys.stdout.write(f"@@{line}\n")
    sys.stdout.flush()


def hwm_kb() -> int:
    """Peak resident set size of this process so far (VmHWM), in kB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def freeze_startup(args: argparse.Namespace) -> None:
    """``--freeze``: what the worker commands do before running their worker
    (sa_jobqueue.cli.worker_flags.freeze_startup), outside the timing."""
    if args.freeze:
        gc.collect()
        gc.freeze()


def wait_for(word: str) -> None:
    line = sys.stdin.readline().strip()
    if line != word:
        raise SystemExit(f"expected {word!r} on stdin, got {line!r}")


def stop_on_stdin(stop: Any) -> None:
    """In a daemon thread: call ``stop()`` when the parent says ``stop`` (or goes away)."""

    def watch() -> None:
        sys.stdin.readline()
        stop()

    threading.Thread(target=watch, daemon=True).start()


class Stamps:
    """Handler start times (service mode) and RSS samples at given job counts."""

    def __init__(self, keep: bool, rss_at: list[int]) -> None:
        self.keep = keep
        self.rss_at = set(rss_at)
        self.times: list[tuple[int, float]] = []
        self.samples: dict[int, int] = {}
        self.count = 0
        self.lock = threading.Lock()
        self.active = keep or bool(rss_at)

    def record(self, job_id: int) -> None:
        now = time.monotonic()
        with self.lock:
            self.count += 1
            if self.keep:
                self.times.append((job_id, now))
            if self.count in self.rss_at:
                self.samples[self.count] = hwm_kb()


# -- sa_jobqueue --------------------------------------------------------------


def run_sajq(args: argparse.Namespace) -> dict[str, Any]:
    from dataclasses import asdict

    from sqlalchemy import BigInteger, Column, MetaData, Table, create_engine, insert
    from sqlalchemy.orm import Session

    from sa_jobqueue import JobRepository, TaskRegistry, Worker
    from sa_jobqueue.default import Job

    concurrency = args.concurrency
    # Room for the worker's own connections (C + 1, plus a listener when it
    # has one) without ever waiting on the pool.
    # Behind a pooler in transaction mode without prepared statement support
    # (PgBouncer before 1.21), psycopg must not prepare statements.
    connect_args = {"prepare_threshold": None} if args.pooler else {}
    engine = create_engine(
        sqlalchemy_url(args.dsn), pool_size=concurrency + 2, max_overflow=8, connect_args=connect_args,
    )
    repo = JobRepository(Job)
    tasks = TaskRegistry()
    stamps = Stamps(args.service or args.record, [int(n) for n in args.rss_at.split(",") if n])
    ledger = Table(LEDGER, MetaData(), Column("job_id", BigInteger, primary_key=True))
    add_ledger_row = insert(ledger)

    if args.path == "a" and args.sleep:
        def bench(job: Any) -> None:
            time.sleep(args.sleep)  # an I/O-bound job: the thread waits
    elif args.path == "a":
        if stamps.active:
            def bench(job: Any) -> None:
                stamps.record(job.id)
        else:
            def bench(job: Any) -> None:
                pass
    else:
        def bench(job: Any, session: Session) -> None:  # type: ignore[misc]
            if stamps.active:
                stamps.record(job.id)
            session.execute(add_ledger_row, {"job_id": job.id})

    if args.path in ("g", "t"):  # grouped commits: path b's handler, its jobs sharing transactions (savepoints: t)
        if "group_commit" not in inspect.signature(tasks.register).parameters:
            raise SystemExit("this sa_jobqueue has no grouped commits (group_commit)")
        tasks.register(TASK, bench, group_commit=True)
    else:
        tasks.register(TASK, bench)
    params = inspect.signature(Worker).parameters
    options: dict[str, Any] = {
        "queues": [QUEUE], "concurrency": concurrency, "mode": "transaction" if args.path in ("c", "t") else "lease",
        "poll_interval": args.poll,
    }
    if "listen" in params and args.listen is not None:
        options["listen"] = args.listen == "on"
    if "batch_size" in params and args.batch_size:
        options["batch_size"] = args.batch_size
    worker = Worker(engine, repo, tasks, **options)

    warm = [engine.connect() for _ in range(concurrency + 1)]
    for connection in warm:
        connection.close()
    freeze_startup(args)
    say("ready")
    wait_for("go")
    if args.service:
        stop_on_stdin(worker.stop)
    cpu0, t0 = cpu_seconds(), time.perf_counter()
    result = worker.run(until_empty=not args.service)
    seconds, cpu = time.perf_counter() - t0, cpu_seconds() - cpu0
    engine.dispose()
    return {
        "seconds": seconds, "cpu": cpu, "hwm_kb": hwm_kb(), "result": asdict(result),
        "stamps": stamps.times, "samples": stamps.samples, "options": sorted(options),
    }


def run_sajq_async(args: argparse.Namespace) -> dict[str, Any]:
    """The asyncio worker: path a (an async def handler without session, batched
    completion), b (with the job's AsyncSession, one ledger row), c (b in
    transaction mode), g (b with ``group_commit=True``: lease mode, its jobs
    sharing transactions) or t (c with ``group_commit=True``), on ``--driver``;
    ``--sleep S``: each handler first awaits asyncio.sleep(S) (an I/O-bound job)."""
    import asyncio
    from dataclasses import asdict

    from sqlalchemy import BigInteger, Column, MetaData, Table, insert
    from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

    from sa_jobqueue import JobRepository, TaskRegistry
    from sa_jobqueue.aio import AsyncWorker
    from sa_jobqueue.default import Job

    concurrency, pause = args.concurrency, args.sleep
    url = sqlalchemy_url(args.dsn).set(drivername=f"postgresql+{args.driver}")
    sessions = min(concurrency, 16)  # jobs holding a session at once: the pool's size
    tasks = TaskRegistry()
    stamps = Stamps(args.service, [int(n) for n in args.rss_at.split(",") if n])
    ledger = Table(LEDGER, MetaData(), Column("job_id", BigInteger, primary_key=True))
    add_ledger_row = insert(ledger)

    if args.path == "a":
        async def bench(job: Any) -> None:
            if pause:
                await asyncio.sleep(pause)
            if stamps.active:
                stamps.record(job.id)
    else:
        async def bench(job: Any, session: AsyncSession) -> None:  # type: ignore[misc]
            if pause:
                await asyncio.sleep(pause)
            if stamps.active:
                stamps.record(job.id)
            await session.execute(add_ledger_row, {"job_id": job.id})

    if args.path in ("g", "t"):  # grouped commits: a transaction per group (g), a SAVEPOINT per group (t)
        if "group_commit" not in inspect.signature(tasks.register).parameters:
            raise SystemExit("this sa_jobqueue has no grouped commits (group_commit)")
        tasks.register(TASK, bench, group_commit=True)
    else:
        tasks.register(TASK, bench)
    options: dict[str, Any] = {"queues": [QUEUE], "concurrency": concurrency, "poll_interval": args.poll,
                               "mode": "transaction" if args.path in ("c", "t") else "lease"}
    if args.listen is not None:
        options["listen"] = args.listen == "on"
    if args.batch_size:
        options["batch_size"] = args.batch_size

    async def warm_up() -> None:  # the dialect initialized and the server warm, outside the timing
        engine = create_async_engine(url, pool_size=sessions)
        conns = [await engine.connect() for _ in range(sessions)]
        for conn in conns:
            await conn.close()
        await engine.dispose()

    async def drain() -> dict[str, Any]:
        engine = create_async_engine(url, pool_size=sessions, max_overflow=0)
        worker = AsyncWorker(engine, JobRepository(Job), tasks, **options)
        if args.service:
            stop_on_stdin(worker.stop)
        cpu0, t0 = cpu_seconds(), time.perf_counter()
        result = await worker.run(until_empty=not args.service, handle_signals=False)
        seconds, cpu = time.perf_counter() - t0, cpu_seconds() - cpu0
        await engine.dispose()
        return {"seconds": seconds, "cpu": cpu, "hwm_kb": hwm_kb(), "result": asdict(result),
                "stamps": stamps.times, "samples": stamps.samples, "options": sorted(options)}

    asyncio.run(warm_up())
    freeze_startup(args)
    say("ready")
    wait_for("go")
    return asyncio.run(drain())


def run_textbook_session(args: argparse.Namespace) -> dict[str, Any]:
    """The textbook loop with the ledger row, written with SQLAlchemy's
    ``Session`` on psycopg: C threads, each holding one connection, and per
    job a fresh Session on it that claims one job, writes its ledger row,
    deletes it and commits. What path (b) of the thread worker does, done
    naively on the same stack: its ratio to this loop is the worker's own
    cost, apart from the Session's.

    With ``--group N`` (the role ``grouped-session``), each Session claims up
    to N jobs at once (the batch loop's CTE, in the Session's transaction),
    writes their ledger rows one statement each, deletes them in one
    statement and commits: what grouped commits (paths g and t) do, done
    naively on the same stack."""
    from sqlalchemy import create_engine, text
    from sqlalchemy.orm import Session

    engine = create_engine(sqlalchemy_url(args.dsn), pool_size=args.concurrency, max_overflow=0)
    claim = text(TEXTBOOK_CLAIM.replace("%s", ":queue"))
    add_row, delete = text(LEDGER_INSERT.replace("%s", ":id")), text(TEXTBOOK_DELETE.replace("%s", ":id"))
    claim_group = text(BATCH_CLAIM.replace("= %s", "= :queue").replace("LIMIT %s", "LIMIT :limit"))
    delete_group = text(BATCH_DELETE.replace("%s", ":ids"))
    ids: list[list[int]] = [[] for _ in range(args.concurrency)]
    go, errors = threading.Event(), []
    connections = [engine.connect() for _ in range(args.concurrency)]  # made outside the timing

    def grouped(index: int) -> None:
        done, conn = ids[index], connections[index]
        go.wait()
        while True:
            with Session(conn) as session:
                rows = session.execute(claim_group, {"queue": QUEUE, "limit": args.group}).all()
                if not rows:
                    session.commit()
                    return
                for row in rows:
                    session.execute(add_row, {"id": row[0]})
                claimed = [row[0] for row in rows]
                session.execute(delete_group, {"ids": claimed})
                session.commit()
            done.extend(claimed)

    def loop(index: int) -> None:
        done, conn = ids[index], connections[index]
        go.wait()
        try:
            if args.group:
                grouped(index)
                return
            while True:
                with Session(conn) as session:
                    row = session.execute(claim, {"queue": QUEUE}).first()
                    if row is None:
                        session.commit()
                        return
                    session.execute(add_row, {"id": row[0]})
                    session.execute(delete, {"id": row[0]})
                    session.commit()
                done.append(row[0])
        except BaseException as exc:  # reported by the parent as a failure
            errors.append(exc)

    return _run_session_threads(loop, args.concurrency, go, errors, connections, engine, ids)


def _run_session_threads(loop: Any, concurrency: int, go: threading.Event, errors: list[BaseException],
                         connections: list[Any], engine: Any, ids: list[list[int]]) -> dict[str, Any]:
    """The measured part of a loop on SQLAlchemy's stack: ``loop(index)`` in ``concurrency``
    threads, started on ``go``; then the connections closed, the first error raised, the figures."""
    threads = [threading.Thread(target=loop, args=(i,)) for i in range(concurrency)]
    for thread in threads:
        thread.start()
    say("ready")
    wait_for("go")
    cpu0, t0 = cpu_seconds(), time.perf_counter()
    go.set()
    for thread in threads:
        thread.join()
    seconds, cpu = time.perf_counter() - t0, cpu_seconds() - cpu0
    for conn in connections:
        conn.close()
    engine.dispose()
    if errors:
        raise errors[0]
    return {"seconds": seconds, "cpu": cpu, "hwm_kb": hwm_kb(), "ids": [i for done in ids for i in done],
            "stamps": {}}


def run_textbook_async(args: argparse.Namespace) -> dict[str, Any]:
    """The textbook loop with the ledger row, written with SQLAlchemy's
    asyncio API on ``--driver``: C tasks, each holding one connection, and per
    job a fresh AsyncSession on it that claims one job, writes its ledger
    row, deletes it and commits. What path (b) of the asyncio worker does,
    done naively on the same stack: its ratio to this loop is the worker's
    own cost, apart from AsyncSession's and the async driver's."""
    import asyncio

    from sqlalchemy import text
    from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

    url = sqlalchemy_url(args.dsn).set(drivername=f"postgresql+{args.driver}")
    claim = text(TEXTBOOK_CLAIM.replace("%s", ":queue"))
    add_row, delete = text(LEDGER_INSERT.replace("%s", ":id")), text(TEXTBOOK_DELETE.replace("%s", ":id"))
    ids: list[list[int]] = [[] for _ in range(args.concurrency)]

    async def loop(engine: Any, index: int, go: asyncio.Event) -> None:
        done = ids[index]
        async with engine.connect() as conn:
            await go.wait()
            while True:
                async with AsyncSession(conn) as session:
                    row = (await session.execute(claim, {"queue": QUEUE})).first()
                    if row is None:
                        await session.commit()
                        return
                    await session.execute(add_row, {"id": row[0]})
                    await session.execute(delete, {"id": row[0]})
                    await session.commit()
                done.append(row[0])

    async def drain() -> dict[str, Any]:
        engine = create_async_engine(url, pool_size=args.concurrency, max_overflow=0)
        go = asyncio.Event()
        tasks = [asyncio.ensure_future(loop(engine, i, go)) for i in range(args.concurrency)]
        await asyncio.sleep(0.5)  # the connections made, outside the timing
        say("ready")
        await asyncio.to_thread(wait_for, "go")
        cpu0, t0 = cpu_seconds(), time.perf_counter()
        go.set()
        await asyncio.gather(*tasks)
        seconds, cpu = time.perf_counter() - t0, cpu_seconds() - cpu0
        await engine.dispose()
        return {"seconds": seconds, "cpu": cpu, "hwm_kb": hwm_kb(), "ids": [i for done in ids for i in done],
                "stamps": {}}

    return asyncio.run(drain())


def run_batch_session(args: argparse.Namespace) -> dict[str, Any]:
    """The raw batch loop written with SQLAlchemy's ORM on psycopg: C threads,
    each holding one autocommit connection, and per claim a fresh Session on
    it that claims up to 100 jobs with the batch loop's CTE (returning every
    column, loaded as instances of the model), runs each job's handler (it
    does nothing), deletes them in one statement and closes. What path (a) of
    the thread worker does (jobs handed to handlers as model instances,
    completed in batches), done naively on the same stack."""
    from sqlalchemy import create_engine, select, text
    from sqlalchemy.orm import Session

    from sa_jobqueue.default import Job

    engine = create_engine(sqlalchemy_url(args.dsn), pool_size=args.concurrency, max_overflow=0)
    claim = select(Job).from_statement(text(
        BATCH_CLAIM.replace("= %s", "= :queue").replace("LIMIT %s", "LIMIT :limit")
        .replace("RETURNING t.id, t.payload", "RETURNING t.*")))
    delete = text(BATCH_DELETE.replace("%s", ":ids"))
    ids: list[list[int]] = [[] for _ in range(args.concurrency)]
    go, errors = threading.Event(), []
    connections = [engine.connect().execution_options(isolation_level="AUTOCOMMIT")  # outside the timing
                   for _ in range(args.concurrency)]

    def handle(job: Any) -> None:
        pass

    def loop(index: int) -> None:
        done, conn = ids[index], connections[index]
        go.wait()
        try:
            while True:
                with Session(conn) as session:
                    jobs = session.scalars(claim, {"queue": QUEUE, "limit": BATCH}).all()
                    if not jobs:
                        return
                    for job in jobs:
                        handle(job)
                    claimed = [job.id for job in jobs]
                    session.execute(delete, {"ids": claimed})
                    session.commit()
                done.extend(claimed)
        except BaseException as exc:  # reported by the parent as a failure
            errors.append(exc)

    return _run_session_threads(loop, args.concurrency, go, errors, connections, engine, ids)


# -- the raw psycopg reference loops ----------------------------------------------


class Loops:
    """Threads of one raw loop; each thread owns a connection and records its ids."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.stop = threading.Event()
        self.go = threading.Event()
        self.ids: list[list[int]] = [[] for _ in range(args.concurrency)]
        self.stamps = Stamps(args.service, [])
        self.errors: list[BaseException] = []
        # Wake-up of the batch loop: a generation counter bumped on NOTIFY.
        self.wake = threading.Condition()
        self.generation = 0

    def connect(self, autocommit: bool) -> psycopg.Connection:
        return psycopg.connect(self.args.dsn, autocommit=autocommit)

    def guarded(self, body: Any, *args: Any) -> Any:
        def run() -> None:
            try:
                body(*args)
            except BaseException as exc:  # reported by the parent as a failure
                self.errors.append(exc)
                self.stop.set()
                with self.wake:
                    self.wake.notify_all()

        return run

    def handle(self, job_id: int, payload: Any) -> None:
        if self.stamps.active:
            self.stamps.record(job_id)

    # The article's loop: claim one row, run it, delete it, commit; per job.
    # With --ledger its handler writes the ledger row of paths b and c in the
    # job's transaction: the same work as theirs, done naively.
    def textbook(self, index: int, conn: psycopg.Connection) -> None:
        done = self.ids[index]
        ledger = self.args.ledger
        self.go.wait()
        with conn:
            while not self.stop.is_set():
                row = conn.execute(TEXTBOOK_CLAIM, (QUEUE,)).fetchone()
                if row is None:
                    conn.commit()
                    break
                self.handle(row[0], row[1])
                if ledger:
                    conn.execute(LEDGER_INSERT, (row[0],))
                conn.execute(TEXTBOOK_DELETE, (row[0],))
                conn.commit()
                done.append(row[0])

    # The careful loop: claim 100 with a CTE (autocommit: the claim commits at
    # once), run them, delete them all in one statement. Idle threads sleep
    # until a NOTIFY (or a 1 s poll).
    def batch(self, index: int, conn: psycopg.Connection) -> None:
        done = self.ids[index]
        self.go.wait()
        with conn:
            while not self.stop.is_set():
                seen = self.generation
                rows = conn.execute(BATCH_CLAIM, (QUEUE, BATCH)).fetchall()
                if not rows:
                    if not self.args.service:
                        break
                    with self.wake:
                        self.wake.wait_for(lambda seen=seen: self.generation != seen or self.stop.is_set(), 1.0)
                    continue
                ids = []
                for job_id, payload in rows:
                    self.handle(job_id, payload)
                    ids.append(job_id)
                conn.execute(BATCH_DELETE, (ids,))
                done.extend(ids)

    def listen(self, conn: psycopg.Connection) -> None:
        with conn:
            conn.execute(f"LISTEN {CHANNEL}")
            while not self.stop.is_set():
                for _ in conn.notifies(timeout=0.2, stop_after=1):
                    with self.wake:
                        self.generation += 1
                        self.wake.notify_all()

    def run(self, kind: str) -> dict[str, Any]:
        body = self.textbook if kind == "textbook" else self.batch
        autocommit = kind == "batch"
        threads = [
            threading.Thread(target=self.guarded(body, i, self.connect(autocommit)), name=f"{kind}-{i}")
            for i in range(self.args.concurrency)
        ]
        if kind == "batch":
            threads.append(threading.Thread(target=self.guarded(self.listen, self.connect(True)), daemon=True))
        for thread in threads:
            thread.start()
        say("ready")
        wait_for("go")
        if self.args.service:
            stop_on_stdin(self._stop)
        cpu0, t0 = cpu_seconds(), time.perf_counter()
        self.go.set()
        for thread in threads[: self.args.concurrency]:
            thread.join()
        seconds, cpu = time.perf_counter() - t0, cpu_seconds() - cpu0
        self._stop()
        if self.errors:
            raise self.errors[0]
        return {
            "seconds": seconds, "cpu": cpu, "hwm_kb": hwm_kb(),
            "ids": [i for ids in self.ids for i in ids], "stamps": self.stamps.times,
        }

    def _stop(self) -> None:
        self.stop.set()
        with self.wake:
            self.wake.notify_all()


# -- producers (latency) ---------------------------------------------------------


def produce(args: argparse.Namespace) -> dict[str, Any]:
    """Enqueue ``--jobs`` jobs ``--gap`` seconds apart, one transaction each;
    return (job id, monotonic time right after the commit returned) pairs."""
    commits: list[tuple[int, float]] = []
    if args.role == "produce-sajq":
        from sqlalchemy import create_engine
        from sqlalchemy.orm import Session

        from sa_jobqueue import JobRepository
        from sa_jobqueue.default import Job

        engine = create_engine(sqlalchemy_url(args.dsn))
        repo = JobRepository(Job)
        with engine.connect():
            pass

        def enqueue_one() -> int:
            with Session(engine) as session, session.begin():
                job_id = repo.enqueue(session, TASK, {}, queue=QUEUE).id
            return job_id
    else:
        from psycopg.types.json import Jsonb

        conn = psycopg.connect(args.dsn)

        def enqueue_one() -> int:
            row = conn.execute(RAW_INSERT, (TASK, QUEUE, Jsonb({}))).fetchone()
            conn.execute(f"NOTIFY {CHANNEL}")
            conn.commit()
            assert row is not None
            return int(row[0])

    say("ready")
    wait_for("go")
    start = time.monotonic()
    for n in range(args.jobs):
        job_id = enqueue_one()
        commits.append((job_id, time.monotonic()))
        pause = start + (n + 1) * args.gap - time.monotonic()
        if pause > 0:
            time.sleep(pause)
    return {"seconds": time.monotonic() - start, "cpu": cpu_seconds(), "hwm_kb": hwm_kb(), "commits": commits}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=["sajq", "sajq-async", "textbook", "textbook-session", "grouped-session",
                                         "textbook-async", "batch", "batch-session", "produce-sajq", "produce-raw"])
    parser.add_argument("dsn")
    parser.add_argument("--path", choices=["a", "b", "c", "g", "t"], default="a")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--service", action="store_true", help="run until 'stop' instead of until empty")
    parser.add_argument("--listen", choices=["on", "off"], default=None)
    parser.add_argument("--batch-size", type=int, default=0)
    parser.add_argument("--poll", type=float, default=1.0)
    parser.add_argument("--driver", choices=["psycopg", "asyncpg"], default="psycopg",
                        help="the driver of sajq-async and textbook-async")
    parser.add_argument("--sleep", type=float, default=0.0, help="seconds each handler waits (I/O-bound jobs)")
    parser.add_argument("--rss-at", default="", help="job counts at which to sample VmHWM")
    parser.add_argument("--record", action="store_true", help="sajq: report every handler run (id, time)")
    parser.add_argument("--freeze", action="store_true",
                        help="sajq, sajq-async: gc.freeze() before running, as the worker commands do")
    parser.add_argument("--pooler", action="store_true", help="sajq: through PgBouncer < 1.21 (no prepared statements)")
    parser.add_argument("--ledger", action="store_true", help="textbook: the handler writes the job's ledger row")
    parser.add_argument("--group", type=int, default=0, help="grouped-session: jobs per transaction")
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument("--gap", type=float, default=0.02)
    args = parser.parse_args()
    if args.role == "sajq":
        out = run_sajq(args)
    elif args.role == "sajq-async":
        out = run_sajq_async(args)
    elif args.role in ("textbook", "batch"):
        out = Loops(args).run(args.role)
    elif args.role in ("textbook-session", "grouped-session"):
        out = run_textbook_session(args)
    elif args.role == "textbook-async":
        out = run_textbook_async(args)
    elif args.role == "batch-session":
        out = run_batch_session(args)
    else:
        out = produce(args)
    say(json.dumps(out))


if __name__ == "__main__":
    main()
