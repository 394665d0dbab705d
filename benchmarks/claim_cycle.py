"""A claim of 100 and its batched completion, alone: the library's statements against the raw batch loop's.

::

    .venv/bin/python benchmarks/claim_cycle.py [--jobs 40000] [--rounds 2]

Path (a) of ``benchmarks/run.py`` (handlers without a session, batched
completions) does little per job besides claiming it and completing it, so
this times those two on one connection, one after the other, with nothing
else running in the process: on a fresh database holding ``--jobs`` pending
jobs (``DATABASE_URL``, else an embedded PostgreSQL), claim 100 and complete
them until the queue is empty. The library's cycle is what a lease-mode
worker runs: ``sa_jobqueue.worker.lease.claim_on`` on an autocommit
connection kept across claims (the claim statement, the rows decoded into
snapshots), then the completer's write: ``JobRepository.completions.many_on``
on a connection checked out of the worker's own autocommit engine for it
(cores before it: ``JobRepository.complete_many`` in a session of that
engine, as their completer wrote). The raw cycle is
the raw batch loop's two statements through psycopg (``BATCH_CLAIM``,
``BATCH_DELETE``). Rounds alternate between the two.

Printed per cycle (medians over the cycles of a round, µs): the claim's and
the completion's wall time and this thread's CPU time (``time.thread_time``:
Python, libpq, the kernel), and per job the whole cycle's wall time. Wall
minus CPU is the time spent waiting for the server (and the network): what
the server does for the statement.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import psycopg  # noqa: E402
from common import BATCH_CLAIM, BATCH_DELETE, QUEUE, Databases, copy_jobs, libpq, server  # noqa: E402
from sqlalchemy import create_engine  # noqa: E402
from sqlalchemy.engine import URL  # noqa: E402
from sqlalchemy.orm import Session  # noqa: E402

import sa_jobqueue  # noqa: E402
from sa_jobqueue import JobRepository  # noqa: E402
from sa_jobqueue.default import Job  # noqa: E402
from sa_jobqueue.worker.lease import claim_on  # noqa: E402

BATCH = 100
Cycle = tuple[float, float, float, float]  # claim wall, claim CPU, completion wall, completion CPU (seconds)


def _timed(call: Callable[..., Any], *args: Any) -> tuple[Any, float, float]:
    wall, cpu = time.perf_counter(), time.thread_time()
    out = call(*args)
    return out, time.perf_counter() - wall, time.thread_time() - cpu


def raw_cycles(url: URL) -> list[Cycle]:
    """The raw batch loop's claim and delete, until the queue is empty."""
    cycles: list[Cycle] = []
    with psycopg.connect(libpq(url), autocommit=True) as conn:
        while True:
            rows, claim_wall, claim_cpu = _timed(lambda: conn.execute(BATCH_CLAIM, (QUEUE, BATCH)).fetchall())
            if not rows:
                return cycles
            ids = [row[0] for row in rows]
            _, done_wall, done_cpu = _timed(conn.execute, BATCH_DELETE, (ids,))
            cycles.append((claim_wall, claim_cpu, done_wall, done_cpu))


def library_cycles(url: URL) -> list[Cycle]:
    """A lease-mode worker's claim on a kept connection and its completer's write, until the queue is empty."""
    jobs = JobRepository(Job)
    engine = create_engine(url).execution_options(isolation_level="AUTOCOMMIT")
    params = {"queues": [QUEUE], "limit": BATCH, "worker": "claim-cycle", "lease": timedelta(minutes=5)}
    cycles: list[Cycle] = []

    def complete(claimed: list[Job]) -> None:
        if hasattr(jobs, "completions"):
            with engine.connect() as connection:
                jobs.completions.many_on(connection, claimed)
                connection.commit()
            return
        with Session(engine) as session, session.begin():
            jobs.complete_many(session, claimed)

    try:
        with engine.connect() as conn:
            while True:
                claimed, claim_wall, claim_cpu = _timed(claim_on, jobs, conn, params)
                if not claimed:
                    return cycles
                _, done_wall, done_cpu = _timed(complete, claimed)
                cycles.append((claim_wall, claim_cpu, done_wall, done_cpu))
    finally:
        engine.dispose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=40_000)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    loops = [("raw batch loop", raw_cycles), ("sa_jobqueue", library_cycles)]
    results: list[tuple[str, list[Cycle]]] = []
    with server() as (server_url, _):
        databases = Databases(server_url)
        try:
            for _ in range(args.rounds):
                for label, run in loops:
                    with databases.fresh() as url:
                        copy_jobs(libpq(url), args.jobs, "noop")
                        results.append((label, run(url)))
        finally:
            databases.close()
    print(f"A claim of {BATCH} and its completion, one connection ({args.jobs} jobs per round, "
          f"`benchmarks/claim_cycle.py`, sa_jobqueue from {Path(sa_jobqueue.__file__).parent}; "
          "medians per cycle, µs)\n")
    print("| cycle | claim wall | claim CPU | completion wall | completion CPU | whole cycle per job |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for label, cycles in results:
        medians = [statistics.median(c[i] for c in cycles) * 1e6 for i in range(4)]
        per_job = sum(sum(c[::2]) for c in cycles) / args.jobs * 1e6
        print(f"| {label} | " + " | ".join(f"{m:,.0f}" for m in medians) + f" | {per_job:.1f} |")


if __name__ == "__main__":
    main()
