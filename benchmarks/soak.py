"""sa_jobqueue load and bloat soak: a steady queue before, during and after a long transaction.

::

    .venv/bin/python benchmarks/soak.py                        # default: 3 phases of 60 s, ~3.5 min
    .venv/bin/python benchmarks/soak.py --phase-seconds 15     # short run while developing
    DATABASE_URL=postgresql://postgres@127.0.0.1:5432/test .venv/bin/python benchmarks/soak.py

Not a test and not part of ``pytest``: a separate command that prints Markdown.
It creates a fresh database (``sajq_soak_<random>``, on DATABASE_URL's server,
else on an embedded PostgreSQL), migrates it with the project's Alembic
revisions (``alembic upgrade head``: ``sa_jobqueue_jobs`` with its indexes and
queue storage parameters), and drops it at the end. Then:

* one **producer** process enqueues at a steady rate (``--rate`` jobs/s,
  ``--per-tx`` jobs per transaction through ``JobRepository.enqueue``), with
  the wall-clock time of the enqueue call in each job's payload;
* ``--workers`` **worker** processes run ``Worker(mode="lease")`` with a no-op
  handler (no session: batched completions) of ``--concurrency`` threads each;
* after ``--warmup`` seconds, three phases of ``--phase-seconds`` each:

  - **before**: normal operation;
  - **during**: another connection runs ``BEGIN ISOLATION LEVEL REPEATABLE
    READ; SELECT 1 FROM sa_jobqueue_jobs LIMIT 1;`` and then sits idle in that
    transaction. Its snapshot pins the database's xmin horizon: no row version
    that died after the snapshot was taken can be removed by vacuum or page
    pruning, nor its index entries marked dead by index scans;
  - **after**: that transaction commits; with ``--after vacuum`` (the default)
    the soak runs ``VACUUM (VERBOSE) sa_jobqueue_jobs`` at once, as an operator
    would, and with ``--after wait`` it leaves the table to (auto)vacuum;

* then, load still on, ``REINDEX TABLE CONCURRENTLY sa_jobqueue_jobs`` (index
  sizes before and after; ``--no-reindex`` skips it); the producer stops, the
  workers drain what is left (up to 30 s), and the run checks that every job
  enqueued was completed (exit 1 otherwise).

Measurements:

* **claim latency**, two ways. Each worker times its own claim statements
  (``WITH picked AS (… FOR UPDATE SKIP LOCKED) UPDATE … RETURNING``) with
  SQLAlchemy's ``before_cursor_execute`` / ``after_cursor_execute`` events:
  the claims the workers really ran, empty ones included, as the client sees
  them (round trip plus server time, loopback; on a busy machine also CPU
  contention). And a **probe** connection runs the same claim statement
  (``LIMIT 1``, the soak's queue) every ``--probe`` seconds under ``EXPLAIN
  (ANALYZE, BUFFERS)`` and rolls it back (a job it claims stays pending): the
  server's execution time and the number of buffers the claim touched, a
  count of the work done that CPU contention does not change;
* **enqueue to start**: the handler's start minus the enqueue time in the
  payload (one machine, one wall clock);
* **enqueue transaction**: the producer's ``BEGIN … COMMIT`` time;
* **table statistics**, sampled every ``--sample`` seconds on a connection of
  its own: ``n_live_tup`` and ``n_dead_tup`` of ``pg_stat_user_tables`` (after
  ``pg_stat_clear_snapshot()``; backends flush their counts at most once a
  second, so they lag by about that; ``pg_stat_force_next_flush()`` only
  flushes the calling backend's own counts, so it cannot help here), the
  heap size (``pg_relation_size``), all indexes (``pg_indexes_size``) and the
  claim index, the oldest ``age(backend_xmin)`` among the database's other
  sessions, the oldest ``age(backend_xid)`` in the server's other databases (a
  write transaction anywhere on the server holds back every database's
  horizon), and the pending backlog.

Background vacuum: a queue table is normally kept by autovacuum. When the
server's ``autovacuum`` is off (as on some shared benchmark servers), the soak
stands in for it (``--standin auto``): every ``--naptime`` seconds (60, the
server default) it applies autovacuum's trigger rule with the table's own
storage parameters (dead tuples > threshold + scale factor x reltuples) and
runs ``VACUUM (VERBOSE)`` when due. Every vacuum's ``tuples: … removed, …
remain, … are dead but not yet removable`` line goes into the report.

Every wait has a timeout; the soak ends only the processes it started, by
PID. See docs/operations.md ("Long transactions and bloat").
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import queue
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import psycopg  # noqa: E402
from common import (  # noqa: E402
    QUEUE,
    TABLE,
    ChildProcess,
    core_version,
    libpq,
    migrate,
    server,
    sqlalchemy_url,
)
from sqlalchemy.engine import URL  # noqa: E402

TASK = "soak"
CLAIM_INDEX = f"ix_{TABLE}_claim_v2"
PHASES = ("before", "during", "after")
CLAIM_PREFIX = "WITH picked AS"  # how sa_jobqueue's claim statement starts (statements.claim)


class SoakError(RuntimeError):
    """A process failed or did not answer in time, or jobs went missing."""


def log(message: str) -> None:
    print(f"[soak {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# -- child processes: the producer and the workers ------------------------------------------


def say(line: str) -> None:
    sys.stdout.write(f"@@{line}\n")
    sys.stdout.flush()


def wait_for_go() -> None:
    line = sys.stdin.readline().strip()
    if line != "go":
        raise SystemExit(f"expected 'go' on stdin, got {line!r}")


def on_stop(stop: Callable[[], None], deadline: float) -> None:
    """Call ``stop()`` when the parent says ``stop`` or goes away, or after ``deadline`` seconds."""

    def watch() -> None:
        sys.stdin.readline()
        stop()

    threading.Thread(target=watch, daemon=True).start()
    timer = threading.Timer(deadline, stop)
    timer.daemon = True
    timer.start()


def run_producer(args: argparse.Namespace) -> dict[str, Any]:
    """Enqueue ``rate`` jobs/s, ``per_tx`` per transaction, on a steady schedule."""
    from sqlalchemy import create_engine
    from sqlalchemy.orm import Session

    from sa_jobqueue import JobRepository
    from sa_jobqueue.default import Job

    engine = create_engine(sqlalchemy_url(args.dsn), pool_size=1, max_overflow=0,
                           connect_args={"application_name": "sajq_soak_producer"})
    repo = JobRepository(Job)
    with engine.connect():
        pass
    stop = threading.Event()
    commits: list[tuple[float, float, int]] = []  # (wall time after commit, transaction ms, jobs)
    errors: list[str] = []
    say("ready")
    wait_for_go()
    on_stop(stop.set, args.deadline)
    interval = args.per_tx / args.rate
    next_at = time.monotonic()
    behind = 0  # times the schedule was more than a second late and was reset
    try:
        while not stop.is_set():
            now = time.monotonic()
            if now < next_at:
                stop.wait(next_at - now)
                continue
            if now - next_at > 1.0:  # fell behind: carry on at the rate, do not burst
                next_at, behind = now, behind + 1
            started = time.perf_counter()
            try:
                with Session(engine) as session, session.begin():
                    for _ in range(args.per_tx):
                        repo.enqueue(session, TASK, {"t": time.time()}, queue=QUEUE)
            except Exception as exc:  # reported, and the loop goes on
                errors.append(repr(exc)[:300])
                stop.wait(0.2)
                continue
            commits.append((time.time(), (time.perf_counter() - started) * 1000, args.per_tx))
            next_at += interval
    except KeyboardInterrupt:
        pass
    engine.dispose()
    return {"commits": commits, "errors": errors, "behind": behind}


def run_worker(args: argparse.Namespace) -> dict[str, Any]:
    """A lease-mode Worker with a no-op handler; times its claims and its jobs' start latency."""
    from sqlalchemy import create_engine, event

    from sa_jobqueue import JobRepository, TaskRegistry, Worker
    from sa_jobqueue.default import Job

    engine = create_engine(sqlalchemy_url(args.dsn), pool_size=args.concurrency + 2, max_overflow=4,
                           connect_args={"application_name": "sajq_soak_worker"})
    claims: list[tuple[float, float, int]] = []  # (wall time at the end, ms, rows claimed)
    starts: list[tuple[float, float]] = []  # (wall time of the handler's start, ms since the enqueue call)

    @event.listens_for(engine, "before_cursor_execute")
    def _before(conn: Any, cursor: Any, statement: str, params: Any, context: Any, many: bool) -> None:
        if statement.startswith(CLAIM_PREFIX):
            conn.info["soak_claim_t0"] = time.perf_counter()

    @event.listens_for(engine, "after_cursor_execute")
    def _after(conn: Any, cursor: Any, statement: str, params: Any, context: Any, many: bool) -> None:
        t0 = conn.info.pop("soak_claim_t0", None)
        if t0 is not None:
            claims.append((time.time(), (time.perf_counter() - t0) * 1000, cursor.rowcount))

    tasks = TaskRegistry()

    @tasks.task(TASK)
    def soak(job: Any) -> None:
        now = time.time()
        starts.append((now, (now - float(job.payload["t"])) * 1000))

    worker = Worker(engine, JobRepository(Job), tasks, queues=[QUEUE], concurrency=args.concurrency, mode="lease")
    for connection in [engine.connect() for _ in range(args.concurrency + 1)]:
        connection.close()
    completed: list[tuple[float, int]] = []  # (wall time, WorkerResult.completed so far)
    sampling = threading.Event()

    def sample() -> None:
        while not sampling.wait(0.25):
            completed.append((time.time(), worker.result.completed))

    say("ready")
    wait_for_go()
    on_stop(worker.stop, args.deadline)
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    result = worker.run()
    sampling.set()
    sampler.join(5)
    completed.append((time.time(), worker.result.completed))
    engine.dispose()
    return {"claims": claims, "starts": starts, "completed": completed, "result": asdict(result)}


def child_main(args: argparse.Namespace) -> None:
    import logging

    logging.basicConfig(level=logging.WARNING, format=f"[{args.role} %(process)d] %(levelname)s %(message)s")
    out = run_producer(args) if args.role == "producer" else run_worker(args)
    Path(args.out).write_text(json.dumps(out))
    say("done")


class Child(ChildProcess):
    """One child process of this script, driven over stdin/stdout; results in a JSON file."""

    def __init__(self, role: str, dsn: str, out: Path, extra: list[str], deadline: float) -> None:
        self.role = role
        self.out = out
        super().__init__([sys.executable, str(Path(__file__).resolve()), "--role", role, "--dsn", dsn,
                          "--out", str(out), "--deadline", str(deadline), *extra])

    def expect(self, word: str, timeout: float) -> None:
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise SoakError(f"{self.role} (pid {self.proc.pid}) did not say {word!r} within {timeout:.0f} s") from None
        if line != word:
            raise SoakError(f"{self.role} (pid {self.proc.pid}) exited or said {line!r} instead of {word!r}")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def finish(self, timeout: float) -> dict[str, Any]:
        """Say stop, wait for the result (``timeout`` s), and read it."""
        self.send("stop")
        self.expect("done", timeout)
        self.proc.wait(timeout=30)
        return json.loads(self.out.read_text())  # type: ignore[no-any-return]



# -- the database: setup, samples, the pin, vacuums ----------------------------------------


def connect(dsn: str, name: str, *, autocommit: bool = True) -> psycopg.Connection[Any]:
    return psycopg.connect(dsn, autocommit=autocommit, connect_timeout=10, application_name=name)


@dataclass
class Sample:
    t: float
    live: int
    dead: int
    vacuums: int  # vacuum_count + autovacuum_count
    autovacuums: int
    heap: int  # bytes
    indexes: int
    claim_index: int
    xmin_age: int | None  # the oldest age(backend_xmin) among the database's other sessions
    elsewhere: int | None  # the oldest age(backend_xid) in the server's other databases
    pending: int
    running: int


SAMPLE_SQL = f"""
SELECT s.n_live_tup, s.n_dead_tup, s.vacuum_count + s.autovacuum_count, s.autovacuum_count,
       pg_relation_size(s.relid), pg_indexes_size(s.relid), pg_relation_size('{CLAIM_INDEX}'::regclass),
       (SELECT coalesce(max(greatest(age(a.backend_xmin), age(a.backend_xid))), 0) FROM pg_stat_activity a
        WHERE a.datname = current_database() AND a.pid <> pg_backend_pid()),
       (SELECT coalesce(max(age(a.backend_xid)), 0) FROM pg_stat_activity a
        WHERE a.datname IS DISTINCT FROM current_database()),
       (SELECT count(*) FILTER (WHERE status = 'pending') FROM {TABLE}),
       (SELECT count(*) FILTER (WHERE status = 'running') FROM {TABLE})
FROM pg_stat_user_tables s WHERE s.relid = '{TABLE}'::regclass
"""


@dataclass
class VacuumRun:
    t: float  # wall time at the end
    reason: str
    seconds: float
    removed: int | None = None
    remain: int | None = None
    not_removable: int | None = None
    cutoff_age: int | None = None  # "removable cutoff: …, which was N XIDs old"
    error: str | None = None


TUPLES = re.compile(r"tuples: (\d+) removed, (\d+) remain, (\d+) are dead but not yet removable")
CUTOFF = re.compile(r"removable cutoff: \d+, which was (\d+) XIDs old")


class Vacuums:
    """Runs ``VACUUM (VERBOSE)`` of the job table on a connection of its own, one at a time."""

    def __init__(self, dsn: str) -> None:
        self.conn = connect(dsn, "sajq_soak_vacuum")
        self.conn.execute("SET statement_timeout = '120s'")
        self.notices: list[str] = []
        self.conn.add_notice_handler(lambda d: self.notices.append(d.message_primary or ""))
        self.lock = threading.Lock()
        self.runs: list[VacuumRun] = []

    def run(self, reason: str) -> VacuumRun:
        with self.lock:
            self.notices.clear()
            started = time.perf_counter()
            entry = VacuumRun(0.0, reason, 0.0)
            try:
                self.conn.execute(f"VACUUM (VERBOSE) {TABLE}")
            except psycopg.Error as exc:
                entry.error = str(exc).strip()[:200]
            entry.seconds = time.perf_counter() - started
            entry.t = time.time()
            text = "\n".join(self.notices)
            if m := TUPLES.search(text):
                entry.removed, entry.remain, entry.not_removable = (int(g) for g in m.groups())
            if m := CUTOFF.search(text):
                entry.cutoff_age = int(m.group(1))
            self.runs.append(entry)
        return entry

    def reindex(self) -> dict[str, float]:
        """``REINDEX TABLE CONCURRENTLY`` of the job table: seconds, and index bytes before and after."""
        size = f"SELECT pg_indexes_size('{TABLE}'::regclass)"
        with self.lock:
            before = self.conn.execute(size).fetchone()[0]  # type: ignore[index]
            started = time.perf_counter()
            self.conn.execute(f"REINDEX TABLE CONCURRENTLY {TABLE}")
            seconds = time.perf_counter() - started
            after = self.conn.execute(size).fetchone()[0]  # type: ignore[index]
        return {"t": time.time(), "seconds": seconds, "before": before, "after": after}

    def due(self) -> bool:
        """Autovacuum's trigger rule, with the table's own storage parameters."""
        with self.lock:
            row = self.conn.execute(
                "SELECT c.reltuples, c.reloptions, s.n_dead_tup, current_setting('autovacuum_vacuum_threshold'), "
                "current_setting('autovacuum_vacuum_scale_factor') FROM pg_class c "
                "JOIN pg_stat_user_tables s ON s.relid = c.oid WHERE c.oid = %s::regclass", (TABLE,),
            ).fetchone()
        assert row is not None
        reltuples, reloptions, dead, threshold, scale = row
        options = dict(o.split("=", 1) for o in reloptions or [])
        threshold = float(options.get("autovacuum_vacuum_threshold", threshold))
        scale = float(options.get("autovacuum_vacuum_scale_factor", scale))
        return bool(dead > threshold + scale * max(0.0, reltuples))

    def close(self) -> None:
        self.conn.close()


class Monitor(threading.Thread):
    """Samples the table every ``interval`` s, and watches the children."""

    def __init__(self, dsn: str, interval: float, children: list[Child]) -> None:
        super().__init__(daemon=True, name="soak-monitor")
        self.conn = connect(dsn, "sajq_soak_monitor")
        self.conn.execute("SET statement_timeout = '10s'")
        self.interval = interval
        self.children = children  # set to [] once the soak stops them on purpose
        self.samples: list[Sample] = []
        self.stopping = threading.Event()
        self.failed = threading.Event()  # a child exited early
        self.errors: list[str] = []

    def sample(self) -> Sample:
        self.conn.execute("SELECT pg_stat_clear_snapshot()")
        row = self.conn.execute(SAMPLE_SQL).fetchone()
        assert row is not None
        return Sample(time.time(), *row)

    def run(self) -> None:
        while not self.stopping.wait(self.interval):
            for child in self.children:
                if not child.alive():
                    self.errors.append(f"{child.role} (pid {child.proc.pid}) exited with {child.proc.returncode}")
                    self.failed.set()
            try:
                self.samples.append(self.sample())
            except psycopg.Error as exc:
                self.errors.append(f"sample failed: {exc}")


class StandIn(threading.Thread):
    """Autovacuum's job when the server's autovacuum is off: every ``naptime`` s,
    ``VACUUM`` the table if autovacuum's trigger rule says it is due."""

    def __init__(self, vacuums: Vacuums, naptime: float) -> None:
        super().__init__(daemon=True, name="soak-standin")
        self.vacuums = vacuums
        self.naptime = naptime
        self.stopping = threading.Event()
        self.errors: list[str] = []

    def run(self) -> None:
        while not self.stopping.wait(self.naptime):
            try:
                if self.vacuums.due():
                    done = self.vacuums.run("stand-in autovacuum")
                    log(f"stand-in autovacuum: {done.seconds:.2f} s, removed {done.removed}, "
                        f"{done.not_removable} dead but not yet removable")
            except psycopg.Error as exc:
                self.errors.append(f"stand-in autovacuum failed: {exc}")


def plan_indexes(node: dict[str, Any]) -> set[str]:
    found = {node["Index Name"]} if "Index Name" in node else set()
    for child in node.get("Plans", []):
        found |= plan_indexes(child)
    return found


class Probe(threading.Thread):
    """Every ``interval`` s: the claim statement, with ``LIMIT 1`` on the soak's queue, under
    ``EXPLAIN (ANALYZE, BUFFERS)`` and rolled back (a job it claims stays pending). Records the
    server's execution time and the buffers the claim touched, which CPU contention on the
    machine does not change."""

    def __init__(self, dsn: str, interval: float) -> None:
        super().__init__(daemon=True, name="soak-probe")
        import claims

        from sa_jobqueue.default import Job

        self.conn = connect(dsn, "sajq_soak_probe", autocommit=False)
        self.conn.execute("SET statement_timeout = '10s'")
        # The library's own claim statement (benchmarks/claims.py), prepared once.
        prepare, self.execute, self.values = claims.prepared_claim(Job, [QUEUE], 1, "sajq_soak_probe")
        self.values["worker"] = "soak-probe"
        self.cursor = psycopg.ClientCursor(self.conn)
        self.cursor.execute(prepare)
        self.conn.commit()
        self.interval = interval
        self.stopping = threading.Event()
        self.samples: list[tuple[float, float, int, int]] = []  # (wall time, server ms, buffers, rows)
        self.indexes: set[str] = set()
        self.errors: list[str] = []

    def run(self) -> None:
        while not self.stopping.wait(self.interval):
            try:
                row = self.cursor.execute(
                    f"EXPLAIN (ANALYZE, BUFFERS, TIMING OFF, FORMAT JSON) {self.execute}", self.values
                ).fetchone()
                assert row is not None
                explained = row[0][0]
                plan = explained["Plan"]
                buffers = plan["Shared Hit Blocks"] + plan["Shared Read Blocks"]
                self.samples.append((time.time(), explained["Execution Time"], buffers, plan["Actual Rows"]))
                self.indexes |= plan_indexes(plan)
            except psycopg.Error as exc:
                self.errors.append(f"probe failed: {exc}")
            finally:
                self.conn.rollback()

    def close(self) -> None:
        self.conn.close()


class Pin:
    """A REPEATABLE READ transaction with a snapshot, left open: pins the xmin horizon."""

    def __init__(self, dsn: str, safety_seconds: float) -> None:
        self.conn = connect(dsn, "sajq_soak_pin")
        # If the soak dies, the server ends the pin by itself.
        self.conn.execute(f"SET idle_in_transaction_session_timeout = '{int(safety_seconds)}s'")
        self.conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        self.conn.execute(f"SELECT 1 FROM {TABLE} LIMIT 1").fetchall()
        row = self.conn.execute("SELECT backend_xmin::text FROM pg_stat_activity WHERE pid = pg_backend_pid()")
        self.xmin = row.fetchone()[0]  # type: ignore[index]

    def release(self) -> None:
        try:
            self.conn.execute("COMMIT")
        except psycopg.Error as exc:
            log(f"ending the pinning transaction failed: {exc}")
        finally:
            self.conn.close()


# -- the run -------------------------------------------------------------------------------


@dataclass
class Timeline:
    marks: dict[str, float] = field(default_factory=dict)  # warmup, before, during, after, end: wall times

    def window(self, phase: str) -> tuple[float, float]:
        names = ["warmup", *PHASES, "end"]
        i = names.index(phase)
        return self.marks[names[i]], self.marks[names[i + 1]]


@contextmanager
def soak_database(server_url: URL) -> Iterator[URL]:
    name = f"sajq_soak_{uuid.uuid4().hex[:6]}"
    with connect(libpq(server_url), "sajq_soak_admin") as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    log(f"database {name} created")
    try:
        yield server_url.set(database=name)
    finally:
        with connect(libpq(server_url), "sajq_soak_admin") as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        log(f"database {name} dropped")


def run(args: argparse.Namespace) -> int:
    started = time.monotonic()
    load_start = os.getloadavg()
    with server() as (server_url, origin), soak_database(server_url) as url:
        dsn = libpq(url)
        migrate(url)
        with connect(dsn, "sajq_soak_admin") as conn:
            version = conn.execute("SHOW server_version").fetchone()[0]  # type: ignore[index]
            autovacuum = conn.execute("SHOW autovacuum").fetchone()[0]  # type: ignore[index]
            naptime = conn.execute("SHOW autovacuum_naptime").fetchone()[0]  # type: ignore[index]
            reloptions = conn.execute("SELECT reloptions FROM pg_class WHERE oid = %s::regclass",
                                      (TABLE,)).fetchone()[0]  # type: ignore[index]
        standin = args.standin == "on" or (args.standin == "auto" and autovacuum != "on")
        background = (f"the soak's autovacuum stand-in, every {args.naptime:g} s (server autovacuum = {autovacuum})"
                      if standin else f"server autovacuum = {autovacuum}, naptime {naptime}")
        planned = args.warmup + 3 * args.phase_seconds
        deadline = planned + 180  # the children stop by themselves after this
        tmp = Path(tempfile.mkdtemp(prefix="sajq-soak-"))
        children = [Child("producer", dsn, tmp / "producer.json",
                          ["--rate", str(args.rate), "--per-tx", str(args.per_tx)], deadline)]
        children += [Child("worker", dsn, tmp / f"worker{i}.json", ["--concurrency", str(args.concurrency)], deadline)
                     for i in range(args.workers)]
        vacuums = Vacuums(dsn)
        monitor = Monitor(dsn, args.sample, children)
        standin_thread = StandIn(vacuums, args.naptime) if standin else None
        probe = Probe(dsn, args.probe)
        marks = Timeline()
        pin: Pin | None = None
        results: dict[str, Any] = {}
        try:
            for child in children:
                child.expect("ready", 60)
            for child in children[1:] + children[:1]:  # workers first
                child.send("go")
            monitor.start()
            probe.start()
            if standin_thread is not None:
                standin_thread.start()
            marks.marks["warmup"] = time.time()
            log(f"warmup {args.warmup:g} s: {args.rate:g} jobs/s ({args.per_tx} per transaction), "
                f"{args.workers} worker(s) x {args.concurrency} threads; background vacuum: {background}")

            def phase(name: str, seconds: float) -> None:
                if monitor.failed.wait(seconds):
                    raise SoakError("; ".join(monitor.errors))
                marks.marks[name] = time.time()

            phase("before", args.warmup)
            log(f"phase before ({args.phase_seconds:g} s)")
            phase("during", args.phase_seconds)
            pin = Pin(dsn, args.phase_seconds + 120)
            log(f"phase during: a REPEATABLE READ transaction holds a snapshot (xmin {pin.xmin})")
            if monitor.failed.wait(args.phase_seconds):
                raise SoakError("; ".join(monitor.errors))
            pin.release()
            pin = None
            marks.marks["after"] = time.time()
            log("phase after: the transaction committed")
            if args.after == "vacuum":
                done = vacuums.run("VACUUM after the pin")
                log(f"VACUUM took {done.seconds:.2f} s: removed {done.removed}, remain {done.remain}, "
                    f"{done.not_removable} dead but not yet removable")
            phase("end", max(0.0, marks.marks["after"] + args.phase_seconds - time.time()))
            if args.reindex:
                results["reindex"] = rebuilt = vacuums.reindex()
                log(f"REINDEX TABLE CONCURRENTLY took {rebuilt['seconds']:.2f} s: indexes "
                    f"{mb(rebuilt['before'])} MB -> {mb(rebuilt['after'])} MB")
            log("stopping the producer; the workers drain what is left")
            monitor.children = []
            results["producer"] = children[0].finish(60)
            drained = drain(monitor, 30)
            results["workers"] = [child.finish(90) for child in children[1:]]
            results["left"] = drained
            results["errors"] = monitor.errors + probe.errors + (standin_thread.errors if standin_thread else [])
        finally:
            monitor.stopping.set()
            probe.stopping.set()
            if standin_thread is not None:
                standin_thread.stopping.set()
            if pin is not None:
                pin.release()
            for child in children:
                child.kill()
            monitor.join(15)
            probe.join(15)
            probe.close()
            if standin_thread is not None:
                standin_thread.join(130)  # a VACUUM in progress has a 120 s statement_timeout
            monitor.conn.close()
            vacuums.close()
            shutil.rmtree(tmp, ignore_errors=True)
        results["probe"] = {"samples": probe.samples, "indexes": sorted(probe.indexes)}
        report = Report(args, marks, monitor.samples, vacuums.runs, results)
        elapsed = time.monotonic() - started
        header = [
            "## sa_jobqueue load and bloat soak",
            "",
            f"- date: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC; total time {elapsed / 60:.1f} min",
            f"- command: `{' '.join(['python', *sys.argv])}`",
            f"- sa_jobqueue {core_version()}; PostgreSQL {version} ({origin}); Python {platform.python_version()}; "
            f"{os.cpu_count()} CPUs; load average {load_start[0]:.2f} at the start, {os.getloadavg()[0]:.2f} "
            "at the end",
            f"- load: {args.rate:g} jobs/s offered, {args.per_tx} per transaction (`JobRepository.enqueue`); "
            f"{args.workers} worker process(es), `Worker(mode=\"lease\", concurrency={args.concurrency})`, no-op "
            "handler without a session (batched completions)",
            f"- phases: {args.warmup:g} s warmup (not reported), then {args.phase_seconds:g} s each; during: "
            "`BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT 1 FROM sa_jobqueue_jobs LIMIT 1;` left idle; "
            f"after: {'`VACUUM` at once' if args.after == 'vacuum' else 'no explicit VACUUM'}",
            f"- background vacuum: {background}; table storage: `{', '.join(reloptions or [])}`",
        ]
        print("\n".join(header + [""] + report.render()))
        return 0 if report.ok else 1


def drain(monitor: Monitor, timeout: float) -> dict[str, int]:
    """Wait (up to ``timeout`` s) until no job is pending or running; return what is left."""
    deadline = time.monotonic() + timeout
    while True:
        sample = monitor.sample()
        if (sample.pending == 0 and sample.running == 0) or time.monotonic() > deadline:
            return {"pending": sample.pending, "running": sample.running}
        time.sleep(0.5)


# -- the report ----------------------------------------------------------------------------


def percentile(sorted_values: Sequence[float], q: float) -> float | None:
    """Linear interpolation between the closest ranks (``q`` in 0..100)."""
    if not sorted_values:
        return None
    k = (len(sorted_values) - 1) * q / 100
    lo = math.floor(k)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (k - lo)


def ms(value: float | None) -> str:
    if value is None:
        return "—"
    return f"{value:.2f}" if value < 10 else f"{value:.1f}" if value < 100 else f"{value:,.0f}"


def mb(value: float | None) -> str:
    return "—" if value is None else f"{value / 2**20:.1f}"


def num(value: float | None) -> str:
    return "—" if value is None else f"{value:,.0f}"


class Report:
    def __init__(self, args: argparse.Namespace, marks: Timeline, samples: list[Sample], vacuums: list[VacuumRun],
                 results: dict[str, Any]) -> None:
        self.args = args
        self.marks = marks
        self.samples = samples
        self.vacuums = vacuums
        producer = results["producer"]
        workers = results["workers"]
        self.commits: list[tuple[float, float, int]] = producer["commits"]
        self.producer_errors: list[str] = producer["errors"]
        self.behind: int = producer["behind"]
        self.claims = sorted((c for w in workers for c in w["claims"]), key=lambda c: c[0])
        self.starts = sorted((s for w in workers for s in w["starts"]), key=lambda s: s[0])
        self.completed_series: list[list[tuple[float, int]]] = [w["completed"] for w in workers]
        self.results = [w["result"] for w in workers]
        self.left: dict[str, int] = results["left"]
        self.errors: list[str] = results["errors"]
        self.reindex: dict[str, float] | None = results.get("reindex")
        self.probes: list[tuple[float, float, int, int]] = results["probe"]["samples"]
        self.probe_indexes: list[str] = results["probe"]["indexes"]
        self.enqueued_total = sum(n for _, _, n in self.commits)
        self.completed_total = sum(r["completed"] for r in self.results)
        self.ok = (self.enqueued_total == self.completed_total and not any(self.left.values())
                   and not any(r["lost"] or r["dead"] or r["retried"] for r in self.results))

    def completed_at(self, t: float) -> int:
        total = 0
        for series in self.completed_series:
            value = 0
            for when, count in series:
                if when > t:
                    break
                value = count
            total += value
        return total

    def window(self, lo: float, hi: float) -> dict[str, Any]:
        claims = sorted(ms_ for t, ms_, _ in self.claims if lo <= t < hi)
        empty = sum(1 for t, _, rows in self.claims if lo <= t < hi and rows == 0)
        waits = sorted(w for t, w in self.starts if lo <= t < hi)
        tx = sorted(d for t, d, _ in self.commits if lo <= t < hi)
        inside = [s for s in self.samples if lo <= s.t < hi]
        last = inside[-1] if inside else None
        return {
            "seconds": hi - lo,
            "enqueued": sum(n for t, _, n in self.commits if lo <= t < hi),
            "completed": self.completed_at(hi) - self.completed_at(lo),
            "probe_ms": sorted(p[1] for p in self.probes if lo <= p[0] < hi),
            "probe_buffers": sorted(float(p[2]) for p in self.probes if lo <= p[0] < hi),
            "tx": tx, "claims": claims, "empty": empty, "waits": waits, "samples": inside, "last": last,
            "vacuums": [v for v in self.vacuums if lo <= v.t < hi],
        }

    def render(self) -> list[str]:
        out: list[str] = []
        w = out.append
        phases = {p: self.window(*self.marks.window(p)) for p in PHASES}

        def row(label: str, cell: Callable[[dict[str, Any]], str]) -> None:
            w(f"| {label} | " + " | ".join(cell(phases[p]) for p in PHASES) + " |")

        def pcts(key: str, qs: Sequence[float] = (50, 95, 99)) -> Callable[[dict[str, Any]], str]:
            return lambda d: " / ".join(ms(percentile(d[key], q)) for q in qs)

        def last(attr: str, fmt: Callable[[float | None], str] = num) -> Callable[[dict[str, Any]], str]:
            return lambda d: fmt(getattr(d["last"], attr)) if d["last"] else "—"

        def peak(attr: str, fmt: Callable[[float | None], str] = num) -> Callable[[dict[str, Any]], str]:
            return lambda d: fmt(max((getattr(s, attr) or 0 for s in d["samples"]), default=None))

        def vacuum_cell(d: dict[str, Any]) -> str:
            runs: list[VacuumRun] = d["vacuums"]
            if not runs:
                return "none"
            return "; ".join(
                f"{v.reason}: {v.seconds:.2f} s, removed {num(v.removed)}, {num(v.not_removable)} not yet removable"
                if v.error is None else f"{v.reason}: {v.error}" for v in runs
            )

        w("### Per phase")
        w("")
        w("| metric | " + " | ".join(PHASES) + " |")
        w("| --- | " + " | ".join("---:" for _ in PHASES) + " |")
        row("seconds", lambda d: f"{d['seconds']:.0f}")
        row("jobs enqueued (per s)", lambda d: f"{d['enqueued']:,} ({d['enqueued'] / d['seconds']:,.0f})")
        row("jobs completed (per s)", lambda d: f"{d['completed']:,} ({d['completed'] / d['seconds']:,.0f})")
        row("pending backlog at the end", last("pending"))
        row("enqueue transaction p50 / p95 / p99, ms", pcts("tx"))
        row("claim statements (empty)", lambda d: f"{len(d['claims']):,} ({d['empty']:,})")
        row("claim statement p50 / p95 / p99, ms", pcts("claims"))
        row("claim statement max, ms", lambda d: ms(d["claims"][-1] if d["claims"] else None))
        row("probe claim, server execution p50 / p95 / p99, ms", pcts("probe_ms"))
        row("probe claim, buffers touched p50 / max",
            lambda d: f"{num(percentile(d['probe_buffers'], 50))} / {num(percentile(d['probe_buffers'], 100))}")
        row("enqueue to handler start p50 / p95 / p99, ms", pcts("waits"))
        row("n_live_tup at the end", last("live"))
        row("n_dead_tup at the end (peak)",
            lambda d: f"{last('dead')(d)} ({peak('dead')(d)})")
        row("heap size at the end, MB", last("heap", mb))
        row("all indexes at the end, MB", last("indexes", mb))
        row("claim index at the end, MB", last("claim_index", mb))
        row("oldest xmin age in the soak database, peak (xids)", peak("xmin_age"))
        row("oldest write transaction in other databases, peak (xids)", peak("elsewhere"))
        row("vacuums in the phase", vacuum_cell)
        w("")
        w("Claim statements: each worker timed its own claims (before/after_cursor_execute), empty ones included. "
          "n_dead_tup, n_live_tup and sizes: the last sample of the phase (sampled every "
          f"{self.args.sample:g} s), peak in brackets; pg_stat counts lag about a second. Oldest xmin age: "
          "max(age(backend_xmin)) over the soak database's other sessions; a transaction that has written in "
          "another database of the same server (its xid: the next row) ages every new snapshot's xmin as well, "
          "so it holds back vacuum here too. Probe claim: every "
          f"{self.args.probe:g} s, the claim statement (LIMIT 1, the soak's queue) under EXPLAIN (ANALYZE, BUFFERS) "
          f"and rolled back; its plan used {', '.join(self.probe_indexes) or 'no index'}.")
        w("")
        w("### Timeline")
        w("")
        w("| t (s) | phase | enqueued/s | completed/s | claim p50 / p99 ms | probe ms / buffers | start p50 / p99 ms "
          "| n_dead_tup | n_live_tup | heap MB | indexes MB | claim index MB | xmin age | xid age elsewhere "
          "| pending |")
        w("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        origin = self.marks.marks["before"]
        step = self.args.step
        for name in PHASES:
            t, end = self.marks.window(name)
            while t < end - 0.5:
                hi = min(t + step, end)
                d = self.window(t, hi)
                s = d["last"]
                w(f"| {t - origin:.0f} | {name} | {d['enqueued'] / d['seconds']:,.0f} | "
                  f"{d['completed'] / d['seconds']:,.0f} | "
                  f"{ms(percentile(d['claims'], 50))} / {ms(percentile(d['claims'], 99))} | "
                  f"{ms(percentile(d['probe_ms'], 50))} / {num(percentile(d['probe_buffers'], 50))} | "
                  f"{ms(percentile(d['waits'], 50))} / {ms(percentile(d['waits'], 99))} | "
                  + (f"{num(s.dead)} | {num(s.live)} | {mb(s.heap)} | {mb(s.indexes)} | {mb(s.claim_index)} | "
                     f"{num(s.xmin_age)} | {num(s.elsewhere)} | {num(s.pending)} |"
                     if s else "— | — | — | — | — | — | — | — |"))
                t = hi
        w("")
        w(f"Each row: the {step:g} s from t; rates and medians / percentiles over that window, table figures from "
          "its last sample. t = 0 is the start of the before phase.")
        w("")
        w("### Vacuums")
        w("")
        if not self.vacuums:
            w("None ran.")
        for v in self.vacuums:
            at = v.t - origin
            if v.error:
                w(f"- t={at:.0f} s, {v.reason}: failed: {v.error}")
            else:
                w(f"- t={at:.0f} s, {v.reason}: {v.seconds:.2f} s; tuples: {num(v.removed)} removed, {num(v.remain)} "
                  f"remain, {num(v.not_removable)} are dead but not yet removable; removable cutoff "
                  f"{num(v.cutoff_age)} xids old")
        if self.reindex:
            r = self.reindex
            w(f"- t={r['t'] - origin:.0f} s, after the after phase, load still on: `REINDEX TABLE CONCURRENTLY "
              f"{TABLE}` in {r['seconds']:.2f} s; all indexes {mb(r['before'])} MB -> {mb(r['after'])} MB")
        w("")
        w("### Check")
        w("")
        dead = sum(r["dead"] for r in self.results)
        lost = sum(r["lost"] for r in self.results)
        retried = sum(r["retried"] for r in self.results)
        w(f"- {'OK' if self.ok else 'FAILED'}: {self.enqueued_total:,} jobs enqueued, {self.completed_total:,} "
          f"completed (WorkerResult: {retried} retried, {dead} dead, {lost} lost); left in the table after the drain: "
          f"{self.left['pending']} pending, {self.left['running']} running")
        for error in self.errors[:5]:
            w(f"- soak: {error}")
        if self.producer_errors or self.behind:
            w(f"- producer: {len(self.producer_errors)} failed transaction(s), schedule reset {self.behind} time(s) "
              "after falling more than 1 s behind" + (f"; first error: {self.producer_errors[0]}"
                                                       if self.producer_errors else ""))
        return out


# -- command line -------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--phase-seconds", type=float, default=60.0, help="length of each phase (60)")
    parser.add_argument("--warmup", type=float, default=10.0, help="seconds of load before the first phase (10)")
    parser.add_argument("--rate", type=float, default=400.0, help="jobs per second the producer offers (400)")
    parser.add_argument("--per-tx", type=int, default=4, help="jobs per enqueue transaction (4)")
    parser.add_argument("--workers", type=int, default=2, help="worker processes (2)")
    parser.add_argument("--concurrency", type=int, default=4, help="threads per worker (4)")
    parser.add_argument("--after", choices=["vacuum", "wait"], default="vacuum",
                        help="when the pin ends: run VACUUM at once (default), or wait for (auto)vacuum")
    parser.add_argument("--standin", choices=["auto", "on", "off"], default="auto",
                        help="the soak's autovacuum stand-in: auto = only when the server's autovacuum is off")
    parser.add_argument("--naptime", type=float, default=60.0, help="seconds between stand-in checks (60)")
    parser.add_argument("--no-reindex", dest="reindex", action="store_false",
                        help="skip the REINDEX TABLE CONCURRENTLY after the last phase")
    parser.add_argument("--sample", type=float, default=1.0, help="seconds between table samples (1)")
    parser.add_argument("--probe", type=float, default=0.5, help="seconds between probe claims (0.5)")
    parser.add_argument("--step", type=float, default=10.0, help="seconds per timeline row (10)")
    # The child processes' own options.
    parser.add_argument("--role", choices=["producer", "worker"], help=argparse.SUPPRESS)
    parser.add_argument("--dsn", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, default=600.0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.phase_seconds < 5 or args.warmup < 0 or args.rate <= 0 or args.per_tx < 1:
        parser.error("--phase-seconds must be at least 5, --warmup at least 0, --rate and --per-tx positive")
    if min(args.workers, args.concurrency) < 1 or min(args.sample, args.step, args.naptime, args.probe) <= 0:
        parser.error("--workers, --concurrency, --sample, --probe, --step and --naptime must be positive")
    return args


if __name__ == "__main__":
    arguments = parse_args()
    if arguments.role:
        child_main(arguments)
        sys.exit(0)
    def interrupted(signum: int, frame: Any) -> None:
        raise SoakError(f"interrupted by {signal.Signals(signum).name}")

    # SIGINT and SIGTERM end the run through its cleanup: children killed by PID, database dropped.
    signal.signal(signal.SIGTERM, interrupted)
    signal.signal(signal.SIGINT, interrupted)
    try:
        sys.exit(run(arguments))
    except SoakError as exc:
        print(f"\nsoak FAILED: {exc}", file=sys.stderr)
        sys.exit(1)
