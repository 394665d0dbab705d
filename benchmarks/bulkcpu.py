"""Bulk enqueue in one process: per row, wall time, CPU time and the cyclic garbage collector's time.

::

    .venv/bin/python benchmarks/bulkcpu.py [--rows 5000] [--chunks 6] [--rounds 5]

On a fresh database (``DATABASE_URL``, else an embedded PostgreSQL), each round
writes ``--chunks`` chunks of ``--rows`` jobs, one transaction per chunk,
through ``enqueue_many``, through ``enqueue_many_fast`` (a core without it
skips it) and through a raw psycopg COPY of the same columns, the JobSpecs (or
the raw rows) built inside the timing, as a caller builds them. Prints
Markdown: per way, the medians over the rounds of the microseconds per row of
wall time, of this process's CPU (user + system: the client's own work, which
a busy neighbour on the machine changes much less than the wall time) and of
garbage collection (``gc.callbacks``), and the full (generation 2)
collections per chunk. Where the wall time is well above the CPU time, the
client waits for the server.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import psycopg  # noqa: E402
from common import COPY_JOBS, QUEUE, Databases, libpq, server  # noqa: E402
from psycopg.types.json import Jsonb  # noqa: E402

TASK = "bench"


class GcClock:
    """Time spent in the cyclic garbage collector, and its full collections, while installed."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.full = 0
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        self.seconds += time.perf_counter() - self._started
        self.full += info["generation"] == 2


def measure(write: Callable[[int], None], chunks: int, rows: int) -> tuple[float, float, float, float]:
    """(wall, CPU, GC) microseconds per row and full collections per chunk of ``chunks`` calls of ``write``."""
    clock = GcClock()
    gc.callbacks.append(clock)
    try:
        wall, cpu = time.perf_counter(), time.process_time()
        for chunk in range(chunks):
            write(chunk * rows)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    finally:
        gc.callbacks.remove(clock)
    per_row = 1e6 / (chunks * rows)
    return wall * per_row, cpu * per_row, clock.seconds * per_row, clock.full / chunks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=5_000, help="jobs per chunk (5,000)")
    parser.add_argument("--chunks", type=int, default=6, help="chunks per round and way (6)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds, the ways interleaved (5)")
    args = parser.parse_args()

    from sqlalchemy import create_engine
    from sqlalchemy.orm import Session

    from sa_jobqueue import JobRepository, JobSpec
    from sa_jobqueue.default import Job

    with server() as (server_url, _):
        databases = Databases(server_url)
        try:
            with databases.fresh() as url:
                engine = create_engine(url, pool_size=1)
                repo = JobRepository(Job)
                raw = psycopg.connect(libpq(url))

                def through(verb: Callable[[Session, list[Any]], Any]) -> Callable[[int], None]:
                    def write(start: int) -> None:
                        specs = [JobSpec(TASK, {"n": n}, queue=QUEUE) for n in range(start, start + args.rows)]
                        with Session(engine) as session, session.begin():
                            verb(session, specs)
                    return write

                def copy(start: int) -> None:
                    with raw.cursor() as cursor, cursor.copy(COPY_JOBS) as writer:
                        for n in range(start, start + args.rows):
                            writer.write_row((TASK, QUEUE, Jsonb({"n": n})))
                    raw.commit()

                ways: dict[str, Callable[[int], None]] = {"enqueue_many": through(repo.enqueue_many)}
                if hasattr(repo, "enqueue_many_fast"):
                    ways["enqueue_many_fast"] = through(repo.enqueue_many_fast)
                ways["raw COPY"] = copy
                for write in ways.values():  # warm up: connections, statements, the table's first pages
                    write(0)
                figures: dict[str, list[tuple[float, float, float, float]]] = {name: [] for name in ways}
                for _ in range(args.rounds):
                    for name, write in ways.items():
                        figures[name].append(measure(write, args.chunks, args.rows))
                raw.close()
                engine.dispose()
        finally:
            databases.close()

    print(f"{args.rounds} rounds of {args.chunks} chunks of {args.rows:,} jobs; medians, µs per row\n")
    print("| way | wall | CPU | of which GC | full collections per chunk |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, rows in figures.items():
        wall, cpu, in_gc, full = (statistics.median(values) for values in zip(*rows, strict=True))
        print(f"| {name} | {wall:.1f} | {cpu:.1f} | {in_gc:.1f} | {full:.1f} |")


if __name__ == "__main__":
    main()
