"""The fault suite: drains of thousands of jobs while workers, connections and
the server fail. Run it with ``pytest -m chaos`` (excluded from the default run).

Each scenario runs in both execution modes with worker processes of
``chaosapp.py`` (3 workers x 4 threads, lease 3 s, LISTEN on unless said
otherwise) and checks, through :meth:`harness.Run.finish`, that every job
ended done or dead (none lost, none stuck) and that no job's database effect
committed twice, plus its own checks. See docs/reliability.md.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from bouncer import PgBouncer
from chaosapp import HOLD_QUERY
from harness import LISTENER_APP_NAME, PRODUCER_BATCHES, Fault, Run
from pgserver import PgServer
from tcpproxy import TcpProxy

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(900)]
MODES = ["lease", "transaction"]
# The asyncio worker on each driver, in the scenarios that apply to it (its
# handlers are async def; asyncpg has no TCP keepalive settings for the proxy scenarios).
AIO_MODES = ["aio_psycopg", "aio_asyncpg", "aiotx_psycopg", "aiotx_asyncpg"]  # aiotx: its transaction mode


def _leases(mode: str) -> bool:
    """Whether the mode runs each job in a transaction of its own under a lease (not a batch's)."""
    return mode in ("lease", "aio_psycopg", "aio_asyncpg")
JOBS = int(os.environ.get("CHAOS_JOBS", "2000"))
MakeRun = Callable[..., Run]
GLOBAL_FAULTS = {"restart", "cut (reset)", "half-open"}


def _drain(run: Run, injector: Callable[[Run], None] | None, extra: Callable[[Run], list[str]] | None = None,
           notes: Callable[[Run], list[str]] | None = None) -> None:
    """Start, wait for the drain, run the scenario's own checks, finish, assert.
    ``notes``: report lines from what the stopped workers returned (``run.results``)."""
    run.start(injector)
    drained = run.wait_drained()
    run.end_faults()
    problems = extra(run) if extra is not None else []
    outcome = run.finish(drained, problems)
    if notes is not None:
        outcome.notes += notes(run)
    outcome.assert_ok()


def _handed_back(run: Run) -> list[str]:
    handed = sum(r.get("handed_back", 0) for r in run.results.values())
    return [f"{handed} job(s) handed back unstarted (WorkerResult.handed_back, workers that stopped cleanly)"]


def _listeners_back(run: Run) -> list[str]:
    """Every worker has a listener connected since the start of the last fault
    that hit every connection (a restart, a cut, a half-open), or at all."""
    since = max((f.at for f in run.faults if f.kind in GLOBAL_FAULTS), default=run.started_at)
    if run.wait_listeners(since):
        return []
    return [f"only {run.listeners_since(since)} of {len(run.live_workers())} listeners connected after the faults"]


@pytest.mark.parametrize("mode", MODES + AIO_MODES)
def test_sigkill_random_workers_during_a_drain(make_run: MakeRun, mode: str) -> None:
    """SIGKILL a random worker at every tenth of the drain (10% to 80%) and start a new one."""
    run = make_run("sigkill", mode, jobs=JOBS)

    def inject(run: Run) -> None:
        for tenth in range(1, 9):
            if not run.wait_progress(tenth / 10):
                return
            live = run.live_workers()
            if live:
                run.kill(run.rng.choice(live))
                run.spawn()

    _drain(run, inject)


@pytest.mark.parametrize("mode", MODES + AIO_MODES)
def test_postgres_restart_mid_drain(make_run: MakeRun, mode: str) -> None:
    """Two fast-shutdown restarts (at 25% and 60% of the drain); the same
    worker processes reconnect, listeners included, and finish the work."""
    run = make_run("pg_restart", mode, jobs=JOBS)

    def inject(run: Run) -> None:
        for fraction in (0.25, 0.6):
            if not run.wait_progress(fraction):
                return
            at = time.time()
            run.server.restart("fast")
            run.faults.append(Fault("restart", at, time.time()))

    _drain(run, inject, _listeners_back)


@pytest.mark.parametrize("mode", MODES + AIO_MODES)
def test_pg_terminate_backend_of_workers_and_listeners(make_run: MakeRun, mode: str) -> None:
    """pg_terminate_backend() on a random worker or listener connection every 0.2-0.6 s."""
    run = make_run("terminate_backend", mode, jobs=JOBS)

    def inject(run: Run) -> None:
        while len(run.faults) < 60 and run.pause(run.rng.uniform(0.2, 0.6)):
            listeners = run.backends(LISTENER_APP_NAME)
            workers = run.backends("chaos-worker-")
            # A quarter of the kills go to listeners, which are few.
            pool = listeners if listeners and run.rng.random() < 0.25 else workers
            if not pool:
                continue
            pid, name = run.rng.choice(pool)
            at = time.time()
            if run.query("SELECT pg_terminate_backend(%s)", (pid,))[0][0]:
                kind = "listener killed" if name == LISTENER_APP_NAME else "worker conn killed"
                run.faults.append(Fault(kind, at, at))

    _drain(run, inject, _listeners_back)


@pytest.mark.parametrize("mode", MODES + AIO_MODES)
def test_network_cut_by_the_proxy(make_run: MakeRun, proxy: TcpProxy, mode: str) -> None:
    """The proxy resets every connection (both legs) at 20%, 45% and 70% of the drain."""
    run = make_run("network_cut", mode, jobs=JOBS, port=proxy.port)

    def inject(run: Run) -> None:
        for fraction in (0.2, 0.45, 0.7):
            if not run.wait_progress(fraction):
                return
            at = time.time()
            if proxy.cut():
                run.faults.append(Fault("cut (reset)", at, at))

    _drain(run, inject, _listeners_back)


@pytest.mark.parametrize("mode", MODES + AIO_MODES)
def test_half_open_connections_behind_the_proxy(make_run: MakeRun, proxy: TcpProxy, mode: str) -> None:
    """At 30% of the drain the proxy stops forwarding on every open connection
    and keeps the sockets open; new connections work. Workers must notice
    within a bounded time and go on over new connections: the drain finishes
    within 60 s, every worker stops on SIGTERM, and every listener reconnects
    (its liveness probe, sa_jobqueue/listener.py)."""
    run = make_run("half_open", mode, jobs=JOBS, port=proxy.port, drain_timeout=60.0)

    def inject(run: Run) -> None:
        if run.wait_progress(0.3):
            at = time.time()
            if proxy.half_open():
                run.faults.append(Fault("half-open", at, at))

    _drain(run, inject, _listeners_back)


@pytest.mark.parametrize("mode", MODES + AIO_MODES)
def test_one_stalled_job_connection(make_run: MakeRun, proxy: TcpProxy, mode: str) -> None:
    """One worker (4 slots) drains 1,000 jobs; the job at 20% of the enqueue
    opens its transaction and sleeps 2 s, and while it sleeps the proxy stalls
    that job's connection only (found by its backend's client port). The
    server ends the stalled transaction after 20 s
    (idle_in_transaction_session_timeout), which releases its rows in
    transaction mode. Expected: the job runs again (its statement fails within
    a bounded time, or its lease expires), the drain finishes, and the worker
    stops on SIGTERM."""
    total = max(100, JOBS // 2)
    hold = total // 5

    def payload(i: int, rng: random.Random) -> tuple[str, dict[str, Any]]:
        if i == hold:
            return "effect", {"sleep": 2.0, "hold": True}
        return "effect", {"sleep": round(rng.uniform(0, 0.02), 4)}

    run = make_run("stalled_job_conn", mode, jobs=total, workers=1, port=proxy.port, payload=payload,
                   drain_timeout=90.0)

    def inject(run: Run) -> None:
        while run.pause(0.05):
            rows = run.query(
                "SELECT client_port, application_name FROM pg_stat_activity "
                "WHERE datname = %s AND state = 'idle in transaction' AND query = %s",
                (run.database, HOLD_QUERY),
            )
            if rows and proxy.half_open({int(rows[0][0])}):
                at = time.time()
                run.faults.append(Fault("job conn stalled", at, at, victim=int(rows[0][1].rsplit("-", 1)[1])))
                return

    _drain(run, inject)


def _slow_payload(lease: float) -> Callable[[int, random.Random], tuple[str, dict[str, Any]]]:
    """2% of the jobs take 1.5 leases; the others up to 20 ms."""

    def payload(i: int, rng: random.Random) -> tuple[str, dict[str, Any]]:
        if rng.random() < 0.02:
            return "effect", {"sleep": 1.5 * lease, "slow": True}
        return "effect", {"sleep": round(rng.uniform(0, 0.02), 4)}

    return payload


@pytest.mark.parametrize("mode", MODES + AIO_MODES)
def test_handlers_slower_than_the_lease_and_a_frozen_worker(make_run: MakeRun, mode: str) -> None:
    """Slow jobs (1.5 leases) keep their lease by heartbeats: a live worker's
    job is never reaped. Twice, a worker is frozen (SIGSTOP) in the middle of
    a slow job; in lease mode it stays frozen until another worker has
    completed that job, then resumes (SIGCONT): the fence must refuse its
    completion. In transaction mode it stays frozen for two leases, holding
    its row locks, and then finishes."""
    lease = 3.0
    run = make_run("slow_and_frozen", mode, jobs=JOBS, lease=lease, payload=_slow_payload(lease))
    stale: list[tuple[int, int]] = []

    def inject(run: Run) -> None:
        for _ in range(2):
            found = None
            while found is None:
                if not run.pause(0.1):
                    return
                found = run.recent_start(0.5, lambda p: bool(p.get("slow")))
            job_id, pid = found
            since = run.freeze(pid)
            if _leases(mode):
                deadline = time.monotonic() + 60
                while not run.query("SELECT 1 FROM chaos_effects WHERE job_id = %s", (job_id,)):
                    if time.monotonic() > deadline or not run.pause(0.1):
                        break
                else:
                    stale.append((job_id, pid))
            else:
                run.pause(2 * lease)
            run.thaw(pid, since)

    def checks(run: Run) -> list[str]:
        problems = []
        starts = run._starts()  # job -> [(attempt, pid, time)]: min() is the first attempt
        reaped_alive = [
            job for job, rows in starts.items()
            if len(rows) > run.planned_runs.get(job, 1) and min(rows)[1] not in run.frozen
        ]
        if reaped_alive:
            problems.append(f"{len(reaped_alive)} job(s) of a live worker ran again: {sorted(reaped_alive)[:10]}")
        return problems

    _drain(run, inject, checks)
    if _leases(mode):
        # Each frozen worker's stale completion was refused by the fence.
        frozen_results = {pid: run.results.get(pid, {}).get("lost", 0) for _, pid in stale}
        assert stale and all(n >= 1 for n in frozen_results.values()), frozen_results


@pytest.mark.parametrize("mode", MODES + AIO_MODES)
def test_retry_storm(make_run: MakeRun, mode: str) -> None:
    """Every job fails 3 times, retried at once, then succeeds on its 4th attempt."""
    fails = 3

    def payload(i: int, rng: random.Random) -> tuple[str, dict[str, Any]]:
        return "storm", {"fail": fails, "sleep": round(rng.uniform(0, 0.005), 4)}

    run = make_run("retry_storm", mode, jobs=JOBS, payload=payload)
    run.extra_faults["handler failures"] = fails * JOBS

    def checks(run: Run) -> list[str]:
        wrong = run.query("SELECT count(*) FROM chaos_effects WHERE attempt <> %s", (fails + 1,))[0][0]
        dead = run.query("SELECT count(*) FROM chaos_jobs WHERE status = 'dead'")[0][0]
        return [f"{n} {what}" for n, what in ((wrong, "effect(s) not at attempt 4"), (dead, "dead job(s)")) if n]

    _drain(run, None, checks)


@pytest.mark.parametrize("mode", MODES + AIO_MODES)
def test_exactly_once_behind_pgbouncer_transaction_pooling(
    make_run: MakeRun, chaos_server: PgServer, mode: str
) -> None:
    """Workers (listen=False, no prepared statements) and the feeder go through a
    PgBouncer in transaction pooling mode; three workers are SIGKILLed mid-drain."""
    with PgBouncer(chaos_server.port) as bouncer:
        run = make_run("pgbouncer", mode, jobs=JOBS, port=bouncer.port, listen=False, pgbouncer=True)

        def inject(run: Run) -> None:
            for fraction in (0.2, 0.45, 0.7):
                if not run.wait_progress(fraction):
                    return
                live = run.live_workers()
                if live:
                    run.kill(run.rng.choice(live))
                    run.spawn()

        try:
            _drain(run, inject)
        finally:
            run.close()  # before PgBouncer stops


# -- faults from outside the handler -------------------------------------------------------------

# Deep enough for Python's json decoder to give up (RecursionError), shallow
# enough for PostgreSQL's jsonb to accept (its limit comes from max_stack_depth:
# about 14,000 levels of arrays with the default 2 MB).
DEEP = max(5000, 4 * sys.getrecursionlimit())
DEEP_JSON = {
    "array": "CAST(repeat('[', %(depth)s) || repeat(']', %(depth)s) AS jsonb)",
    "object": "CAST(repeat('{\"a\": ', %(depth)s) || '1' || repeat('}', %(depth)s) AS jsonb)",
}
UNDECODABLE = "payload cannot be decoded"


def _log_problems(run: Run, pattern: str, what: str, *, since: float = 0.0) -> list[str]:
    """A problem when a worker log has records matching ``pattern`` (after ``since``)."""
    found = [r for r in run.log_records(pattern) if r.at > since]
    if not found:
        return []
    first = found[0].text.splitlines()
    return [f"{len(found)} worker log record(s) {what}, the first: {first[0][:200]!r}"
            + (f" … {first[-1][:200]!r}" if len(first) > 1 else "")]


@pytest.mark.parametrize("mode", MODES)
def test_rows_the_client_cannot_decode(make_run: MakeRun, mode: str) -> None:
    """Another producer inserts, by SQL, jobs whose payload is JSON nested
    past Python's decoder (DEEP levels of arrays or objects: PostgreSQL's jsonb
    accepts it, json.loads raises RecursionError), two at each of 5%, 20%, 35%
    and 50% of the drain: one at the head of the queue (run_at an hour ago),
    so the next claim of 10 takes it with nine normal jobs, and one behind the
    backlog. Workers claim in batches of 10 (batch_size) in both modes.
    Expected: each such row goes dead at once (attempts 1, last_error
    "payload cannot be decoded: RecursionError…"), its handler never starts;
    every other job completes exactly once, at its first attempt: no claim
    is left running until its lease expires (no reap, no "lease expired")."""
    run = make_run("undecodable", mode, jobs=JOBS, worker_args=["--batch-size", "10"], drain_timeout=120.0)
    for sql in DEEP_JSON.values():
        stored = run.query(f"SELECT CAST({sql} AS text)", {"depth": DEEP})[0][0]
        with pytest.raises(RecursionError):
            json.loads(stored)
    backlog: list[int] = []

    def inject(run: Run) -> None:
        for n, fraction in enumerate((0.05, 0.2, 0.35, 0.5)):
            if not run.wait_progress(fraction):
                return
            head, tail = DEEP_JSON["array" if n % 2 else "object"], DEEP_JSON["object" if n % 2 else "array"]
            rows = run.query(
                f"INSERT INTO chaos_jobs (task, payload, max_attempts, run_at) VALUES "
                f"('effect', {head}, 25, now() - interval '1 hour'), ('effect', {tail}, 25, now()) RETURNING id",
                {"depth": DEEP},
            )
            run.expect_dead([int(r[0]) for r in rows], f"{UNDECODABLE}: RecursionError")
            run.extra_faults["undecodable rows"] += len(rows)
            backlog.append(run.remaining())

    def checks(run: Run) -> list[str]:
        problems = []
        bad = sorted(run.expected_dead)
        if len(bad) != 8:
            problems.append(f"{len(bad)} undecodable rows inserted instead of 8")
        if not any(n > 10 for n in backlog):
            problems.append(f"no undecodable row was inserted with a backlog of more than a batch: {backlog}")
        attempts = dict(run.query("SELECT id, attempts FROM chaos_jobs WHERE id = ANY(%s)", (bad,)))
        spent = {job_id: n for job_id, n in attempts.items() if n != 1}
        if spent:
            problems.append(f"undecodable rows with attempts other than 1 (reaped?): {spent}")
        other_dead = run.query("SELECT id, last_error FROM chaos_jobs WHERE status = 'dead' AND NOT id = ANY(%s)",
                               (bad,))
        if other_dead:
            problems.append(f"{len(other_dead)} other job(s) dead, e.g. {other_dead[0][0]}: {other_dead[0][1][:100]!r}")
        expired = run.query("SELECT count(*) FROM chaos_jobs WHERE position('lease expired' in last_error) > 0")[0][0]
        if expired:
            problems.append(f"{expired} job(s) with a 'lease expired' error")
        late = run.query("SELECT count(*), max(attempt) FROM chaos_effects WHERE attempt <> 1")[0]
        if late[0]:
            problems.append(f"{late[0]} effect(s) not at attempt 1 (up to attempt {late[1]})")
        reruns = {job_id: len(rows) for job_id, rows in run._starts().items() if len(rows) > 1}
        if reruns:
            problems.append(f"{len(reruns)} job(s) whose handler started more than once: {sorted(reruns)[:10]}")
        problems += _log_problems(run, REAPED, "of reaped jobs")
        buried = " ".join(r.text for r in run.log_records(UNDECODABLE))
        unlogged = [job_id for job_id in bad if not re.search(rf"\b{job_id} \(effect\) sent to dead: {UNDECODABLE}",
                                                               buried)]
        if unlogged:
            problems.append(f"undecodable rows sent to dead without a log record: {unlogged}")
        return problems

    _drain(run, inject, checks)


READ_ONLY = r"read-only transaction"


@pytest.mark.parametrize("mode", MODES + AIO_MODES)
def test_a_read_only_period(make_run: MakeRun, mode: str) -> None:
    """At 30% of the drain, ``ALTER DATABASE … SET default_transaction_read_only
    = on`` and terminate every worker backend (job sessions and the worker's
    own pool; not the listeners, not the feeder), so that the connections the
    workers make next are read-only, as after a failover to a standby; 5 s
    later, set it off and touch nothing else. The connections made during the
    period stay read-only until they are dropped. Expected: the workers
    discard a connection that reports a read-only transaction (SQLSTATE
    25006) and recover by themselves: the drain finishes, and no worker logs
    a read-only error more than 30 s after the period ended (a generous
    bound, not a timing assertion: without the discard, the errors go on
    until the drain times out). Workers log at INFO, so handler failures are
    in their logs too."""
    run = make_run("read_only", mode, jobs=JOBS, worker_args=["--log-level", "INFO"], drain_timeout=120.0)
    period = 5.0
    grace = 30.0

    def inject(run: Run) -> None:
        if not run.wait_progress(0.3):
            return
        with psycopg.connect(run.server.url, autocommit=True, connect_timeout=10) as admin:
            admin.execute(f'ALTER DATABASE "{run.database}" SET default_transaction_read_only = on')
            at = time.time()
            try:
                killed = admin.execute(
                    "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity "
                    "WHERE datname = %s AND starts_with(application_name, 'chaos-worker-')", (run.database,),
                ).fetchone()
                run.pause(period)
            finally:
                admin.execute(f'ALTER DATABASE "{run.database}" RESET default_transaction_read_only')
            run.faults.append(Fault("read-only period", at, time.time()))
            run.notes.append(f"{killed[0] if killed else 0} worker backends terminated as the read-only period began")

    def checks(run: Run) -> list[str]:
        problems = []
        if not run.faults:
            return ["the read-only period never began"]
        fault = run.faults[0]
        errors = run.log_records(READ_ONLY)
        during = [r for r in errors if r.at <= fault.end]
        after = [r for r in errors if r.at > fault.end]
        if not errors:
            problems.append("no worker met a read-only transaction: the fault did not bite")
        last = max((r.at for r in after), default=None)
        run.notes.append(
            f"read-only errors in the worker logs: {len(during)} during the {period:g} s period, {len(after)} after it"
            + (f", the last {last - fault.end:.1f} s after it" if last is not None else ""))
        problems += _log_problems(run, READ_ONLY, f"of a read-only transaction more than {grace:g} s after the "
                                  "period ended", since=fault.end + grace)
        return problems

    _drain(run, inject, checks)


# The worker's own statements (claims, heartbeats, reaps, hand-backs, failures, batched completions) failing.
OWN_STATEMENT_FAILED = (r"claim failed|heartbeat failed|reap failed|recording the failure of job \d+ failed"
                        r"|handing back \d+ jobs failed|completions could not be written|writing \d+ completions failed"
                        r"|lost the lease of job")
REAPED = r"reaped \d+ expired job"


def _attempt_problems(run: Run) -> list[str]:
    """No job spent more attempts than its handler started (a job handed back unstarted spends none)."""
    beyond = run.attempts_beyond_runs()
    if not beyond:
        return []
    sample = ", ".join(f"{job}: attempt {a} after {n} run(s)" for job, (a, n) in sorted(beyond.items())[:5])
    return [f"{len(beyond)} job(s) spent more attempts than their handler ran ({sample})"]


def _overstated_holders(run: Run) -> list[str]:
    """'pool is exhausted' records whose count of connections held by the
    worker's running jobs exceeds the pool's checked-out connections minus the
    sessions the handlers had leaked by then (from the 'chaos leak' records of
    the same process, which come in the order things happened)."""
    leaked: dict[int, int] = {}
    wrong = []
    for r in run.log_records(r"chaos leak: |the jobs' pool is exhausted"):
        held = re.search(r"leaked a session \((\d+) held\)", r.text)
        if held:
            leaked[r.pid] = int(held.group(1))
        elif "chaos leak: released" in r.text:
            leaked[r.pid] = 0
        else:
            counts = re.search(r"Checked out connections: (\d+)\).*?running jobs hold (\d+) of them", r.text, re.S)
            if counts and int(counts.group(2)) > int(counts.group(1)) - leaked.get(r.pid, 0):
                wrong.append(f"{counts.group(2)} of {counts.group(1)} checked out said held by running jobs "
                             f"while {leaked.get(r.pid, 0)} were leaked")
    return wrong


@pytest.mark.parametrize("mode", MODES)
def test_handlers_that_leak_connections(make_run: MakeRun, mode: str) -> None:
    """One job in 50 runs a handler that opens a Session of its own on the
    application's engine, runs a query in it and keeps it open (a module-level
    list), while it writes its effect in the job's session, and takes 1.5 s.
    The application's engine has pool_size = concurrency = 4, max_overflow 0,
    pool_timeout 1 s, so each leak takes one of the jobs' four connections for
    good, and while a leaking handler runs with 3 leaked, its session holds the
    last one; once a worker holds 3, the next leaking handler closes them all
    instead (else the drain could never end). Expected: the worker's own statements
    (claims, heartbeats, hand-backs, failures) never fail, since they use a
    pool of their own; no lease expires; a job whose session cannot get a
    connection is handed back without spending an attempt, and the worker
    logs that the jobs' pool is exhausted and that the connections are held
    elsewhere than by its running jobs."""
    keep = 3

    def payload(i: int, rng: random.Random) -> tuple[str, dict[str, Any]]:
        if i % 50 == 25:
            # Longer than pool_timeout: while it runs with 3 leaked, all 4 connections are taken.
            return "effect", {"leak": keep, "sleep": 1.5}
        return "effect", {"sleep": round(rng.uniform(0, 0.02), 4)}

    run = make_run("leaky_handlers", mode, jobs=JOBS, payload=payload, drain_timeout=120.0,
                   worker_args=["--pool-size", "4", "--max-overflow", "0", "--pool-timeout", "1"])
    run.extra_faults["leaking handlers"] = len(range(25, JOBS, 50))

    def checks(run: Run) -> list[str]:
        problems = _attempt_problems(run)
        problems += _log_problems(run, OWN_STATEMENT_FAILED, "of a failed statement of the worker's own")
        problems += _log_problems(run, REAPED, "of reaped jobs")
        leaked = len(run.log_records(r"chaos leak: leaked"))
        released = len(run.log_records(r"chaos leak: released"))
        exhausted = run.log_records(r"the jobs' pool is exhausted")
        slot_timeouts = run.log_records(r"job slot failed(.|\n)*QueuePool limit")
        run.notes.append(f"{leaked} sessions leaked, {released} releases; {len(exhausted)} 'pool is exhausted' "
                         f"records, {len(slot_timeouts)} 'job slot failed' records on a pool timeout")
        overstated = _overstated_holders(run)
        if exhausted:
            run.notes.append(f"{len(overstated)} of {len(exhausted)} 'pool is exhausted' records count more "
                             "connections held by the worker's running jobs than the pool's checked-out ones minus "
                             "the leaked ones"
                             + (f", e.g. {overstated[0]}" if overstated else ""))
        if not leaked:
            problems.append("no handler leaked a session")
        if mode == "lease":
            if not exhausted:
                problems.append("no worker logged that the jobs' pool is exhausted")
            elif not all("held elsewhere" in r.text for r in exhausted):
                problems.append(f"a 'pool is exhausted' record does not say where the connections are: "
                                f"{exhausted[0].text[:300]!r}")
        elif not (exhausted or slot_timeouts):
            # A batch claims in its own session: when that session gets no
            # connection nothing was claimed, and nothing is handed back.
            problems.append("no worker logged that a batch's session timed out on the jobs' pool")
        return problems

    _drain(run, None, checks, _handed_back)


TOO_MANY = r"too many clients|remaining connection slots are reserved"


def _slow_enough(i: int, rng: random.Random) -> tuple[str, dict[str, Any]]:
    """Jobs of 20-60 ms: a drain of 2,000 outlasts filling the server and holding it full."""
    return "effect", {"sleep": round(rng.uniform(0.02, 0.06), 4)}


@pytest.mark.parametrize("mode", MODES + AIO_MODES)
def test_max_connections_exhausted(make_run: MakeRun, mode: str) -> None:
    """At 2% of the drain, the test opens connections to the server (raw
    psycopg, as another application would; four threads) until it refuses
    them, keeps it full for 5 s, taking every slot that frees up, then closes
    them all. The application's engine has no pool (NullPool: a connection
    per session, as applications behind PgBouncer often have), so every job
    session (lease mode) and every batch (transaction mode) connects; jobs
    take 20-60 ms. Expected: a job whose session could not
    connect is handed back without spending an attempt: no job used more
    attempts than its handler started (the run logs); nothing lost or
    committed twice."""
    run = make_run("max_connections", mode, jobs=JOBS, payload=_slow_enough, worker_args=["--null-pool"],
                   drain_timeout=120.0)
    hold = 5.0
    refused: list[str] = []

    def inject(run: Run) -> None:
        if not run.wait_progress(0.02):
            return
        held: list[psycopg.Connection[Any]] = []
        lock = threading.Lock()
        full = threading.Event()

        def connect(timeout: int) -> bool:
            try:
                conn = psycopg.connect(run.server.url, autocommit=True, connect_timeout=timeout,
                                       application_name="chaos-hog")
            except psycopg.OperationalError as exc:
                with lock:
                    refused.append(str(exc).strip())
                return False
            with lock:
                held.append(conn)
            return True

        def fill() -> None:
            deadline = time.monotonic() + 60
            while not full.is_set() and time.monotonic() < deadline:
                if not connect(5):
                    full.set()

        try:
            fillers = [threading.Thread(target=fill, name=f"filler-{n}", daemon=True) for n in range(4)]
            for thread in fillers:
                thread.start()
            for thread in fillers:
                thread.join(timeout=90)
            at = time.time()
            until = time.monotonic() + hold
            while time.monotonic() < until and run.pause(0.05):
                connect(2)  # a slot that freed up (a worker closed a connection)
        finally:
            with lock:
                for conn in held:
                    conn.close()
                count = len(held)
        run.faults.append(Fault("server full", at, time.time()))
        run.notes.append(f"the test held up to {count} connections; the server refused the first of "
                         f"{len(refused)} attempts with {refused[:1]}")

    def checks(run: Run) -> list[str]:
        problems = _attempt_problems(run)
        if not refused or not re.search(TOO_MANY, refused[0]):
            problems.append(f"the server was not filled: {refused[:1]}")
        hit = run.log_records(TOO_MANY)
        unstarted = [r for r in hit if "handed back unstarted" in r.text]
        batches = [r for r in hit if "job slot failed" in r.text or "a batch failed" in r.text]
        own = [r for r in hit if re.search(OWN_STATEMENT_FAILED, r.text)]
        run.notes.append(f"{len(hit)} worker log records of a refused connection: {len(unstarted)} job sessions "
                         f"handed back unstarted, {len(batches)} batches that could not connect, {len(own)} "
                         "statements of the worker's own")
        lost_hand_backs = run.log_records(r"handing back \d+ jobs failed")
        if lost_hand_backs:
            run.notes.append(f"{len(lost_hand_backs)} hand-back(s) failed (the worker's own pool could not connect "
                             "either), leaving their jobs to the reaper, which counts the attempt")
        if not (unstarted if _leases(mode) else batches):
            problems.append("no job session (lease mode) or batch (transaction mode) was refused a connection: "
                            "the fault did not bite")
        return problems

    _drain(run, inject, checks, _handed_back)


@pytest.mark.parametrize("mode", MODES)
def test_bulk_enqueue_with_dedupe_keys_from_many_producers(make_run: MakeRun, mode: str) -> None:
    """While the workers drain the feeder's jobs, 20 producer processes
    (``chaosapp.py produce``) call ``enqueue_many`` for 20 s, each call with
    14 specs whose dedupe keys are drawn from 60 (two of them twice), in a
    shuffled order, each in a transaction that stays open up to 20 ms after
    the insert; a call's ``chaos_batches`` row lists the ids it returned.
    Expected: no producer ever meets a deadlock (the library writes keyed rows
    in one global order) or any other error; every returned job has its
    spec's key; keys were really shared (calls got back jobs of other
    transactions); at no time do two live jobs share a key (sampled every
    0.2 s; the table's partial unique index); every job, the producers'
    included, completes exactly once."""
    producers, seconds = 20, 20.0
    run = make_run("bulk_dedupe", mode, jobs=JOBS, drain_timeout=120.0)
    index = run.query("SELECT indexdef FROM pg_indexes WHERE indexname = 'uq_chaos_jobs_dedupe_v1'")
    assert index and "UNIQUE" in index[0][0], index
    run.start()
    procs = [
        run.spawn_helper(f"producer-{n}", "produce", run.url_for_workers(), "--producer", str(n),
                         "--seed", str(run.rng.getrandbits(32)), "--seconds", str(seconds), "--keys", "60",
                         "--per-call", "12", "--batch-base", str(PRODUCER_BATCHES + n * 100_000))
        for n in range(producers)
    ]
    twins: list[tuple[str, int]] = []
    samples = 0
    deadline = time.monotonic() + seconds + 120
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        twins += run.query(
            "SELECT dedupe_key, count(*) FROM chaos_jobs WHERE dedupe_key IS NOT NULL "
            "AND status IN ('pending', 'running') GROUP BY dedupe_key HAVING count(*) > 1"
        )
        samples += 1
        time.sleep(0.2)
    stats, problems = [], []
    for n, proc in enumerate(procs):
        try:
            out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            problems.append(f"producer {n} (PID {proc.pid}) did not finish")
            continue
        if proc.returncode != 0 or not out.strip():
            problems.append(f"producer {n} exited with {proc.returncode}: see producer-{n}.log")
            continue
        stats.append(json.loads(out.strip().splitlines()[-1]))
    drained = run.wait_drained()
    run.end_faults()
    total = Counter[str]()
    errors = Counter[str]()
    for one in stats:
        total.update({k: one[k] for k in ("calls", "committed", "rows", "inserted", "deduped", "wrong_key")})
        errors.update(one["errors"])
    messages = [m for one in stats for m in one["messages"]]
    if errors.get("40P01"):
        problems.append(f"{errors['40P01']} deadlock(s) in the producers: {messages[:1]}")
    if errors:
        problems.append(f"producer errors by SQLSTATE: {dict(errors)}: {messages[:2]}")
    if total["wrong_key"]:
        problems.append(f"{total['wrong_key']} returned job(s) with another dedupe key than the spec's")
    if not total["deduped"] or not total["inserted"]:
        problems.append(f"the keys did not overlap: {dict(total)}")
    if twins:
        problems.append(f"two live jobs shared a dedupe key in {len(twins)} of {samples} samples: {twins[:3]}")
    run.extra_faults["producers"] = producers
    run.notes.append(f"{producers} producers, {total['calls']} calls ({total['committed']} committed), "
                     f"{total['rows']} rows returned: {total['inserted']} new jobs, {total['deduped']} deduped; "
                     f"{samples} samples of live jobs per key")
    run.finish(drained, problems).assert_ok()
