"""Round trips per job of each execution path, counted at the driver.

::

    .venv/bin/python benchmarks/roundtrips.py [--jobs 2000]

Runs a worker in this process over ``--jobs`` jobs per path, on a fresh
database (``DATABASE_URL``, else an embedded PostgreSQL), and prints a
Markdown table: per job, how many statements of each kind psycopg sent
(``BEGIN``, ``COMMIT``, ``SAVEPOINT``… sent as commands, and every cursor
execute, the claim and the completion named). Not a timing: it says how many
times each job waits on the server, which is what a path's throughput on a
busy database comes down to. The counting wraps psycopg's two sending
methods in this process only.
"""

from __future__ import annotations

import argparse
import collections
import sys
import threading
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import psycopg  # noqa: E402
from common import LEDGER, Databases, server  # noqa: E402
from psycopg import _connection_base  # noqa: E402

_counts: collections.Counter[str] = collections.Counter()
_lock = threading.Lock()


def _count(word: str) -> None:
    with _lock:
        _counts[word] += 1


def _instrument() -> None:
    send_command = _connection_base.BaseConnection._exec_command
    execute = psycopg.Cursor.execute

    def counted_command(self: Any, command: Any, *args: Any, **kwargs: Any) -> Any:
        text = bytes(command) if isinstance(command, (bytes, bytearray)) else str(command).encode()
        _count(text.split()[0].decode().upper())
        return send_command(self, command, *args, **kwargs)

    def counted_execute(self: Any, query: Any, *args: Any, **kwargs: Any) -> Any:
        text = query if isinstance(query, str) else bytes(query).decode() if isinstance(query, bytes) else str(query)
        word = text.lstrip().split()[0].upper()
        if "SKIP LOCKED" in text and "picked" in text:
            word = "claim"
        elif "SKIP LOCKED" in text and "expired" in text:
            word = "reap"
        elif word == "DELETE" and "lock_token" in text:
            word = "completion"
        elif word == "INSERT" and LEDGER in text:
            word = "handler INSERT"
        _count(word)
        return execute(self, query, *args, **kwargs)

    _connection_base.BaseConnection._exec_command = counted_command  # type: ignore[method-assign]
    psycopg.Cursor.execute = counted_execute  # type: ignore[method-assign]


PATHS = [
    ("(a) lease, batched completion", "noop", "lease", 1, None),
    ("(a) lease, batched completion", "noop", "lease", 4, 100),
    ("(b) lease, completion in the job's session", "ledger", "lease", 4, 100),
    ("(c) transaction mode", "ledger", "transaction", 4, 100),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=2000)
    args = parser.parse_args()
    _instrument()
    from sqlalchemy import create_engine, text
    from sqlalchemy.orm import Session

    from sa_jobqueue import JobRepository, JobSpec, TaskRegistry, Worker
    from sa_jobqueue.default import Job

    tasks = TaskRegistry()

    @tasks.task("noop")
    def noop(job: Job) -> None:
        pass

    @tasks.task("ledger")
    def ledger(job: Job, session: Session) -> None:
        session.execute(text(f"INSERT INTO {LEDGER} (job_id) VALUES (:id)"), {"id": job.id})

    jobs = JobRepository(Job)
    rows = []
    with server() as (server_url, _):
        databases = Databases(server_url)
        try:
            for label, task, mode, concurrency, batch in PATHS:
                with databases.fresh() as url:
                    engine = create_engine(url)
                    with Session(engine) as session, session.begin():
                        jobs.enqueue_many(session, [JobSpec(task) for _ in range(args.jobs)])
                    _counts.clear()
                    worker = Worker(engine, jobs, tasks, mode=mode, concurrency=concurrency, batch_size=batch,
                                    listen=False)
                    result = worker.run(until_empty=True)
                    counts = dict(_counts)
                    engine.dispose()
                    if result.completed != args.jobs:
                        raise SystemExit(f"{label}: {result.completed} of {args.jobs} completed")
                    rows.append((label, mode, concurrency, batch, counts))
        finally:
            databases.close()
    kinds = sorted({k for *_, counts in rows for k in counts})
    print(f"Round trips per job ({args.jobs} jobs per path, `benchmarks/roundtrips.py`)\n")
    print("| path | C | batch_size | " + " | ".join(kinds) + " | total |")
    print("| --- | ---: | ---: | " + " | ".join("---:" for _ in kinds) + " | ---: |")
    for label, _mode, concurrency, batch, counts in rows:
        cells = [f"{counts.get(k, 0) / args.jobs:.3f}".rstrip("0").rstrip(".") or "0" for k in kinds]
        total = sum(counts.values()) / args.jobs
        print(f"| {label} | {concurrency} | {batch or '—'} | " + " | ".join(cells) + f" | {total:.2f} |")


if __name__ == "__main__":
    main()
