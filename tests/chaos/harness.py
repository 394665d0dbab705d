"""One fault scenario: a database, worker processes, a feeder, a fault
injector, and the checks at the end.

A :class:`Run` creates a database of its own on the suite's throwaway
server, starts worker processes (``chaosapp.py work``), enqueues the jobs in
batches while the workers drain them (a quarter up front, the rest in
batches of 100, so that LISTEN/NOTIFY wakes the workers), runs a fault
injector in a thread, waits until no job is pending or running, stops the
workers with SIGTERM and then checks:

* **lost**: an enqueued job that is neither finished with its effect nor
  ``dead`` (vanished without an effect, or still pending/running: stuck);
* **committed twice**: a job with more than one ``chaos_effects`` row;
* an effect of a job that ended ``dead``, or of a job never enqueued;
* **expected dead** (:meth:`Run.expect_dead`: rows a scenario wrote by SQL
  that no handler can run): each ended ``dead`` with the ``last_error`` it
  expects and no handler ever started on it; such rows are not counted as
  enqueued jobs, nor as lost;
* no worker hung (still running 30 s after SIGTERM) and none exited by
  itself.

The enqueued jobs are those of the ``chaos_batches`` rows: the feeder's
(batches ``0`` …) and those of producer processes a scenario starts
(batches from :data:`PRODUCER_BATCHES` on, see ``chaosapp.py produce``).

Every wait has a timeout; every process is ended by its PID.
"""

from __future__ import annotations

import bisect
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import psycopg
from chaosapp import Base, Batch, connect_args, jobs
from pgserver import PgServer
from sqlalchemy import create_engine
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

from sa_jobqueue import JobSpec
from sa_jobqueue.urls import psycopg_url

APP = Path(__file__).with_name("chaosapp.py")
LISTENER_APP_NAME = "sa_jobqueue listener"
STOP_TIMEOUT = 20.0
#: chaos_batches numbers from here on are producers' (chaosapp.py produce), not the feeder's.
PRODUCER_BATCHES = 1_000_000
# A log record's first line (chaosapp's format): "2024-01-01 12:00:00,123 <pid> <logger> <LEVEL> <message>".
_RECORD = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) (\d+) (\S+) ([A-Z]+) (.*)$")


@dataclass
class LogRecord:
    """One record of a worker's log: its first line's fields and its whole text
    (the message and, for log.exception, the traceback that follows it)."""

    at: float  # epoch seconds
    pid: int
    logger: str
    level: str
    text: str


@dataclass
class Fault:
    """One injected fault. ``victim``: the worker PID whose jobs it orphaned, if any."""

    kind: str
    at: float
    end: float
    victim: int | None = None


@dataclass
class Outcome:
    """A row of the reliability report, and what the scenario's checks found."""

    scenario: str
    mode: str
    jobs: int
    faults: int
    lost: int = 0
    twice: int = 0
    recover: float | None = None
    drain: float = 0.0
    reruns: int = 0
    fenced: int = 0
    dead: int = 0
    problems: list[str] = field(default_factory=list)
    known_bug: str | None = None
    fault_kinds: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # what a scenario measured, printed under the report

    def assert_ok(self) -> None:
        assert not self.problems, f"{self.scenario} ({self.mode}): " + "; ".join(self.problems)


REPORT: list[Outcome] = []


def report_table(rows: list[Outcome]) -> list[str]:
    lines = [
        "| scenario | mode | jobs | faults injected | lost | committed twice | time to recover "
        "| drain | re-runs | fenced | result |",
        "| --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        kinds = ", ".join(f"{n} {kind}" for kind, n in r.fault_kinds.items()) or "0"
        recover = "n/a" if r.recover is None else f"{r.recover:.1f} s"
        result = "ok" if not r.problems else "FAILED: " + "; ".join(r.problems)
        if r.problems and r.known_bug:
            result = f"known bug ({r.known_bug}): " + "; ".join(r.problems)
        lines.append(
            f"| {r.scenario} | {r.mode} | {r.jobs:,} | {kinds} | {r.lost} | {r.twice} | {recover} "
            f"| {r.drain:.0f} s | {r.reruns} | {r.fenced} | {result} |"
        )
    return lines


class Run:
    """A scenario in progress; see the module docstring."""

    def __init__(
        self,
        server: PgServer,
        workdir: Path,
        scenario: str,
        mode: str,
        *,
        seed: str,
        jobs: int = 2000,
        workers: int = 3,
        concurrency: int = 4,
        lease: float = 3.0,
        listen: bool = True,
        port: int | None = None,
        pgbouncer: bool = False,
        payload: Callable[[int, random.Random], tuple[str, dict[str, Any]]] | None = None,
        drain_timeout: float = 240.0,
        known_bug: str | None = None,
        worker_args: list[str] | None = None,
    ) -> None:
        self.server = server
        self.dir = workdir
        self.runlog = workdir / "runs"
        self.runlog.mkdir(parents=True, exist_ok=True)
        self.scenario, self.mode = scenario, mode
        self.rng = random.Random(f"{seed}:{scenario}:{mode}")
        self.total, self.n_workers, self.concurrency = jobs, workers, concurrency
        self.lease, self.listen, self.pgbouncer = lease, listen, pgbouncer
        self.payload = payload or (lambda i, rng: ("effect", {"sleep": round(rng.uniform(0, 0.02), 4)}))
        self.drain_timeout = drain_timeout
        self.known_bug = known_bug
        self.worker_args = list(worker_args or [])  # more chaosapp.py work options (pool, batch size, logs)
        self.expected_dead: dict[int, str] = {}  # job id -> the start of its expected last_error
        self.helpers: dict[int, subprocess.Popen[str]] = {}  # producers and the like, by PID
        self.notes: list[str] = []  # see Outcome.notes
        self.stuck_at_timeout = ""
        self.database = f"chaos_{scenario}_{mode}_{uuid.uuid4().hex[:6]}"
        self.admin_url = server.url_for(self.database)
        self.worker_port = port or server.port
        self.faults: list[Fault] = []
        self.planned_runs: dict[int, int] = {}  # job id -> handler starts it needs (failures + 1)
        self.payloads: dict[int, dict[str, Any]] = {}
        # Faults that need no recovery bookkeeping (planned handler failures), by kind.
        self.extra_faults: Counter[str] = Counter()
        self.procs: dict[int, subprocess.Popen[str]] = {}
        self.killed: set[int] = set()
        self.frozen: set[int] = set()  # PIDs that were SIGSTOPped at some point
        self.results: dict[int, dict[str, int]] = {}
        self.stopping = threading.Event()
        self.fed = threading.Event()
        self.errors: list[BaseException] = []
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self.started_at = 0.0
        self.drained_at: float | None = None
        self._create_database()

    # -- setup ----------------------------------------------------------------

    def _create_database(self) -> None:
        with psycopg.connect(self.server.url, autocommit=True, connect_timeout=10) as conn:
            conn.execute(f'CREATE DATABASE "{self.database}"')
        engine = create_engine(psycopg_url(self.admin_url))
        Base.metadata.create_all(engine)
        engine.dispose()

    def url_for_workers(self) -> str:
        return self.server.url_for(self.database, self.worker_port)

    # -- processes --------------------------------------------------------------

    def spawn(self) -> int:
        n = len(self.procs)
        args = [sys.executable, str(APP), "work", self.url_for_workers(), "--mode", self.mode,
                "--concurrency", str(self.concurrency), "--lease", str(self.lease)]
        if not self.listen:
            args.append("--no-listen")
        if self.pgbouncer:
            args.append("--pgbouncer")
        args += self.worker_args
        with open(self.dir / f"worker-{n}.log", "w") as log:
            proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=log, text=True,
                                    env={**os.environ, "CHAOS_RUNLOG": str(self.runlog)})
        with self._lock:
            self.procs[proc.pid] = proc
        return proc.pid

    def live_workers(self) -> list[int]:
        with self._lock:
            return [pid for pid, p in self.procs.items() if pid not in self.killed and p.poll() is None]

    def kill(self, pid: int) -> None:
        """SIGKILL one worker (by PID) and record the fault."""
        at = time.time()
        with self._lock:
            self.killed.add(pid)
            proc = self.procs[pid]
        os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=30)
        self.faults.append(Fault("SIGKILL", at, at, victim=pid))

    def spawn_helper(self, name: str, *args: str) -> subprocess.Popen[str]:
        """Start ``chaosapp.py <args>`` (not a worker: a producer, say), its stderr
        in ``<name>.log``; :meth:`close` ends it by its PID if it is still running."""
        with open(self.dir / f"{name}.log", "w") as log:
            proc = subprocess.Popen([sys.executable, str(APP), *args], stdout=subprocess.PIPE, stderr=log,
                                    text=True, env={**os.environ, "CHAOS_RUNLOG": str(self.runlog)})
        with self._lock:
            self.helpers[proc.pid] = proc
        return proc

    def expect_dead(self, ids: list[int], error: str) -> None:
        """Rows that must end ``dead`` with a ``last_error`` starting with ``error``, never run."""
        self.expected_dead.update((job_id, error) for job_id in ids)

    def freeze(self, pid: int) -> float:
        os.kill(pid, signal.SIGSTOP)
        with self._lock:
            self.frozen.add(pid)
        return time.time()

    def thaw(self, pid: int, since: float) -> None:
        os.kill(pid, signal.SIGCONT)
        self.faults.append(Fault("SIGSTOP", since, time.time(), victim=pid))

    # -- feeding ----------------------------------------------------------------

    def _feed(self) -> None:
        url = self.server.url_for(self.database, self.worker_port if self.pgbouncer else None)
        engine = create_engine(psycopg_url(url), pool_pre_ping=True, pool_size=1,
                               connect_args=connect_args(pgbouncer=self.pgbouncer, application_name="chaos-feeder"))
        try:
            sizes = [self.total // 4] + [100] * ((self.total - self.total // 4) // 100)
            sizes[-1] += self.total - sum(sizes)
            n = 0
            for batch, size in enumerate(sizes):
                specs, payloads = [], []
                for i in range(n, n + size):
                    task, payload = self.payload(i, self.rng)
                    specs.append(JobSpec(task, payload, max_attempts=25))
                    payloads.append(payload)
                ids = self._enqueue(engine, batch, specs)
                self.payloads.update(zip(ids, payloads, strict=True))
                self.planned_runs.update((i, int(p.get("fail", 0)) + 1) for i, p in self.payloads.items())
                n += size
                if self.stopping.wait(0.15):
                    return
            self.fed.set()
        finally:
            engine.dispose()

    def _enqueue(self, engine: Any, batch: int, specs: list[JobSpec]) -> list[int]:
        deadline = time.monotonic() + 120
        while True:
            try:
                with Session(engine) as session, session.begin():
                    rows = jobs.enqueue_many(session, specs)
                    ids = [row.id for row in rows]
                    session.add(Batch(batch=batch, ids=ids))
                return ids
            except DBAPIError:
                # The commit may or may not have happened: the batch row says.
                committed = self._batch_ids(batch)
                if committed is not None:
                    return committed
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def _batch_ids(self, batch: int) -> list[int] | None:
        rows = self.query("SELECT ids FROM chaos_batches WHERE batch = %s", (batch,))
        return list(rows[0][0]) if rows else None

    # -- threads ----------------------------------------------------------------

    def _thread(self, target: Callable[[], None], name: str) -> None:
        def wrapped() -> None:
            try:
                target()
            except BaseException as exc:  # reported by finish()
                self.errors.append(exc)

        thread = threading.Thread(target=wrapped, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    def start(self, injector: Callable[[Run], None] | None = None) -> None:
        """Start the workers, the feeder and the fault injector."""
        self.started_at = time.time()
        for _ in range(self.n_workers):
            self.spawn()
        self._thread(self._feed, "feeder")
        if injector is not None:
            self._thread(lambda: injector(self), "injector")

    def pause(self, seconds: float) -> bool:
        """Sleep; False when the run is stopping (the injector should return)."""
        return not self.stopping.wait(seconds)

    # -- database ---------------------------------------------------------------

    def query(self, sql: str, params: tuple[Any, ...] | dict[str, Any] = (), *,
              timeout: float = 60.0) -> list[tuple[Any, ...]]:
        """Run one statement on a fresh direct connection, retrying through outages."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                with psycopg.connect(self.admin_url, autocommit=True, connect_timeout=5,
                                     application_name="chaos-orchestrator") as conn:
                    cur = conn.execute(sql, params)  # type: ignore[arg-type]
                    return cur.fetchall() if cur.description else []
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def done_jobs(self) -> int:
        return int(self.query("SELECT count(DISTINCT job_id) FROM chaos_effects")[0][0])

    def wait_progress(self, fraction: float, timeout: float = 120.0) -> bool:
        """Wait until ``fraction`` of the jobs have committed their effect."""
        deadline = time.monotonic() + timeout
        while self.done_jobs() < fraction * self.total:
            if time.monotonic() > deadline or not self.pause(0.1):
                return False
        return True

    def remaining(self) -> int:
        return int(self.query("SELECT count(*) FROM chaos_jobs WHERE status IN ('pending', 'running')")[0][0])

    def wait_drained(self) -> bool:
        deadline = time.monotonic() + self.drain_timeout
        while time.monotonic() < deadline:
            if self.errors:
                return False
            if self.fed.is_set() and self.remaining() == 0:
                self.drained_at = time.time()
                return True
            time.sleep(0.25)
        return False

    def listeners_since(self, since: float) -> int:
        """Listener connections to this database opened after ``since`` (epoch)."""
        return int(self.query(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = %s AND application_name = %s "
            "AND backend_start > to_timestamp(%s)", (self.database, LISTENER_APP_NAME, since),
        )[0][0])

    def wait_listeners(self, since: float, timeout: float = 45.0) -> bool:
        """Wait until every live worker has a listener connected after ``since``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.listeners_since(since) >= len(self.live_workers()):
                return True
            time.sleep(0.25)
        return False

    def backends(self, *app_prefixes: str) -> list[tuple[int, str]]:
        """(pid, application_name) of this database's backends whose name starts with a prefix."""
        rows = self.query("SELECT pid, application_name FROM pg_stat_activity WHERE datname = %s", (self.database,))
        return [(int(pid), str(name)) for pid, name in rows if any(str(name).startswith(p) for p in app_prefixes)]

    # -- the end ----------------------------------------------------------------

    def end_faults(self) -> None:
        """Stop the feeder and the fault injector, and wait for them."""
        self.stopping.set()
        for thread in self._threads:
            thread.join(timeout=60)
            if thread.is_alive():
                self.errors.append(RuntimeError(f"the {thread.name} thread did not stop within 60 s"))
        self._threads.clear()

    def finish(self, drained: bool, extra: list[str] | None = None) -> Outcome:
        """Stop everything, check the invariants, and add the report row."""
        self.end_faults()
        problems = list(extra or [])
        if not drained:
            problems.append(f"not drained within {self.drain_timeout:.0f} s")
        problems += [f"{type(e).__name__} in the harness: {e}" for e in self.errors]
        with self._lock:
            crashed = [pid for pid, p in self.procs.items() if pid not in self.killed and p.poll() is not None]
        if crashed:
            problems.append(f"{len(crashed)} worker(s) exited by themselves: {crashed}")
        if not drained:
            self.stuck_at_timeout = self._stuck_breakdown()
        hung = self.stop_workers()
        if hung:
            problems.append(f"{len(hung)} worker(s) still running {STOP_TIMEOUT:.0f} s after SIGTERM (killed): {hung}")
        outcome = self.check(problems)
        REPORT.append(outcome)
        return outcome

    def _stuck_breakdown(self) -> str:
        """What the unfinished jobs look like while the workers still run."""
        (pending, running, extended), = self.query(
            "SELECT count(*) FILTER (WHERE status = 'pending'), count(*) FILTER (WHERE status = 'running'), "
            "count(*) FILTER (WHERE status = 'running' AND lease_expires_at > now() "
            "AND locked_at < now() - interval '30 seconds') FROM chaos_jobs"
        )
        # Pending rows no one holds: a claim would get them right now.
        (free,), = self.query(
            "SELECT count(*) FROM (SELECT id FROM chaos_jobs WHERE status = 'pending' AND run_at <= now() "
            "FOR UPDATE SKIP LOCKED) AS claimable"
        )
        return (f"{pending} pending of which {free} claimable (not locked, due), {running} running "
                f"of which {extended} claimed over 30 s ago with a lease still being extended")

    def stop_workers(self) -> list[int]:
        """SIGTERM every live worker (SIGCONT first, for a frozen one); return the hung ones."""
        live = self.live_workers()
        for pid in live:
            if pid in self.frozen:
                os.kill(pid, signal.SIGCONT)
            os.kill(pid, signal.SIGTERM)
        hung = []
        deadline = time.monotonic() + STOP_TIMEOUT
        for pid in live:
            proc = self.procs[pid]
            try:
                out, _ = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                hung.append(pid)
                os.kill(pid, signal.SIGUSR2)  # an asyncio worker's tasks, into its log
                time.sleep(1)
                os.kill(pid, signal.SIGUSR1)  # its threads' stacks, into its log
                time.sleep(1)
                proc.kill()
                proc.communicate(timeout=30)
                continue
            lines = out.strip().splitlines()
            if proc.returncode == 0 and lines:
                self.results[pid] = json.loads(lines[-1])
        return hung

    def check(self, problems: list[str]) -> Outcome:
        batches = self.query("SELECT batch, ids FROM chaos_batches")
        fed = {job_id for batch, ids in batches if batch < PRODUCER_BATCHES for job_id in ids}
        produced = {job_id for batch, ids in batches if batch >= PRODUCER_BATCHES for job_id in ids}
        expected = fed | produced
        status = dict(self.query("SELECT id, status FROM chaos_jobs"))
        effects: dict[int, list[tuple[int, int, float]]] = defaultdict(list)
        for job_id, attempt, pid, at in self.query(
            "SELECT job_id, attempt, pid, extract(epoch FROM at)::float8 FROM chaos_effects"
        ):
            effects[job_id].append((attempt, pid, at))
        starts = self._starts()
        kinds = Counter(f.kind for f in self.faults) + self.extra_faults
        out = Outcome(self.scenario, self.mode, len(expected), sum(kinds.values()))
        out.fault_kinds = dict(sorted(kinds.items()))
        if len(fed) != self.total:
            problems.append(f"{len(fed)} jobs enqueued by the feeder instead of {self.total}")
        problems += self._check_expected_dead(effects, starts)
        stuck = vanished = dead_with_effect = 0
        for job_id in expected:
            n, state = len(effects.get(job_id, ())), status.get(job_id)
            out.twice += n > 1
            if state is None:
                vanished += n == 0
            elif state == "dead":
                out.dead += 1
                dead_with_effect += n > 0
            else:
                stuck += 1
        out.lost = stuck + vanished
        strangers = set(effects) - expected - set(self.expected_dead)
        if out.lost:
            problems.append(f"{out.lost} job(s) lost: {vanished} gone without effect, {stuck} stuck"
                            + (f" ({self.stuck_at_timeout} at the drain timeout)" if self.stuck_at_timeout else ""))
        if out.twice:
            problems.append(f"{out.twice} job(s) committed their effect twice")
        if dead_with_effect:
            problems.append(f"{dead_with_effect} dead job(s) with a committed effect")
        if strangers:
            problems.append(f"{len(strangers)} effect(s) of jobs never enqueued")
        out.reruns = sum(max(0, len(s) - self.planned_runs.get(job_id, 1)) for job_id, s in starts.items())
        out.fenced = sum(r.get("lost", 0) for r in self.results.values())
        out.drain = (self.drained_at or time.time()) - self.started_at
        out.recover = self._recovery(effects, starts, status)
        out.problems = problems
        out.known_bug = self.known_bug
        out.notes = list(self.notes)
        return out

    def _check_expected_dead(self, effects: dict[int, list[tuple[int, int, float]]],
                             starts: dict[int, list[tuple[int, int, float]]]) -> list[str]:
        if not self.expected_dead:
            return []
        rows = {job_id: (state, error) for job_id, state, error in self.query(
            "SELECT id, status, last_error FROM chaos_jobs WHERE id = ANY(%s)", (list(self.expected_dead),))}
        wrong = []
        for job_id, prefix in sorted(self.expected_dead.items()):
            state, error = rows.get(job_id, (None, None))
            if state != "dead" or not (error or "").startswith(prefix):
                wrong.append(f"{job_id} is {state or 'gone'} with last_error {(error or '')[:80]!r}")
            elif job_id in effects or job_id in starts:
                wrong.append(f"{job_id} ran ({len(starts.get(job_id, ()))} handler starts)")
        if wrong:
            return [f"{len(wrong)} of {len(self.expected_dead)} expected-dead row(s) wrong: " + "; ".join(wrong[:5])]
        return []

    def attempts_beyond_runs(self) -> dict[int, tuple[int, int]]:
        """Jobs that spent more attempts than their handler started: job id ->
        (highest attempt seen, handler starts). The attempt seen is the highest
        of the run log's (each start logs the attempt it runs as), the effect's,
        and a row still in the table's; a job handed back unstarted must not
        have spent one."""
        starts = self._starts()
        seen: dict[int, int] = {job_id: max(a for a, _, _ in rows) for job_id, rows in starts.items()}
        for job_id, attempt in self.query("SELECT job_id, max(attempt) FROM chaos_effects GROUP BY job_id"):
            seen[job_id] = max(seen.get(job_id, 0), int(attempt))
        for job_id, attempts in self.query("SELECT id, attempts FROM chaos_jobs"):
            if job_id not in self.expected_dead:
                seen[job_id] = max(seen.get(job_id, 0), int(attempts))
        return {job_id: (attempt, len(starts.get(job_id, ()))) for job_id, attempt in seen.items()
                if attempt > len(starts.get(job_id, ()))}

    def log_records(self, pattern: str | None = None) -> list[LogRecord]:
        """The records of every worker's log (``worker-<n>.log``), oldest first
        per log; with ``pattern`` (a regular expression), those whose text matches."""
        found = re.compile(pattern) if pattern is not None else None
        records: list[LogRecord] = []
        for path in sorted(self.dir.glob("worker-*.log")):
            current: LogRecord | None = None
            for line in path.read_text(errors="replace").splitlines():
                head = _RECORD.match(line)
                if head is None:
                    if current is not None:
                        current.text += "\n" + line
                    continue
                if current is not None:
                    records.append(current)
                at = datetime.strptime(head.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
                current = LogRecord(at, int(head.group(2)), head.group(3), head.group(4), head.group(5))
            if current is not None:
                records.append(current)
        return [r for r in records if found is None or found.search(r.text)]

    def recent_start(self, within: float, want: Callable[[dict[str, Any]], bool]) -> tuple[int, int] | None:
        """(job id, worker PID) of a job matching ``want`` whose handler started
        less than ``within`` seconds ago in a live worker, or None."""
        now, live = time.time(), set(self.live_workers())
        for job_id, rows in self._starts().items():
            if want(self.payloads.get(job_id, {})):
                for _, pid, t in rows:
                    if now - t < within and pid in live:
                        return job_id, pid
        return None

    def _starts(self) -> dict[int, list[tuple[int, int, float]]]:
        """Handler starts from the run logs: job id -> [(attempt, pid, time)]."""
        starts: dict[int, list[tuple[int, int, float]]] = defaultdict(list)
        for path in self.runlog.glob("runs-*.log"):
            for line in path.read_text().split("\n")[:-1]:  # the last piece may be a line being written
                parts = line.split()
                if len(parts) == 4:
                    starts[int(parts[0])].append((int(parts[1]), int(parts[2]), float(parts[3])))
        return starts

    def _recovery(self, effects: dict[int, list[tuple[int, int, float]]],
                  starts: dict[int, list[tuple[int, int, float]]], status: dict[int, str]) -> float | None:
        """The longest time from a fault to recovery, over this run's faults.

        A fault with a victim (SIGKILL, SIGSTOP) has recovered once every job
        the victim had started before the fault, and that had not committed
        by then, has committed (by another worker, or by the victim itself
        once it resumed) or ended dead. Any other fault has recovered at the
        next commit of any job.
        """
        commits = sorted(at for rows in effects.values() for _, _, at in rows)
        if self.extra_faults and not self.faults:
            return None
        first_commit = {job_id: min(at for _, _, at in rows) for job_id, rows in effects.items()}
        times: list[float] = []
        for fault in self.faults:
            if fault.victim is not None:
                held = {j for j, rows in starts.items()
                        if any(pid == fault.victim and t < fault.at for _, pid, t in rows)}
                orphans = {j for j in held if first_commit.get(j, float("inf")) >= fault.at and status.get(j) != "dead"}
                if any(j not in first_commit for j in orphans):
                    return None  # never recovered
                times.append(max((first_commit[j] for j in orphans), default=fault.at) - fault.at)
            else:
                i = bisect.bisect_left(commits, fault.end)
                if i < len(commits):
                    times.append(commits[i] - fault.at)
        return max(times, default=None)

    def close(self) -> None:
        """End every process still running (by PID) and drop the database."""
        self.stopping.set()
        for pid, proc in list(self.procs.items()):
            if proc.poll() is None:
                if pid in self.frozen:
                    os.kill(pid, signal.SIGCONT)
                proc.kill()
                proc.communicate(timeout=30)
        for proc in list(self.helpers.values()):
            if proc.poll() is None:
                proc.kill()  # Popen.kill: SIGKILL to this PID only
                proc.communicate(timeout=30)
        for thread in self._threads:
            thread.join(timeout=30)
        try:
            with psycopg.connect(self.server.url, autocommit=True, connect_timeout=10) as conn:
                conn.execute(f'DROP DATABASE IF EXISTS "{self.database}" WITH (FORCE)')
        except psycopg.Error:
            pass
