"""Scale out: worker processes on three hosts, through PgBouncer in transaction mode, to one PostgreSQL.

::

    .venv/bin/python benchmarks/scale.py                                  # 1, 2, 4, 8 processes; ~3 min
    .venv/bin/python benchmarks/scale.py --processes 1,2 --jobs 2000 --runs 1
    DATABASE_URL=postgresql://postgres@127.0.0.1:5432/test .venv/bin/python benchmarks/scale.py

Not part of ``pytest`` (``tests/test_scale_out.py`` runs a small case of it):
a separate command, as root, with ``ip`` and ``pgbouncer`` installed
(``apt-get install iproute2 pgbouncer``). It prints Markdown.

The hosts are three network namespaces of its own (``hosts.py``), linked to
this machine by veth pairs; their only way to the database is a PgBouncer of
its own in transaction pooling mode, listening on the links' far ends, with
at most ``--pool-size`` server connections. For each number of processes P
(interleaved over ``--runs`` rounds, a fresh database each time):

* ``--jobs`` jobs are enqueued with COPY (not measured);
* P worker processes (``child.py sajq --path b``: lease mode, a handler that
  writes one ledger row in the job's session, so each job's write commits
  with its completion; ``--path a``: a handler without session, completions
  batched; ``--path t``: path b's handler with ``group_commit=True`` in
  transaction mode, with ``--batch-size``) start round-robin on the three hosts, each with
  ``--concurrency`` threads, ``listen=False`` (LISTEN needs a session of its
  own) and no prepared statements (PgBouncer 1.18 cannot track them);
* they start together and run until the queue is empty; the wall time runs
  from the start to the last process's end.

Then it checks that nothing was lost and nothing ran twice: every job ran
(path b: its ledger row committed), exactly once; no handler ran twice (each
process reports the ids it ran); the job table is empty; no attempt failed. It samples,
every 0.2 s, the server connections PostgreSQL has for the database and the
client connections PgBouncer holds, and reports their peaks. The reference
row is one process connected straight to PostgreSQL, from this machine, with
prepared statements: what PgBouncer and the hosts cost.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import hosts  # noqa: E402
import psycopg  # noqa: E402
from common import LEDGER, TABLE, ChildProcess, Databases, copy_jobs, libpq, server  # noqa: E402
from sqlalchemy.engine import URL  # noqa: E402

CHILD = str(Path(__file__).resolve().parent / "child.py")
TASK = "bench"  # child.py's task name
HOSTS = 3
PATHS = {
    "a": "path a (handler without session, batched completion)",
    "b": "path b (handler writes one row in the job's session)",
    "t": "path t (path b's handler with group_commit=True, in transaction mode)",
}


class Peaks:
    """Samples, every 0.2 s in a thread, the database's server connections
    (``pg_stat_activity``) and PgBouncer's client connections (``SHOW POOLS``)."""

    def __init__(self, direct: str, database: str, bouncer: str | None) -> None:
        self.direct, self.database, self.bouncer = direct, database, bouncer
        self.server = self.clients = 0
        self.addresses: set[str] = set()  # PgBouncer's clients' addresses: the hosts the workers ran on
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        try:
            self.sample()
        except BaseException as exc:  # raised again by stop(): a peak that was not measured is no peak
            self.error = exc

    def sample(self) -> None:
        with psycopg.connect(self.direct, autocommit=True) as pg:
            admin = None
            if self.bouncer is not None:
                # The admin console speaks the simple query protocol only.
                admin = psycopg.connect(self.bouncer, autocommit=True, cursor_factory=psycopg.ClientCursor)
            try:
                while not self.done.wait(0.2):
                    row = pg.execute(
                        "SELECT count(*) FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid()",
                        (self.database,),
                    ).fetchone()
                    self.server = max(self.server, int(row[0]) if row else 0)
                    if admin is not None:
                        pools = self.console(admin, "SHOW POOLS")
                        self.clients = max(self.clients, sum(int(r["cl_active"]) + int(r["cl_waiting"]) for r in pools))
                        self.addresses.update(str(r["addr"]) for r in self.console(admin, "SHOW CLIENTS"))
            finally:
                if admin is not None:
                    admin.close()

    def console(self, admin: psycopg.Connection[Any], command: str) -> list[dict[str, Any]]:
        """The rows of an admin console command that are about this database."""
        cur = admin.execute(command)
        names = [c.name for c in cur.description or []]
        rows = [dict(zip(names, row, strict=True)) for row in cur.fetchall()]
        return [r for r in rows if r["database"] == self.database]

    def stop(self) -> None:
        self.done.set()
        self.thread.join(timeout=30)
        if self.error is not None:
            raise RuntimeError("sampling the connections failed") from self.error


def drain(
    direct: str, database: str, processes: int, concurrency: int, jobs: int, places: list[tuple[list[str], str]],
    pooler: bool, bouncer: str | None, path: str = "b", batch_size: int = 0,
) -> dict[str, Any]:
    """One measurement: ``jobs`` jobs, ``processes`` workers at ``places`` (a
    command prefix and a DSN each, used round-robin) on child.py's ``path``.
    Returns the figures and the checks."""
    ids = set(copy_jobs(direct, jobs, TASK))
    children = []
    for n in range(processes):
        prefix, dsn = places[n % len(places)]
        argv = [sys.executable, CHILD, "sajq", dsn, "--path", path, "--concurrency", str(concurrency),
                "--listen", "off", "--record"] + (["--pooler"] if pooler else [])
        if batch_size:
            argv += ["--batch-size", str(batch_size)]
        children.append(ChildProcess(prefix + argv))
    try:
        for child in children:
            if child.lines.get(timeout=120) != "ready":
                raise RuntimeError("a worker process did not start")
        peaks = Peaks(direct, database, bouncer)
        start = time.perf_counter()
        for child in children:
            child.send("go")
        outs: list[dict[str, Any]] = []
        for child in children:
            line = child.lines.get(timeout=600)
            if line is None:
                raise RuntimeError(f"a worker process exited with {child.proc.wait(timeout=30)}")
            outs.append(json.loads(line))
        seconds = time.perf_counter() - start
        peaks.stop()
    finally:
        for child in children:
            child.kill()
    runs = [job_id for out in outs for job_id, _ in out["stamps"]]
    with psycopg.connect(direct) as conn:
        ledger = [r[0] for r in conn.execute(f"SELECT job_id FROM {LEDGER}")]
        left = conn.execute(f"SELECT count(*) FROM {TABLE}").fetchone()
    return {
        "seconds": seconds, "rate": jobs / seconds, "server": peaks.server, "clients": peaks.clients,
        "addresses": sorted(peaks.addresses),
        # Path b: a job whose ledger row did not commit is lost, whether or not its handler ran.
        "lost": len(ids - set(runs if path == "a" else ledger)), "twice": len(runs) - len(set(runs)),
        "strays": len(set(ledger) - ids), "left": int(left[0]) if left else -1,
        # Attempts that did not complete: a retry, a dead job, a lease lost, a cancel.
        "failed": sum(out["result"][k] for out in outs for k in ("retried", "dead", "lost", "cancelled")),
        "cpu": sum(out["cpu"] for out in outs),
    }


def server_address(url: URL) -> tuple[str, int]:
    """Host (or Unix socket directory) and port of the server, for PgBouncer."""
    host = url.host or url.query.get("host") or "/var/run/postgresql"
    return str(host if isinstance(host, str) else host[0]), int(url.port or url.query.get("port") or 5432)


@contextmanager
def deployment(server_url: URL, pool_size: int) -> Iterator[tuple[list[hosts.Host], hosts.Bouncer]]:
    """The hosts and, in front of the server, PgBouncer on their links; both removed on exit."""
    host, port = server_address(server_url)
    with hosts.hosts(HOSTS) as machines, hosts.pgbouncer(
        [m.gateway for m in machines], server_host=host, server_port=port,
        user=server_url.username or "postgres", password=server_url.password or "", pool_size=pool_size,
    ) as bouncer:
        yield machines, bouncer


def places(machines: list[hosts.Host], bouncer: hosts.Bouncer, url: URL) -> tuple[list[tuple[list[str], str]], str]:
    """Where worker processes run (each host's command prefix, and the DSN of
    ``url``'s database through PgBouncer from there), and the DSN of
    PgBouncer's admin console."""
    user = url.username or "postgres"
    at = [(m.command([]), f"postgresql://{user}@{m.gateway}:{bouncer.port}/{url.database}") for m in machines]
    return at, f"postgresql://{user}@{machines[0].gateway}:{bouncer.port}/pgbouncer"


def measure(args: argparse.Namespace, server_url: URL) -> tuple[dict[str, list[dict[str, Any]]], str]:
    databases = Databases(server_url)
    results: dict[str, list[dict[str, Any]]] = {}
    try:
        with deployment(server_url, args.pool_size) as (machines, bouncer):
            for _ in range(args.runs):
                for kind in ["direct"] + [str(p) for p in args.processes]:
                    with databases.fresh() as url:
                        direct, name = libpq(url), str(url.database)
                        if kind == "direct":
                            out = drain(direct, name, 1, args.concurrency, args.jobs, [([], direct)], False, None,
                                        args.path, args.batch_size)
                        else:
                            at, admin = places(machines, bouncer, url)
                            out = drain(direct, name, int(kind), args.concurrency, args.jobs, at, True, admin,
                                        args.path, args.batch_size)
                    results.setdefault(kind, []).append(out)
                    print(f"{kind}: {out['rate']:,.0f} jobs/s, server {out['server']}, clients {out['clients']}, "
                          f"lost {out['lost']}, twice {out['twice']}", file=sys.stderr, flush=True)
    finally:
        databases.close()
    return results, bouncer_version()


def bouncer_version() -> str:
    import subprocess

    out = subprocess.run(["pgbouncer", "--version"], capture_output=True, text=True).stdout
    return out.splitlines()[0] if out else "pgbouncer"


def report(args: argparse.Namespace, results: dict[str, list[dict[str, Any]]], version: str, source: str) -> str:
    def med(kind: str, key: str) -> float:
        return statistics.median(r[key] for r in results[kind])

    base = med("1", "rate")
    lines = [
        f"Scale out: {args.jobs:,} jobs per measurement, concurrency {args.concurrency} per process, "
        f"{PATHS[args.path]}, listen off{f', batch_size {args.batch_size}' if args.batch_size else ''}; "
        f"{HOSTS} hosts (network namespaces) through {version} in transaction mode, pool size {args.pool_size}; "
        f"server: {source}; medians of {args.runs} runs.",
        "",
        "| processes | hosts | jobs/s | x 1 process | CPU ms/job (workers) | server connections (peak) "
        "| client connections (peak) | lost | twice | attempts not completed |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for kind in ["direct"] + [str(p) for p in args.processes]:
        rows = results[kind]
        label = "1, straight to PostgreSQL (no PgBouncer, prepared statements)" if kind == "direct" else kind
        used = "–" if kind == "direct" else str(min(int(kind), HOSTS))
        clients = "–" if kind == "direct" else str(max(r["clients"] for r in rows))
        lines.append(
            f"| {label} | {used} | {med(kind, 'rate'):,.0f} | {med(kind, 'rate') / base:.2f}x "
            f"| {1000 * med(kind, 'cpu') / args.jobs:.2f} | {max(r['server'] for r in rows)} | {clients} "
            f"| {sum(r['lost'] + r['strays'] + r['left'] for r in rows)} | {sum(r['twice'] for r in rows)} "
            f"| {sum(r['failed'] for r in rows)} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--processes", default="1,2,4,8", type=lambda s: [int(p) for p in s.split(",")])
    parser.add_argument("--jobs", type=int, default=20_000)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--path", choices=sorted(PATHS), default="b", help="child.py's execution path")
    parser.add_argument("--batch-size", type=int, default=0, help="passed to the workers (transaction mode: "
                        "the jobs per batch; path t groups only within a batch)")
    parser.add_argument("--pool-size", type=int, default=16, help="PgBouncer's server connections per database")
    args = parser.parse_args()
    if 1 not in args.processes:
        parser.error("--processes must include 1 (the ratios are to one process)")
    why = hosts.missing()
    if why is not None:
        print(f"scale.py: {why}", file=sys.stderr)
        return 2
    with server() as (server_url, source):
        results, version = measure(args, server_url)
    print(report(args, results, version, source))
    bad = sum(r["lost"] + r["strays"] + r["left"] + r["twice"] + r["failed"] for rs in results.values() for r in rs)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
