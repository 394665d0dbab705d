"""The fault suite: drains of thousands of jobs while workers, connections and
the server fail. Run it with ``pytest -m chaos`` (excluded from the default run).

Each scenario runs in both execution modes with worker processes of
``chaosapp.py`` (3 workers x 4 threads, lease 3 s, LISTEN on unless said
otherwise) and checks, through :meth:`harness.Run.finish`, that every job
ended done or dead (none lost, none stuck) and that no job's database effect
committed twice, plus its own checks. See docs/reliability.md.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable
from typing import Any

import pytest
from bouncer import PgBouncer
from chaosapp import HOLD_QUERY
from harness import LISTENER_APP_NAME, Fault, Run
from pgserver import PgServer
from tcpproxy import TcpProxy

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(900)]
MODES = ["lease", "transaction"]
JOBS = int(os.environ.get("CHAOS_JOBS", "2000"))
MakeRun = Callable[..., Run]
GLOBAL_FAULTS = {"restart", "cut (reset)", "half-open"}


def _drain(run: Run, injector: Callable[[Run], None] | None, extra: Callable[[Run], list[str]] | None = None) -> None:
    """Start, wait for the drain, run the scenario's own checks, finish, assert."""
    run.start(injector)
    drained = run.wait_drained()
    run.end_faults()
    problems = extra(run) if extra is not None else []
    run.finish(drained, problems).assert_ok()


def _listeners_back(run: Run) -> list[str]:
    """Every worker has a listener connected since the start of the last fault
    that hit every connection (a restart, a cut, a half-open), or at all."""
    since = max((f.at for f in run.faults if f.kind in GLOBAL_FAULTS), default=run.started_at)
    if run.wait_listeners(since):
        return []
    return [f"only {run.listeners_since(since)} of {len(run.live_workers())} listeners connected after the faults"]


@pytest.mark.parametrize("mode", MODES)
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


@pytest.mark.parametrize("mode", MODES)
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


@pytest.mark.parametrize("mode", MODES)
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


@pytest.mark.parametrize("mode", MODES)
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


@pytest.mark.parametrize("mode", MODES)
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


@pytest.mark.parametrize("mode", MODES)
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


@pytest.mark.parametrize("mode", MODES)
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
            if mode == "lease":
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
    if mode == "lease":
        # Each frozen worker's stale completion was refused by the fence.
        frozen_results = {pid: run.results.get(pid, {}).get("lost", 0) for _, pid in stale}
        assert stale and all(n >= 1 for n in frozen_results.values()), frozen_results


@pytest.mark.parametrize("mode", MODES)
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


@pytest.mark.parametrize("mode", MODES)
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
