"""Where a notified job's wait goes: enqueue commit to handler start, in parts.

::

    .venv/bin/python benchmarks/latency_parts.py [--jobs 200] [--gap 0.02] [--rounds 3]

``run.py --only latency`` times the whole wait; this splits it. A worker
(lease mode, path (a)'s handler without a session, concurrency 4, listen
on) runs in this process with marks wrapped around the library's own steps:
the notification's arrival, the claim's start in a claimer thread, the
claim statement (``Claimer.claim_on``: the round trip and the snapshots),
the jobs' hand-off to the slots, the slot's start and the handler's. A
producer process enqueues ``--jobs`` jobs ``--gap`` seconds apart, one
transaction each, and records when each commit returned
(``time.monotonic()`` is the machine's CLOCK_MONOTONIC, shared by the
processes). Each part is the median, over the jobs, of the time from one
mark to the next mark of the same job's path. The raw batch loop of
``run.py`` (four threads claiming 100 with a CTE, a listener thread waking
them) runs too, in rounds alternating with the worker's, for the whole
wait it is compared with.

The marks wrap private methods, so this script follows the core's
internals and may need changing with them; ``run.py``'s figures do not.
For another revision of the core, import it from a snapshot:
``git archive REV sa_jobqueue | tar -x -C DIR`` and ``PYTHONPATH=DIR``.
"""

from __future__ import annotations

import argparse
import bisect
import json
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import psycopg  # noqa: E402
from common import BATCH_CLAIM, BATCH_DELETE, CHANNEL, QUEUE, RAW_INSERT, Databases, libpq, server  # noqa: E402

MARKS = ("notify", "claim thread", "claim", "claimed", "handed off", "slot", "handler")

_PRODUCER = """
import json, sys, time
import psycopg
from psycopg.types.json import Jsonb
from sqlalchemy import create_engine
from sqlalchemy.orm import Session
from sa_jobqueue import JobRepository
from sa_jobqueue.default import Job
dsn, kind, jobs, gap, insert, channel, queue = sys.argv[1:8]
commits = []
if kind == "sajq":
    engine, repo = create_engine(dsn.replace("postgresql://", "postgresql+psycopg://", 1)), JobRepository(Job)
    for _ in range(int(jobs)):
        with Session(engine) as session, session.begin():
            job_id = repo.enqueue(session, "bench", {}, queue=queue).id
        commits.append((job_id, time.monotonic()))
        time.sleep(float(gap))
else:
    conn = psycopg.connect(dsn)
    for _ in range(int(jobs)):
        job_id = conn.execute(insert, ("bench", queue, Jsonb({}))).fetchone()[0]
        conn.execute(f"NOTIFY {channel}")
        conn.commit()
        commits.append((job_id, time.monotonic()))
        time.sleep(float(gap))
print(json.dumps(commits))
"""


def produce(dsn: str, kind: str, args: argparse.Namespace) -> dict[int, float]:
    out = subprocess.run([sys.executable, "-c", _PRODUCER, dsn, kind, str(args.jobs), str(args.gap), RAW_INSERT,
                          CHANNEL, QUEUE], capture_output=True, text=True, check=True)
    return {job_id: at for job_id, at in json.loads(out.stdout.strip().splitlines()[-1])}


def wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit(f"latency_parts: timed out waiting for {what}")
        time.sleep(0.05)


def worker_round(dsn: str, args: argparse.Namespace) -> tuple[list[float], dict[str, list[float]]]:
    """The worker's waits (µs) and its parts (µs, by 'mark -> next mark')."""
    from sqlalchemy import create_engine

    from sa_jobqueue import JobRepository, TaskRegistry, Worker
    from sa_jobqueue.claim import Claimer
    from sa_jobqueue.default import Job
    from sa_jobqueue.worker import executor, lease, threaded

    events: list[tuple[float, str]] = []
    started: dict[int, float] = {}
    undo: list[tuple[Any, str, Any]] = []

    def wrap(owner: Any, name: str, before: str, after: str | None = None) -> None:
        original = getattr(owner, name)

        def marked(*a: Any, **k: Any) -> Any:
            events.append((time.monotonic(), before))
            try:
                return original(*a, **k)
            finally:
                if after is not None:
                    events.append((time.monotonic(), after))

        undo.append((owner, name, original))
        setattr(owner, name, marked)

    wrap(threaded.Worker, "_on_notify_any", "notify")
    wrap(lease.LeaseMode, "_claim_into", "claim thread")
    # Cores before Claimer.claim_on claimed in a session: their claim's mark
    # starts at Claimer.claim, its session made and begun before it.
    wrap(Claimer, "claim_on" if hasattr(Claimer, "claim_on") else "claim", "claim", "claimed")
    wrap(lease.LeaseMode, "_submit", "handed off")
    wrap(executor.JobExecutor, "run", "slot")
    engine = create_engine(dsn.replace("postgresql://", "postgresql+psycopg://", 1), pool_size=6)
    tasks = TaskRegistry()

    def bench(job: Any) -> None:
        started.setdefault(job.id, time.monotonic())

    tasks.register("bench", bench)
    worker = Worker(engine, JobRepository(Job), tasks, queues=[QUEUE], concurrency=4, poll_interval=1.0)
    runner = threading.Thread(target=worker.run, daemon=True)
    try:
        runner.start()
        time.sleep(1.5)  # idle: the worker has backed off to its poll interval
        commits = produce(dsn, "sajq", args)
        wait_until(lambda: len(started) >= len(commits), 30, "the worker's jobs")
    finally:
        worker.stop()
        runner.join(30)
        engine.dispose()
        for owner, name, original in undo:
            setattr(owner, name, original)
    events.sort()
    times = [at for at, _ in events]
    parts: dict[str, list[float]] = {}
    for job_id, committed in commits.items():
        # The notification may arrive before the producer sees its commit return.
        at, chain = committed - 0.005, []
        for mark in MARKS[:-1]:
            i = bisect.bisect_left(times, at)
            while i < len(events) and events[i][1] != mark:
                i += 1
            if i == len(events) or events[i][0] > started[job_id]:
                break
            at = events[i][0]
            chain.append(at)
        else:
            chain.append(started[job_id])
            for i in range(len(chain) - 1):
                parts.setdefault(f"{MARKS[i]} -> {MARKS[i + 1]}", []).append((chain[i + 1] - chain[i]) * 1e6)
    return [(started[j] - c) * 1e6 for j, c in commits.items()], parts


def raw_round(dsn: str, args: argparse.Namespace) -> list[float]:
    """The raw batch loop's waits (µs)."""
    stop, wake, generation = threading.Event(), threading.Condition(), [0]
    started: dict[int, float] = {}

    def batch() -> None:
        with psycopg.connect(dsn, autocommit=True) as conn:
            while not stop.is_set():
                seen = generation[0]
                rows = conn.execute(BATCH_CLAIM, (QUEUE, 100)).fetchall()
                if not rows:
                    with wake:
                        wake.wait_for(lambda seen=seen: generation[0] != seen or stop.is_set(), 1.0)
                    continue
                for job_id, _ in rows:
                    started[job_id] = time.monotonic()
                conn.execute(BATCH_DELETE, ([row[0] for row in rows],))

    def listen() -> None:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(f"LISTEN {CHANNEL}")
            while not stop.is_set():
                for _ in conn.notifies(timeout=0.2, stop_after=1):
                    with wake:
                        generation[0] += 1
                        wake.notify_all()

    threads = [threading.Thread(target=batch, daemon=True) for _ in range(4)]
    threads.append(threading.Thread(target=listen, daemon=True))
    for thread in threads:
        thread.start()
    try:
        time.sleep(1.5)
        commits = produce(dsn, "raw", args)
        wait_until(lambda: len(started) >= len(commits), 30, "the raw loop's jobs")
    finally:
        stop.set()
        with wake:
            wake.notify_all()
        for thread in threads:
            thread.join(10)
    return [(started[j] - c) * 1e6 for j, c in commits.items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument("--gap", type=float, default=0.02)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    waits: dict[str, list[float]] = {"worker": [], "raw": []}
    parts: dict[str, list[float]] = {}
    with server() as (url, _):
        dbs = Databases(url)
        try:
            for n in range(args.rounds):
                for kind in (("worker", "raw") if n % 2 == 0 else ("raw", "worker")):
                    with dbs.fresh() as fresh:
                        dsn = libpq(fresh)
                        if kind == "raw":
                            waits["raw"].append(statistics.median(raw_round(dsn, args)))
                        else:
                            wait, found = worker_round(dsn, args)
                            waits["worker"].append(statistics.median(wait))
                            for name, values in found.items():
                                parts.setdefault(name, []).append(statistics.median(values))
        finally:
            dbs.close()
    print(f"| part of the wait (medians of {args.rounds} rounds' medians) | µs |")
    print("| --- | ---: |")
    for name, values in parts.items():
        print(f"| {name} | {statistics.median(values):,.0f} |")
    worker, raw = statistics.median(waits["worker"]), statistics.median(waits["raw"])
    print(f"| the whole wait, worker (p50) | {worker:,.0f} |")
    print(f"| the whole wait, raw batch loop (p50) | {raw:,.0f} |")
    print(f"| ratio | {worker / raw:.2f}x |")


if __name__ == "__main__":
    main()
