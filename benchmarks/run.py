"""sa_jobqueue benchmark: throughput, latency and memory against raw psycopg loops.

::

    .venv/bin/python benchmarks/run.py                  # default: 3 runs, ~10 min on 2 cores
    .venv/bin/python benchmarks/run.py --quick          # smoke run, about a minute
    .venv/bin/python benchmarks/run.py --only drain,latency --runs 5
    DATABASE_URL=postgresql://postgres@127.0.0.1:5432/test .venv/bin/python benchmarks/run.py

Uses DATABASE_URL when set (it creates and drops databases of its own on
that server), otherwise an embedded PostgreSQL. Every workload gets a fresh
database cloned from a migrated template. Prints Markdown: each figure is
the median of ``--runs`` runs, with its ratio to the raw psycopg
reference loops of the same run (the article's textbook loop, the same
loop writing the handlers' ledger row, and a batch loop), then the
project's throughput targets with MET / MISSED. Each drain checks that
every job ran exactly once and the run fails (exit 1) otherwise.
See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import platform
import queue
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import psycopg  # noqa: E402
from common import (  # noqa: E402
    COPY_JOBS,
    LEDGER,
    QUEUE,
    RAW_INSERT,
    TABLE,
    ChildProcess,
    Databases,
    copy_jobs,
    core_version,
    libpq,
    server,
)
from psycopg.types.json import Jsonb  # noqa: E402

WORKLOADS = ("enqueue", "enqueue-async", "bulk", "textbook", "textbook-row", "textbook-session", "grouped-session",
             "batch", "batch-session", "drain-a",
             "drain-b", "drain-c",
             "drain-g", "drain-t", "drain-async",
             "latency", "io", "rss", "claim-scale")
GROUPS = {"drain": ("textbook", "textbook-row", "textbook-session", "grouped-session", "batch", "batch-session",
                   "drain-a", "drain-b",
                   "drain-c", "drain-g", "drain-t")}
# The raw loops; "textbook-row" is the textbook loop whose handler writes the ledger row of paths b, c, g
# and t in the job's transaction: the same work as theirs, done naively; "textbook-session" the same
# loop written with SQLAlchemy's Session (the same work done naively on path b's stack).
# "grouped-session" is that loop with GROUPED jobs per transaction (claimed at once, their rows written one
# statement each, deleted in one): grouped commits (paths g and t) done naively on the same stack. GROUPED
# is the size of path g's groups at C=4 and a batch size of 100 (sa_jobqueue.worker.group.group_sizes).
# "batch-session" is the batch loop written with SQLAlchemy's ORM (each claim's rows loaded as instances of
# the model, handed to a handler that does nothing, deleted at once): path (a) done naively on its stack.
RAW_LOOPS = ("textbook", "textbook-row", "textbook-session", "grouped-session", "batch", "batch-session")
GROUPED = 25
# The textbook loop with the ledger row written with SQLAlchemy's asyncio API, one per async driver
# (part of "drain-async"): path (b) of the asyncio worker against the same work done naively on its stack.
TEXTBOOK_ASYNC = "textbook-async"
# The paths whose handler writes the ledger row (checked after each drain, and compared with "textbook-row").
LEDGER_PATHS = ("b", "c", "g", "t")
PATHS = {
    "a": "lease + batched completion (handler without session)",
    "b": "lease + completion in the job's session (ledger row)",
    "c": "transaction mode (ledger row)",
    "g": "lease + grouped commits (path b's handler, group_commit=True)",
    "t": "transaction mode + grouped commits (a SAVEPOINT per group, not per job)",
}
NA = "n/a (not implemented)"


def has_group_commit() -> bool:
    """Whether the core under test has grouped commits."""
    from sa_jobqueue import TaskRegistry

    return "group_commit" in inspect.signature(TaskRegistry.register).parameters
TASK = "bench"


class BenchmarkError(RuntimeError):
    """A check failed: a job ran twice or never, a process failed."""


# -- child processes ---------------------------------------------------------------


class Child(ChildProcess):
    """One process of child.py, driven over stdin/stdout."""

    def __init__(self, argv: list[str], profile: Path | None = None) -> None:
        command = [sys.executable, str(HERE / "child.py"), *argv]
        if profile is not None:
            spy = Path(sys.executable).with_name("py-spy")
            command = [str(spy), "record", "--nonblocking", "-r", "200", "-f", "raw", "-o", str(profile),
                       "--", *command]
        self.argv = argv
        super().__init__(command)

    def _next(self, timeout: float) -> str:
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            self.kill()
            raise BenchmarkError(f"{self.argv[0]} process did not answer within {timeout:.0f} s") from None
        if line is None:
            code = self.proc.wait(10)
            raise BenchmarkError(f"{self.argv[0]} process exited with code {code} ({' '.join(self.argv)})")
        return line

    def ready(self, timeout: float = 60) -> Child:
        if self._next(timeout) != "ready":
            raise BenchmarkError(f"{self.argv[0]} process did not start")
        return self

    def result(self, timeout: float) -> dict[str, Any]:
        out = json.loads(self._next(timeout))
        self.proc.wait(30)
        return out  # type: ignore[no-any-return]


# -- measurements ----------------------------------------------------------------------


class Bench:
    def __init__(self, args: argparse.Namespace, dbs: Databases) -> None:
        self.args = args
        self.dbs = dbs
        from sa_jobqueue import Worker

        params = inspect.signature(Worker).parameters
        self.has_listen = "listen" in params
        self.has_batch_size = "batch_size" in params
        self.values: dict[str, list[float]] = defaultdict(list)  # figure -> one value per run
        self.extra: dict[str, list[float]] = defaultdict(list)  # worker CPU and RSS per drain
        self.seconds: dict[str, float] = defaultdict(float)  # wall time spent per workload
        self.plans: dict[str, list[str]] = {}  # EXPLAIN ANALYZE of the claim-scale scenarios, last run

    def timed(self, name: str, body: Callable[[], None]) -> None:
        started = time.monotonic()
        body()
        self.seconds[name] += time.monotonic() - started

    def wanted(self, workload: str) -> bool:
        return workload in self.args.only

    def profile(self, name: str) -> Path | None:
        if not self.args.profile:
            return None
        directory = Path(self.args.profile)
        directory.mkdir(parents=True, exist_ok=True)
        return directory / f"{name}.txt"

    # enqueue, one job per transaction --------------------------------------------

    def enqueue(self) -> None:
        from sqlalchemy import create_engine
        from sqlalchemy.orm import Session

        from sa_jobqueue import JobRepository
        from sa_jobqueue.default import Job

        count, warm = self.args.enqueue_jobs, 100
        with self.dbs.fresh() as url:
            engine = create_engine(url, pool_size=1)
            repo = JobRepository(Job)
            try:
                def one(n: int) -> None:
                    with Session(engine) as session, session.begin():
                        repo.enqueue(session, TASK, {"n": n}, queue=QUEUE)

                for n in range(warm):
                    one(n)
                started = time.perf_counter()
                for n in range(count):
                    one(n)
                self.values["enqueue"].append(count / (time.perf_counter() - started))
                outbox = self._outbox(engine, repo, count, warm)
            finally:
                engine.dispose()
            self._expect_rows(libpq(url), warm + count + outbox)
        with self.dbs.fresh() as url, psycopg.connect(libpq(url)) as conn:
            def raw(n: int) -> None:
                conn.execute(RAW_INSERT, (TASK, QUEUE, Jsonb({"n": n}))).fetchone()
                conn.commit()

            for n in range(warm):
                raw(n)
            started = time.perf_counter()
            for n in range(count):
                raw(n)
            self.values["enqueue-raw"].append(count / (time.perf_counter() - started))
            self._expect_rows(libpq(url), warm + count)

    def _outbox(self, engine: Any, repo: Any, count: int, warm: int) -> int:
        """What an enqueue adds to a transaction that writes a business row
        (the outbox case): the same loop without it, with it, and with the
        job's row written by a raw psycopg INSERT on the session's own
        connection instead (one round trip through the same driver, nothing
        of sa_jobqueue), interleaved in rounds, as wall and CPU microseconds
        per transaction. The enqueue's CPU beyond the raw INSERT's is what
        sa_jobqueue's own Python costs (its checks, the snapshot, the NOTIFY
        folded into the INSERT), the round trip's client work apart."""
        from sqlalchemy import BigInteger, Column, MetaData, Table, insert
        from sqlalchemy.orm import Session

        ledger = Table(LEDGER, MetaData(), Column("job_id", BigInteger, primary_key=True))
        add_row = insert(ledger)
        ids = iter(range(1, 10**9))
        raw_insert = RAW_INSERT.replace("RETURNING id", "RETURNING id, created_at, run_at")  # what enqueue reads

        def business(way: str) -> None:
            with Session(engine) as session, session.begin():
                n = next(ids)
                session.execute(add_row, {"job_id": n})
                if way == "enqueue":
                    repo.enqueue(session, TASK, {"n": n}, queue=QUEUE)
                elif way == "raw":
                    raw = session.connection().connection.dbapi_connection
                    raw.execute(raw_insert, (TASK, QUEUE, Jsonb({"n": n}))).fetchone()

        ways = ("none", "enqueue", "raw")
        for _ in range(warm):
            for way in ways:
                business(way)
        spent = {way: [0.0, 0.0] for way in ways}
        rounds = 10
        for _ in range(rounds):
            for way in ways:
                wall, cpu = time.perf_counter(), time.process_time()
                for _ in range(count // rounds):
                    business(way)
                spent[way][0] += time.perf_counter() - wall
                spent[way][1] += time.process_time() - cpu
        done = rounds * (count // rounds)
        self.values["outbox-wall-us"].append((spent["enqueue"][0] - spent["none"][0]) / done * 1e6)
        self.values["outbox-cpu-us"].append((spent["enqueue"][1] - spent["none"][1]) / done * 1e6)
        self.values["outbox-raw-cpu-us"].append((spent["raw"][1] - spent["none"][1]) / done * 1e6)
        self.values["outbox-python-us"].append((spent["enqueue"][1] - spent["raw"][1]) / done * 1e6)
        return 2 * (warm + done)  # the jobs it wrote: the enqueues' and the raw INSERTs'

    def enqueue_async(self) -> None:
        """The enqueue loop above on an AsyncSession, per async driver (cores with sa_jobqueue.aio)."""
        import aio

        if not aio.has_aio():
            return
        count, warm = self.args.enqueue_jobs, 100
        for driver in aio.DRIVERS:
            with self.dbs.fresh() as url:
                rate, plain = aio.enqueue_async(url, driver, count=count, warm=warm, task=TASK, queue=QUEUE)
                self._expect_rows(libpq(url), 2 * (warm + 10 * (count // 10)))
            self.values[f"enqueue-async-{driver}"].append(rate)
            self.values[f"enqueue-async-insert-{driver}"].append(plain)

    def bulk(self) -> None:
        from sqlalchemy import create_engine
        from sqlalchemy.orm import Session

        from sa_jobqueue import JobRepository, JobSpec
        from sa_jobqueue.default import Job

        count, chunk = self.args.jobs, self.args.chunk
        # enqueue_many, then enqueue_many_fast (cores that have it: the count without the jobs).
        verbs = [("bulk", "enqueue_many")] + ([("bulk-fast", "enqueue_many_fast")]
                                              if hasattr(JobRepository, "enqueue_many_fast") else [])
        for name, verb in verbs:
            with self.dbs.fresh() as url:
                engine = create_engine(url, pool_size=1)
                write = getattr(JobRepository(Job), verb)
                try:
                    with engine.connect():
                        pass
                    started = time.perf_counter()
                    for start in range(0, count, chunk):
                        specs = [JobSpec(TASK, {"n": n}, queue=QUEUE) for n in range(start, min(start + chunk, count))]
                        with Session(engine) as session, session.begin():
                            write(session, specs)
                    self.values[name].append(count / (time.perf_counter() - started))
                finally:
                    engine.dispose()
                self._expect_rows(libpq(url), count)
        with self.dbs.fresh() as url:
            self.values["bulk-orm"].append(self._bulk_orm(url, count, chunk))
            self._expect_rows(libpq(url), count)
        with self.dbs.fresh() as url, psycopg.connect(libpq(url)) as conn:
            started = time.perf_counter()
            for start in range(0, count, chunk):
                with conn.cursor() as cur, cur.copy(COPY_JOBS) as copy:
                    for n in range(start, min(start + chunk, count)):
                        copy.write_row((TASK, QUEUE, Jsonb({"n": n})))
                conn.commit()
            self.values["bulk-copy"].append(count / (time.perf_counter() - started))
            self._expect_rows(libpq(url), count)

    @staticmethod
    def _bulk_orm(url: Any, count: int, chunk: int) -> float:
        """The bulk enqueue's rows written naively on its stack: SQLAlchemy's ORM bulk INSERT with RETURNING
        the model (insertmanyvalues), each chunk's jobs coming back as instances, one transaction per chunk."""
        from sqlalchemy import create_engine, insert
        from sqlalchemy.orm import Session

        from sa_jobqueue.default import Job

        engine = create_engine(url, pool_size=1)
        add_jobs = insert(Job).returning(Job)
        try:
            with engine.connect():
                pass
            started = time.perf_counter()
            for start in range(0, count, chunk):
                rows = [{"task": TASK, "queue": QUEUE, "payload": {"n": n}}
                        for n in range(start, min(start + chunk, count))]
                with Session(engine) as session, session.begin():
                    session.scalars(add_jobs, rows).all()
            return count / (time.perf_counter() - started)
        finally:
            engine.dispose()

    def _expect_rows(self, dsn: str, count: int) -> None:
        with psycopg.connect(dsn) as conn:
            found = conn.execute(f"SELECT count(*) FROM {TABLE}").fetchone()[0]  # type: ignore[index]
        if found != count:
            raise BenchmarkError(f"enqueue wrote {found} rows, expected {count}")

    # drains --------------------------------------------------------------------------

    def drain(self, kind: str, concurrency: int) -> None:
        """kind: a raw loop (:data:`RAW_LOOPS`) or an execution path 'a', 'b', 'c', 'g', 't'."""
        if kind in RAW_LOOPS:
            argv = (["textbook", "--ledger"] if kind == "textbook-row"
                    else [kind, "--group", str(GROUPED)] if kind == "grouped-session" else [kind])
            self._drain([*argv, "--concurrency", str(concurrency)], kind, f"drain-{kind}-{concurrency}")
            return
        if kind in ("g", "t") and not has_group_commit():
            return
        argv = ["sajq", "--path", kind, "--concurrency", str(concurrency)]
        if self.args.batch_size:
            argv += ["--batch-size", str(self.args.batch_size)]
        if self.args.freeze:
            argv.append("--freeze")
        self._drain(argv, kind, f"drain-{kind}-{concurrency}", profile=True)

    def drain_async(self, path: str, driver: str, concurrency: int) -> None:
        """The asyncio worker on path 'a', 'b', 'c', 'g' or 't' (cores with sa_jobqueue.aio.AsyncWorker)."""
        import aio

        if path in ("g", "t") and not has_group_commit():
            return
        if aio.has_async_worker():
            argv = ["sajq-async", "--path", path, "--driver", driver, "--concurrency", str(concurrency)]
            if self.args.batch_size:  # as for the thread worker's paths
                argv += ["--batch-size", str(self.args.batch_size)]
            if self.args.freeze:
                argv.append("--freeze")
            self._drain(argv, path, f"drain-async-{path}-{driver}-{concurrency}", profile=True)

    def textbook_async(self, driver: str, concurrency: int) -> None:
        """The textbook loop writing the ledger row on SQLAlchemy's AsyncSession, through ``driver``."""
        argv = [TEXTBOOK_ASYNC, "--driver", driver, "--concurrency", str(concurrency)]
        self._drain(argv, TEXTBOOK_ASYNC, f"drain-{TEXTBOOK_ASYNC}-{driver}-{concurrency}")

    def io(self) -> None:
        """I/O-bound jobs (each waits 50 ms): the asyncio worker at 100 and 500 in
        flight, the thread worker at 16 and 64 threads (its best is reported)."""
        import aio

        count = self.args.io_jobs
        if aio.has_async_worker():
            for c in aio.IO_IN_FLIGHT:
                argv = ["sajq-async", "--path", "a", "--concurrency", str(c), "--sleep", str(aio.IO_WAIT)]
                self._drain(argv, "a", f"io-async-{c}", count=count)
        for threads in aio.IO_THREADS:
            argv = ["sajq", "--path", "a", "--concurrency", str(threads), "--sleep", str(aio.IO_WAIT)]
            self._drain(argv, "a", f"io-sync-{threads}", count=count)

    def _drain(self, argv: list[str], kind: str, name: str, *, count: int | None = None,
               profile: bool = False) -> None:
        """Drain ``count`` jobs (--jobs) with the child ``argv`` (its DSN inserted); record jobs/s under ``name``."""
        count = count or self.args.jobs
        with self.dbs.fresh() as url:
            dsn = libpq(url)
            ids = copy_jobs(dsn, count, TASK)
            child = Child([argv[0], dsn, *argv[1:]], self.profile(name) if profile else None)
            try:
                child.ready().send("go")
                out = child.result(self.args.timeout)
            finally:
                child.kill()
            self._check_drain(dsn, kind, ids, out, name)
        self.values[name].append(count / out["seconds"])
        self.extra[f"cpu-{name}"].append(out["cpu"] / out["seconds"])
        self.extra[f"rss-{name}"].append(out["hwm_kb"] / 1024)

    def _check_drain(self, dsn: str, kind: str, ids: list[int], out: dict[str, Any], label: str) -> None:
        problems = []
        with psycopg.connect(dsn) as conn:
            left = conn.execute(f"SELECT status, count(*) FROM {TABLE} GROUP BY status").fetchall()
            ledger = [r[0] for r in conn.execute(f"SELECT job_id FROM {LEDGER}")]
        if left:
            problems.append(f"jobs left in the table: {dict(left)}")
        if kind in (*RAW_LOOPS, TEXTBOOK_ASYNC):
            done = out["ids"]
            if len(done) != len(set(done)):
                problems.append(f"{len(done) - len(set(done))} job(s) ran more than once")
            if set(done) != set(ids):
                problems.append(f"{len(set(ids) - set(done))} job(s) never ran")
        else:
            result = out["result"]
            if result["completed"] != len(ids) or result["retried"] or result["dead"] or result["lost"]:
                problems.append(f"WorkerResult {result} for {len(ids)} jobs")
        writes_ledger = kind in ("textbook-row", "textbook-session", "grouped-session", TEXTBOOK_ASYNC, *LEDGER_PATHS)
        if writes_ledger and (len(ledger) != len(ids) or set(ledger) != set(ids)):
            problems.append(f"{len(ledger)} ledger rows for {len(ids)} jobs ({len(set(ids) - set(ledger))} missing)")
        if problems:
            raise BenchmarkError(f"{label}: exactly-once check FAILED: " + "; ".join(problems))

    # latency ---------------------------------------------------------------------------

    def latency(self, kind: str) -> None:
        """kind 'sajq' (path a, listen on), 'sajq-async' (the same in the asyncio
        worker) or 'batch' (the raw batch loop)."""
        import aio

        if (kind == "sajq" and not self.has_listen) or (kind == "sajq-async" and not aio.has_async_worker()):
            return
        with self.dbs.fresh() as url:
            dsn = libpq(url)
            if kind in ("sajq", "sajq-async"):
                worker = Child([kind, dsn, "--path", "a", "--concurrency", "4", "--service", "--listen", "on",
                                "--poll", "1.0"], self.profile(f"latency-{kind}"))
                producer_role = "produce-sajq"
            else:
                worker = Child(["batch", dsn, "--concurrency", "4", "--service"])
                producer_role = "produce-raw"
            producer = None
            try:
                worker.ready().send("go")
                time.sleep(1.5)  # idle: the worker has backed off to its poll interval
                producer = Child([producer_role, dsn, "--jobs", str(self.args.latency_jobs), "--gap", "0.02"])
                producer.ready().send("go")
                commits = producer.result(60 + self.args.latency_jobs * 0.1)["commits"]
                deadline = time.monotonic() + 30
                with psycopg.connect(dsn, autocommit=True) as conn:
                    while conn.execute(f"SELECT count(*) FROM {TABLE}").fetchone()[0]:  # type: ignore[index]
                        if time.monotonic() > deadline:
                            raise BenchmarkError(f"latency {kind}: jobs not finished 30 s after the last enqueue")
                        time.sleep(0.05)
                worker.send("stop")
                out = worker.result(60)
            finally:
                worker.kill()
                if producer is not None:
                    producer.kill()
        started = {}
        for job_id, at in out["stamps"]:
            if job_id in started:
                raise BenchmarkError(f"latency {kind}: job {job_id} started twice")
            started[job_id] = at
        missing = [job_id for job_id, _ in commits if job_id not in started]
        if missing or len(started) != len(commits):
            raise BenchmarkError(f"latency {kind}: {len(missing)} job(s) never started")
        waits = [(started[job_id] - at) * 1000 for job_id, at in commits]
        cuts = statistics.quantiles(waits, n=100, method="inclusive")
        for label, value in (("p50", cuts[49]), ("p95", cuts[94]), ("p99", cuts[98])):
            self.values[f"latency-{kind}-{label}"].append(value)

    # claims at scale ---------------------------------------------------------------------

    def claim_scale(self) -> None:
        """A claim of 10 from a small queue, alone and beside a backlog (benchmarks/claims.py)."""
        import claims

        from sa_jobqueue.default import Job

        for scenario in claims.SCENARIOS:
            with self.dbs.fresh() as url:
                dsn = libpq(url)
                claims.load(dsn, TABLE, scenario, self.args.claim_backlog)
                for mode, ms in claims.time_claims(url, self.args.claim_samples).items():
                    self.values[f"claim-{scenario}-{mode}"].append(ms)
                if scenario != "small":
                    for mode in claims.MODES:
                        plan, _ = claims.explain_claim(dsn, Job, [claims.SMALL_QUEUE], claims.LIMIT, mode, "TEXT")
                        self.plans[f"{scenario}, plan_cache_mode = {mode}"] = plan

    # memory ------------------------------------------------------------------------------

    def rss(self) -> None:
        first, total = self.args.rss_jobs
        with self.dbs.fresh() as url:
            dsn = libpq(url)
            ids = copy_jobs(dsn, total, TASK)
            child = Child(["sajq", dsn, "--path", "a", "--concurrency", "4", "--rss-at", f"{first},{total}"])
            try:
                child.ready().send("go")
                out = child.result(self.args.timeout * max(1, total // max(1, self.args.jobs)))
            finally:
                child.kill()
            self._check_drain(dsn, "a", ids, out, f"rss drain of {total:,} jobs")
        samples = {int(k): v / 1024 for k, v in out["samples"].items()}
        self.values["rss-first"].append(samples[first])
        self.values["rss-total"].append(samples[total])
        self.values["rss-rate"].append(total / out["seconds"])


# -- the run ---------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    started = time.monotonic()
    import sa_jobqueue

    with server() as (server_url, origin):
        with psycopg.connect(libpq(server_url), autocommit=True) as conn:
            version = conn.execute("SHOW server_version").fetchone()[0]  # type: ignore[index]
        dbs = Databases(server_url)
        try:
            bench = Bench(args, dbs)
            for number in range(1, args.runs + 1):
                log(f"run {number}/{args.runs}")
                if bench.wanted("enqueue"):
                    bench.timed("enqueue", bench.enqueue)
                if bench.wanted("enqueue-async"):
                    bench.timed("enqueue-async", bench.enqueue_async)
                if bench.wanted("bulk"):
                    bench.timed("bulk", bench.bulk)
                for concurrency in args.concurrency:
                    for kind in (*RAW_LOOPS, "a", "b", "c", "g", "t"):
                        workload = kind if kind in RAW_LOOPS else f"drain-{kind}"
                        if bench.wanted(workload):
                            log(f"  drain {kind} C={concurrency}")
                            bench.timed(workload, lambda k=kind, c=concurrency: bench.drain(k, c))
                    if bench.wanted("drain-async"):
                        for driver in ("psycopg", "asyncpg"):
                            log(f"  drain {TEXTBOOK_ASYNC} {driver} C={concurrency}")
                            bench.timed("drain-async", lambda d=driver, c=concurrency: bench.textbook_async(d, c))
                        for path, driver in [(p, d) for p in ("a", "b", "c", "g", "t")
                                             for d in ("psycopg", "asyncpg")]:
                            log(f"  drain async {path} {driver} C={concurrency}")
                            bench.timed("drain-async", lambda p=path, d=driver, c=concurrency:
                                        bench.drain_async(p, d, c))
                if bench.wanted("io"):
                    log("  I/O-bound jobs")
                    bench.timed("io", bench.io)
                if bench.wanted("latency"):
                    log("  latency")
                    bench.timed("latency", lambda: bench.latency("batch"))
                    bench.timed("latency", lambda: bench.latency("sajq"))
                    bench.timed("latency", lambda: bench.latency("sajq-async"))
                if bench.wanted("claim-scale"):
                    log(f"  claims beside a backlog of {args.claim_backlog:,} jobs")
                    bench.timed("claim-scale", bench.claim_scale)
            if bench.wanted("rss"):
                log(f"rss: {args.rss_jobs[1]:,} jobs")
                bench.timed("rss", bench.rss)
        finally:
            dbs.close()
    elapsed = time.monotonic() - started
    print(report(args, bench, version, origin, sa_jobqueue.__file__, elapsed))
    if args.json:
        # Every run's figure, not only the medians: benchmarks/compare.py pairs them.
        Path(args.json).write_text(json.dumps({
            "core": core_version(), "server": version, "origin": origin, "runs": args.runs,
            "values": bench.values, "extra": bench.extra,
        }, indent=1))
    return 0


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# -- the report --------------------------------------------------------------------------------


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def fmt(value: float | None, unit: str) -> str:
    if value is None:
        return "—"
    if unit == "jobs/s":
        return f"{value:,.0f}"
    if unit.startswith("µs"):
        return f"{value:,.0f}"
    if unit in ("ms", "MB"):
        return f"{value:,.1f}" if value < 100 else f"{value:,.0f}"
    return f"{value:.2f}"


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def rx(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}x"


def report(args: argparse.Namespace, bench: Bench, version: str, origin: str, core: str, elapsed: float) -> str:
    m = {name: median(values) for name, values in bench.values.items()}
    e = {name: median(values) for name, values in bench.extra.items()}
    out: list[str] = []
    w = out.append
    w("## sa_jobqueue benchmark")
    w("")
    w(f"- date: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC; total time {elapsed / 60:.1f} min "
      f"({', '.join(f'{k} {v:.0f} s' for k, v in bench.seconds.items())})")
    w(f"- command: `{' '.join(['python', *sys.argv])}`")
    w(f"- sa_jobqueue {core_version()} ({Path(core).parent}); PostgreSQL {version} ({origin}); "
      f"Python {platform.python_version()}; {os.cpu_count()} CPUs")
    w(f"- each figure is the median of {args.runs} run(s); drains of {args.jobs:,} no-op jobs; "
      f"concurrency = threads in one process; Worker options detected: "
      f"listen={'yes' if bench.has_listen else 'no'}, batch_size={'yes' if bench.has_batch_size else 'no'}")
    w("")
    w("| workload | C | median | unit | x textbook loop | x raw batch loop | x own raw baseline |")
    w("| --- | --- | ---: | --- | ---: | ---: | ---: |")

    def row(label: str, conc: str, value: float | None, unit: str, tb: float | None, bt: float | None,
            own: str = "—", missing: str | None = None, lower_is_better: bool = False) -> None:
        if value is None and missing:
            w(f"| {label} | {conc} | {missing} | {unit} | — | — | — |")
            return
        tb_r, bt_r = ratio(value, tb), ratio(value, bt)
        w(f"| {label} | {conc} | {fmt(value, unit)} | {unit} | {rx(tb_r)} | {rx(bt_r)} | {own} |")

    drains = [("textbook", "raw textbook loop (claim 1, delete, commit per job)"),
              ("textbook-row", "raw textbook loop writing the ledger row in the job's transaction"),
              ("textbook-session", "textbook loop writing the ledger row on SQLAlchemy's Session (a connection per "
               "thread, a session per job)"),
              ("grouped-session", f"the same loop with {GROUPED} jobs per transaction (claimed at once, a ledger row "
               "each, deleted at once)"),
              ("batch", "raw batch loop (claim 100 per CTE, delete by ANY, LISTEN)"),
              ("batch-session", "the batch loop on SQLAlchemy's ORM (each claim's rows loaded as model instances, a "
               "session per claim)")]
    drains += [(p, f"drain ({p}) {text}") for p, text in PATHS.items()]
    for kind, label in drains:
        for c in args.concurrency:
            name = f"drain-{kind}-{c}"
            writes_row = kind in (*LEDGER_PATHS, "textbook-session", "grouped-session")
            same_work = ratio(m.get(name), m.get(f"drain-textbook-row-{c}")) if writes_row else None
            own = f"{rx(same_work)} the textbook loop writing the row" if same_work is not None else "—"
            if kind == "b":
                own += f", {rx(ratio(m.get(name), m.get(f'drain-textbook-session-{c}')))} the Session textbook loop"
            if kind in ("g", "t"):
                own += f", {rx(ratio(m.get(name), m.get(f'drain-grouped-session-{c}')))} the grouped Session loop"
            if kind == "a":
                own = f"{rx(ratio(m.get(name), m.get(f'drain-batch-session-{c}')))} the batch loop on the ORM"
            row(label, str(c), m.get(name), "jobs/s", m.get(f"drain-textbook-{c}"), m.get(f"drain-batch-{c}"), own)
    if bench.wanted("drain-async"):
        for driver in ("psycopg", "asyncpg"):
            for c in args.concurrency:
                name = f"drain-{TEXTBOOK_ASYNC}-{driver}-{c}"
                row(f"textbook loop writing the ledger row on SQLAlchemy's AsyncSession ({driver}, a connection per "
                    "task, a session per job)", str(c), m.get(name), "jobs/s", m.get(f"drain-textbook-{c}"),
                    m.get(f"drain-batch-{c}"),
                    f"{rx(ratio(m.get(name), m.get(f'drain-textbook-row-{c}')))} the textbook loop writing the row")
        for path, text in (("a", "async def handler without session"),
                           ("b", "async def handler, ledger row in the job's AsyncSession"),
                           ("c", "transaction mode, the same ledger handler"),
                           ("g", "lease mode, path (b)'s handler with group_commit=True"),
                           ("t", "transaction mode, the same handler with group_commit=True")):
            for driver in ("psycopg", "asyncpg"):
                for c in args.concurrency:
                    name = f"drain-async-{path}-{driver}-{c}"
                    own = f"{rx(ratio(m.get(name), m.get(f'drain-{path}-{c}')))} the thread worker's"
                    if path == "b":
                        own += (f", {rx(ratio(m.get(name), m.get(f'drain-{TEXTBOOK_ASYNC}-{driver}-{c}')))} the "
                                "AsyncSession textbook loop")
                    row(f"drain ({path}) asyncio worker on {driver}: {text}", str(c), m.get(name), "jobs/s",
                        m.get(f"drain-textbook-{c}"), m.get(f"drain-batch-{c}"), own, missing=NA)
    if bench.wanted("io"):
        best = max((v for k, v in m.items() if k.startswith("io-sync-") and v is not None), default=None)
        for c in (100, 500):
            name = f"io-async-{c}"
            row("I/O-bound jobs (each awaits 50 ms), asyncio worker on psycopg", str(c), m.get(name), "jobs/s", None,
                None, f"{rx(ratio(m.get(name), best))} the thread worker's best", missing=NA)
        for threads in (16, 64):
            name = f"io-sync-{threads}"
            row("I/O-bound jobs (each sleeps 50 ms), thread worker", str(threads), m.get(name), "jobs/s", None, None,
                f"{rx(ratio(m.get(name), best))} its best")
    c1 = str(args.concurrency[0])
    tb1, bt1 = m.get(f"drain-textbook-{c1}"), m.get(f"drain-batch-{c1}")
    row("enqueue, one job per transaction (Session + enqueue)", "1", m.get("enqueue"), "jobs/s", tb1, bt1,
        f"{rx(ratio(m.get('enqueue'), m.get('enqueue-raw')))} raw INSERT loop")
    row("raw psycopg INSERT loop, one commit per job", "1", m.get("enqueue-raw"), "jobs/s", tb1, bt1, "1.00x")
    row("enqueue added to a transaction writing a business row: wall", "1", m.get("outbox-wall-us"),
        "µs per transaction", None, None)
    row("enqueue added to a transaction writing a business row: CPU (Python, libpq, kernel)", "1",
        m.get("outbox-cpu-us"),
        "µs per transaction", None, None)
    row("a raw psycopg INSERT of the job's row added to the same transaction: CPU (one round trip)", "1",
        m.get("outbox-raw-cpu-us"), "µs per transaction", None, None)
    row("enqueue's CPU beyond that raw INSERT's: sa_jobqueue's own Python", "1", m.get("outbox-python-us"),
        "µs per transaction", None, None)
    if bench.wanted("enqueue-async"):
        for driver in ("psycopg", "asyncpg"):
            rate = m.get(f"enqueue-async-{driver}")
            row(f"enqueue, one job per transaction (AsyncSession on {driver} + enqueue)", "1", rate, "jobs/s", tb1,
                bt1, f"{rx(ratio(rate, m.get('enqueue-raw')))} raw INSERT loop, "
                f"{rx(ratio(rate, m.get('enqueue')))} the Session's, "
                f"{rx(ratio(rate, m.get(f'enqueue-async-insert-{driver}')))} the plain INSERT's below", missing=NA)
            plain = m.get(f"enqueue-async-insert-{driver}")
            row(f"the same loop writing the job's row with a plain Core INSERT (AsyncSession on {driver})", "1",
                plain, "jobs/s", tb1, bt1, f"{rx(ratio(plain, m.get('enqueue-raw')))} raw INSERT loop", missing=NA)
    row(f"bulk enqueue (enqueue_many, chunks of {args.chunk:,})", "1", m.get("bulk"), "jobs/s", tb1, bt1,
        f"{rx(ratio(m.get('bulk'), m.get('bulk-copy')))} raw COPY")
    if bench.wanted("bulk"):
        row(f"bulk enqueue, the count only (enqueue_many_fast, chunks of {args.chunk:,})", "1", m.get("bulk-fast"),
            "jobs/s", tb1, bt1, f"{rx(ratio(m.get('bulk-fast'), m.get('bulk-copy')))} raw COPY, "
            f"{rx(ratio(m.get('bulk-fast'), m.get('bulk')))} enqueue_many's", missing=NA)
    if bench.wanted("bulk"):
        row(f"the same rows by SQLAlchemy's ORM bulk INSERT ... RETURNING the model (chunks of {args.chunk:,})", "1",
            m.get("bulk-orm"), "jobs/s", tb1, bt1, f"{rx(ratio(m.get('bulk-orm'), m.get('bulk-copy')))} raw COPY, "
            f"{rx(ratio(m.get('bulk'), m.get('bulk-orm')))} in enqueue_many's favour", missing=NA)
    row(f"raw COPY (chunks of {args.chunk:,})", "1", m.get("bulk-copy"), "jobs/s", tb1, bt1, "1.00x")
    for p in ("p50", "p95", "p99"):
        raw = m.get(f"latency-batch-{p}")
        sajq = m.get(f"latency-sajq-{p}")
        if bench.wanted("latency"):
            row(f"latency {p}, enqueue commit to handler start (path a, listen on)", "4", sajq, "ms", None, raw,
                missing=NA if not bench.has_listen else None, lower_is_better=True)
            row(f"latency {p}, the same in the asyncio worker (psycopg)", "4", m.get(f"latency-sajq-async-{p}"),
                "ms", None, raw, missing=NA, lower_is_better=True)
            row(f"latency {p}, raw batch loop with LISTEN/NOTIFY", "4", raw, "ms", None, raw)
    if bench.wanted("rss"):
        first, total = args.rss_jobs
        tb_rss, bt_rss = e.get("rss-drain-textbook-4"), e.get("rss-drain-batch-4")
        row(f"worker peak RSS after {first:,} jobs (path a)", "4", m.get("rss-first"), "MB", tb_rss, bt_rss)
        row(f"worker peak RSS after {total:,} jobs (path a)", "4", m.get("rss-total"), "MB", tb_rss, bt_rss,
            f"{rx(ratio(m.get('rss-total'), m.get('rss-first')))} the {first:,}-job figure")
    if bench.wanted("claim-scale"):
        import claims

        for scenario, text in claims.SCENARIOS.items():
            for mode in claims.MODES:
                value = m.get(f"claim-{scenario}-{mode}")
                alone = m.get(f"claim-small-{mode}")
                row(f"claim of {claims.LIMIT} from a small queue: {text}; plan_cache_mode = {mode} "
                    f"(backlog {args.claim_backlog:,})", "1", value, "ms", None, None,
                    f"{rx(ratio(value, alone))} the small table's", lower_is_better=True)
    w("")
    w("Ratios: drains against the reference loops at the same concurrency; enqueue and bulk against the loops "
      f"at C={c1} (how their rate compares with what one connection drains); latency against the raw batch "
      "loop's (above 1 = slower); RSS against the reference loops' peak RSS in their C=4 drains.")

    # worker process cost per drain
    if any(k.startswith("cpu-") for k in e):
        w("")
        w("Worker process during the drains (median): CPU cores used (user+system CPU seconds / wall seconds) "
          "and peak RSS.")
        w("")
        w("| drain | " + " | ".join(f"C={c} cores | C={c} MB" for c in args.concurrency) + " |")
        w("| --- | " + " | ".join("---: | ---:" for _ in args.concurrency) + " |")
        for kind, label in drains:
            cells = []
            for c in args.concurrency:
                cells += [fmt(e.get(f"cpu-drain-{kind}-{c}"), "x"), fmt(e.get(f"rss-drain-{kind}-{c}"), "MB")]
            if any(cell != "—" for cell in cells):
                w(f"| {label} | " + " | ".join(cells) + " |")

    w("")
    w("### Targets")
    w("")
    w("| workload | target | measured | verdict |")
    w("| --- | --- | ---: | --- |")

    def target(label: str, goal: str, value: float | None, ok: Callable[[float], bool], missing: str = "—",
               shown: str | None = None) -> None:
        if value is None:
            w(f"| {label} | {goal} | {missing} | — |")
        else:
            w(f"| {label} | {goal} | {shown or rx(value)} | {'MET' if ok(value) else 'MISSED'} |")

    # The targets of issue 11 ("the flagship paths at the database's speed"), numbered as there.
    target("1. drain, handler with the job's session (path b), C=4", ">= 1.0x the textbook loop",
           ratio(m.get("drain-b-4"), m.get("drain-textbook-4")), lambda v: v >= 1.0)
    # Beside it, not a target of its own: the same work (the row written in the job's transaction), done naively.
    target("1. (beside it) path b against the textbook loop writing the same row, C=4", ">= 1.0x that loop",
           ratio(m.get("drain-b-4"), m.get("drain-textbook-row-4")), lambda v: v >= 1.0)
    target("1. (beside it) path b against the textbook loop on SQLAlchemy's Session, C=4", ">= 1.0x that loop",
           ratio(m.get("drain-b-4"), m.get("drain-textbook-session-4")), lambda v: v >= 1.0)
    target("2. drain, grouped commits (path g), C=4", ">= 3x the textbook loop",
           ratio(m.get("drain-g-4"), m.get("drain-textbook-4")), lambda v: v >= 3)
    target("2. drain, transaction mode in batches, grouped commits (path t), C=4", ">= 3x the textbook loop",
           ratio(m.get("drain-t-4"), m.get("drain-textbook-4")), lambda v: v >= 3)
    # Beside them: grouped commits done naively on the same stack (the grouped Session loop).
    for path in ("g", "t"):
        target(f"2. (beside it) path {path} against the grouped loop on SQLAlchemy's Session, C=4", ">= 1.0x that loop",
               ratio(m.get(f"drain-{path}-4"), m.get("drain-grouped-session-4")), lambda v: v >= 1.0)
    target("2. (beside it) the grouped loop on SQLAlchemy's Session itself, C=4", ">= 3x the textbook loop",
           ratio(m.get("drain-grouped-session-4"), m.get("drain-textbook-4")), lambda v: v >= 3)
    target("3. drain, no-session handler, batched completion (path a), C=4", ">= 0.5x the raw batch loop",
           ratio(m.get("drain-a-4"), m.get("drain-batch-4")), lambda v: v >= 0.5)
    # Beside it: the batch loop done naively on the same stack (model instances loaded by SQLAlchemy's ORM).
    target("3. (beside it) path a against the batch loop on SQLAlchemy's ORM, C=4", ">= 1.0x that loop",
           ratio(m.get("drain-a-4"), m.get("drain-batch-session-4")), lambda v: v >= 1.0)
    target("3. (beside it) the batch loop on SQLAlchemy's ORM itself, C=4", ">= 0.5x the raw batch loop",
           ratio(m.get("drain-batch-session-4"), m.get("drain-batch-4")), lambda v: v >= 0.5)
    target("4. enqueue, one job per transaction", ">= 0.6x the raw INSERT loop",
           ratio(m.get("enqueue"), m.get("enqueue-raw")), lambda v: v >= 0.6)
    target("4. enqueue in a transaction writing a business row: Python beyond its one round trip",
           "about 100 µs of Python", m.get("outbox-python-us"), lambda v: v <= 120,
           shown=None if m.get("outbox-python-us") is None else f"{m['outbox-python-us']:.0f} µs")
    target("5. bulk enqueue", ">= 0.6x raw COPY", ratio(m.get("bulk"), m.get("bulk-copy")), lambda v: v >= 0.6)
    target("5. bulk enqueue, the count only (enqueue_many_fast)", ">= 0.6x raw COPY",
           ratio(m.get("bulk-fast"), m.get("bulk-copy")), lambda v: v >= 0.6)
    # Beside it: the jobs written and returned as model instances naively on the same stack (the ORM's bulk INSERT).
    target("5. (beside it) enqueue_many against the ORM's bulk INSERT ... RETURNING the model", ">= 1.0x that",
           ratio(m.get("bulk"), m.get("bulk-orm")), lambda v: v >= 1.0)
    target("5. (beside it) the ORM's bulk INSERT ... RETURNING the model itself", ">= 0.6x raw COPY",
           ratio(m.get("bulk-orm"), m.get("bulk-copy")), lambda v: v >= 0.6)
    lat_missing = NA if bench.wanted("latency") and not bench.has_listen else "—"
    target("6. latency p50", "<= 1.3x the raw batch loop's",
           ratio(m.get("latency-sajq-p50"), m.get("latency-batch-p50")), lambda v: v <= 1.3, lat_missing)
    target("6. latency p99", "<= 2x the raw batch loop's",
           ratio(m.get("latency-sajq-p99"), m.get("latency-batch-p99")), lambda v: v <= 2, lat_missing)
    for driver in ("psycopg", "asyncpg"):
        target(f"9. asyncio drain, handler with the job's AsyncSession ({driver}), C=4", ">= 1.0x the textbook loop",
               ratio(m.get(f"drain-async-b-{driver}-4"), m.get("drain-textbook-4")), lambda v: v >= 1.0)
        # Beside it, not a target of its own: the same work done naively on the same stack (AsyncSession, driver).
        target(f"9. (beside it) the same against the textbook loop on an AsyncSession ({driver}), C=4",
               ">= 1.0x that loop",
               ratio(m.get(f"drain-async-b-{driver}-4"), m.get(f"drain-{TEXTBOOK_ASYNC}-{driver}-4")),
               lambda v: v >= 1.0)
        target(f"9. asyncio drain, transaction mode, grouped commits ({driver}), C=4", ">= 3x the textbook loop",
               ratio(m.get(f"drain-async-t-{driver}-4"), m.get("drain-textbook-4")), lambda v: v >= 3)
        target(f"9. enqueue on an AsyncSession ({driver})", ">= 0.6x the raw INSERT loop",
               ratio(m.get(f"enqueue-async-{driver}"), m.get("enqueue-raw")), lambda v: v >= 0.6)
        # Beside it: the same row written naively on the same stack (an AsyncSession, a Core INSERT).
        target(f"9. (beside it) enqueue against a plain Core INSERT on an AsyncSession ({driver})",
               ">= 1.0x that loop",
               ratio(m.get(f"enqueue-async-{driver}"), m.get(f"enqueue-async-insert-{driver}")), lambda v: v >= 1.0)
    growth = ratio(m.get("rss-total"), m.get("rss-first"))
    if bench.wanted("rss"):
        first, total = args.rss_jobs
        target(f"8. worker RSS, {total:,} vs {first:,} jobs", "grows < 10%",
               None if growth is None else growth - 1, lambda v: v < 0.10,
               shown=None if growth is None else f"{(growth - 1) * 100:+.1f}%")
    else:
        target("8. worker RSS, 100,000 vs 10,000 jobs", "grows < 10%", None, lambda v: True)
    if bench.wanted("claim-scale"):
        for scenario in ("other-queue", "scheduled"):
            for mode in ("auto", "force_generic_plan"):
                target(f"7. claim from a small queue, {scenario} backlog of {args.claim_backlog:,}, {mode}",
                       "<= 2x the same claim on the small table alone",
                       ratio(m.get(f"claim-{scenario}-{mode}"), m.get(f"claim-small-{mode}")), lambda v: v <= 2)
    if bench.plans:
        w("")
        w("### Claim plans (EXPLAIN ANALYZE, BUFFERS; last run)")
        for label, plan in bench.plans.items():
            w("")
            w(f"<details><summary>{label}</summary>")
            w("")
            w("```")
            out.extend(plan)
            w("```")
            w("")
            w("</details>")
    return "\n".join(out)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--runs", type=int, default=None, help="runs per figure (median); default 3, quick 1")
    parser.add_argument("--quick", action="store_true", help="smoke mode: small counts, one run (~1 min)")
    parser.add_argument("--only", default="", help=f"comma list of {', '.join(WORKLOADS)} or 'drain'")
    parser.add_argument("--jobs", type=int, default=None, help="jobs per drain and bulk enqueue (20,000)")
    parser.add_argument("--enqueue-jobs", type=int, default=None, help="jobs of the enqueue loops (2,000)")
    parser.add_argument("--chunk", type=int, default=5_000, help="jobs per bulk-enqueue chunk (5,000)")
    parser.add_argument("--concurrency", default="1,4,16", help="drain concurrencies (threads), default 1,4,16")
    parser.add_argument("--latency-jobs", type=int, default=None, help="jobs the producer enqueues (200)")
    parser.add_argument("--rss-jobs", default=None, help="FIRST,TOTAL job counts of the RSS drain (10000,100000)")
    parser.add_argument("--claim-backlog", type=int, default=None,
                        help="jobs of the claim-scale backlogs (1,000,000, quick 20,000)")
    parser.add_argument("--claim-samples", type=int, default=None, help="claims timed per scenario (200, quick 30)")
    parser.add_argument("--batch-size", type=int, default=0, help="pass batch_size to the Worker when supported")
    parser.add_argument("--freeze", action="store_true",
                        help="the drains' workers freeze their start-up objects first (gc.freeze), as the worker "
                             "commands do; the reference loops do not")
    parser.add_argument("--io-jobs", type=int, default=None, help="jobs per I/O-bound drain (5,000, quick 2,000)")
    parser.add_argument("--timeout", type=float, default=None, help="seconds allowed per drain (600, quick 120)")
    parser.add_argument("--core", metavar="REV", help="benchmark sa_jobqueue (and its migrations) as committed "
                        "at git revision REV, from a snapshot, instead of the working tree")
    parser.add_argument("--json", metavar="PATH", help="also write every run's figures to PATH as JSON "
                        "(what benchmarks/compare.py reads)")
    parser.add_argument("--profile", metavar="DIR", help="record every sa_jobqueue worker with py-spy (raw "
                        "collapsed stacks in DIR); slows the workers, so not for the figures")
    args = parser.parse_args(argv)
    quick = args.quick
    args.runs = args.runs or (1 if quick else 3)
    args.timeout = args.timeout or (120.0 if quick else 600.0)
    args.jobs = args.jobs or (1_000 if quick else 20_000)
    args.enqueue_jobs = args.enqueue_jobs or (300 if quick else 2_000)
    args.latency_jobs = args.latency_jobs or (50 if quick else 200)
    args.io_jobs = args.io_jobs or (2_000 if quick else 5_000)
    args.claim_backlog = args.claim_backlog or (20_000 if quick else 1_000_000)
    args.claim_samples = args.claim_samples or (30 if quick else 200)
    args.rss_jobs = [int(n) for n in (args.rss_jobs or ("1000,5000" if quick else "10000,100000")).split(",")]
    if len(args.rss_jobs) != 2 or not 0 < args.rss_jobs[0] < args.rss_jobs[1]:
        parser.error("--rss-jobs takes FIRST,TOTAL with 0 < FIRST < TOTAL")
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    only = set()
    for name in filter(None, (n.strip() for n in args.only.split(","))):
        if name in GROUPS:
            only.update(GROUPS[name])
        elif name in WORKLOADS:
            only.add(name)
        else:
            parser.error(f"--only: unknown workload {name!r}; choose from {', '.join(WORKLOADS)} or drain")
    args.only = only or set(WORKLOADS)
    if args.runs < 1 or args.jobs < 1:
        parser.error("--runs and --jobs must be at least 1")
    return args


def run_snapshot(rev: str, argv: list[str]) -> int:
    """Run this benchmark again, importing sa_jobqueue from ``git archive REV``."""
    import shutil
    import tempfile

    root = Path(__file__).resolve().parent.parent
    commit = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", rev],
                            capture_output=True, text=True, check=True).stdout.strip()
    snapshot = Path(tempfile.mkdtemp(prefix="sajq-core-"))
    try:
        archive = subprocess.run(["git", "-C", str(root), "archive", commit, "sa_jobqueue", "alembic", "alembic.ini"],
                                 capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(snapshot)], input=archive, check=True)
        (snapshot / "COMMIT").write_text(f"{commit} (snapshot of {rev})\n")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(snapshot), os.environ.get("PYTHONPATH")]))}
        rest = []
        skip = False
        for arg in argv:
            if skip:
                skip = False
            elif arg == "--core":
                skip = True
            elif not arg.startswith("--core="):
                rest.append(arg)
        return subprocess.run([sys.executable, str(Path(__file__).resolve()), *rest], env=env).returncode
    finally:
        shutil.rmtree(snapshot, ignore_errors=True)


if __name__ == "__main__":
    try:
        arguments = parse_args()
        if arguments.core:
            sys.exit(run_snapshot(arguments.core, sys.argv[1:]))
        sys.exit(run(arguments))
    except BenchmarkError as exc:
        print(f"\nbenchmark FAILED: {exc}", file=sys.stderr)
        sys.exit(1)
