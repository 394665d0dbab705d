"""The sa-jobqueue command line, run with click's CliRunner against the real PostgreSQL.

The tests use a database of their own on the test server, holding the
default job table (sa_jobqueue_jobs) and cli_tasks' ledger (cli_done).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import cli_tasks
import pytest
from click.testing import CliRunner, Result
from sqlalchemy import Engine, create_engine, func, select, text, update
from sqlalchemy.orm import Session
from waiting import wait_for

from sa_jobqueue import JobRepository, Worker
from sa_jobqueue.cli import format_age, main, parse_duration
from sa_jobqueue.default import Job

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
CLI_DOC = ROOT / "docs" / "cli.md"
repo = JobRepository(Job)


@pytest.fixture(scope="module")
def cli_engine(cli_url: str) -> Iterator[Engine]:
    from sa_jobqueue import psycopg_url

    engine = create_engine(psycopg_url(cli_url))
    yield engine
    engine.dispose()


@pytest.fixture(autouse=True)
def _empty(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "cli_engine" in request.fixturenames:
        engine: Engine = request.getfixturevalue("cli_engine")
        with engine.begin() as conn:
            conn.execute(text("TRUNCATE sa_jobqueue_jobs, cli_done"))


def _runner() -> CliRunner:
    try:
        return CliRunner(mix_stderr=False)  # type: ignore[call-arg]  # click 8.1
    except TypeError:
        return CliRunner()  # click 8.2+: stderr is kept apart


def run(url: str | None, *args: str) -> Result:
    return _runner().invoke(main, list(args), env={"DATABASE_URL": url}, catch_exceptions=True, prog_name="sa-jobqueue")


def ok(url: str | None, *args: str) -> str:
    result = run(url, *args)
    assert result.exit_code == 0, (result.output, result.stderr, result.exception)
    return result.stdout


def assert_one_line_error(result: Result, *, contains: str = "") -> str:
    assert result.exit_code != 0, result.output
    assert isinstance(result.exception, SystemExit), repr(result.exception)  # no uncaught exception
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("Error: "), lines
    assert "Traceback" not in result.output + result.stderr
    assert contains.lower() in lines[0].lower(), lines[0]
    return lines[0]


def _dead_job(engine: Engine, queue: str = "dead-src") -> int:
    """A job failed once with max_attempts=1: dead (its own queue, so the claim finds it alone)."""
    with Session(engine) as session, session.begin():
        job_id = repo.enqueue(session, "record", {}, max_attempts=1, queue=queue).id
    with Session(engine) as session, session.begin():
        claimed = repo.claim(session, queues=queue, limit=1)
        assert [j.id for j in claimed] == [job_id]
        assert repo.fail(session, claimed[0], "boom") == "dead"
    return job_id


def _status(engine: Engine, job_id: int) -> str | None:
    with engine.connect() as conn:
        return conn.execute(select(Job.status).where(Job.id == job_id)).scalar_one_or_none()


# -- the verbs ---------------------------------------------------------------


def test_enqueue_stats_list_show(cli_url: str, cli_engine: Engine) -> None:
    first = int(ok(cli_url, "enqueue", "record", "--payload", '{"note": "hi", "n": [1, 2]}', "--queue", "mail",
                   "--priority", "5"))
    second = int(ok(cli_url, "enqueue", "record", "--delay", "3600", "--dedupe-key", "k1"))
    again = int(ok(cli_url, "enqueue", "record", "--dedupe-key", "k1"))
    assert again == second != first
    replaced = int(ok(cli_url, "enqueue", "record", "--payload", '{"n": 2}', "--dedupe-key", "k1",
                      "--on-conflict", "replace"))
    assert replaced == second
    with cli_engine.connect() as conn:
        assert conn.execute(select(Job.payload, Job.run_at <= func.now()).where(Job.id == second)).one() == (
            {"n": 2}, True)  # the new payload, and the new run time: now, not in an hour
    assert_one_line_error(run(cli_url, "enqueue", "record", "--on-conflict", "replace"), contains="--dedupe-key")
    # The default table deletes finished jobs: a window is refused in one line, and nothing is written.
    refused = run(cli_url, "enqueue", "record", "--dedupe-key", "k2", "--dedupe-window", "3600")
    assert_one_line_error(refused, contains="dedupe_key.window")
    with cli_engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(Job).where(Job.dedupe_key == "k2")).scalar() == 0

    stats = ok(cli_url, "stats")
    lines = stats.splitlines()
    assert lines[0].split() == ["queue", "status", "count", "oldest", "runnable"]
    assert any(line.split()[:3] == ["mail", "pending", "1"] for line in lines)
    assert any(line.split()[:3] == ["default", "pending", "1"] for line in lines)

    listed = ok(cli_url, "jobs", "list")
    assert str(first) in listed and str(second) in listed
    only_mail = ok(cli_url, "jobs", "list", "--queue", "mail", "--status", "pending", "--task", "record")
    assert f"{first} " in only_mail and f"\n{second} " not in only_mail
    assert ok(cli_url, "jobs", "list", "--status", "dead").strip() == "no jobs"
    assert len(ok(cli_url, "jobs", "list", "--limit", "1").splitlines()) == 3  # header, rule, one row

    shown = ok(cli_url, "jobs", "show", str(first))
    fields = {line.split(None, 1)[0]: line.split(None, 1)[1] for line in shown.splitlines()}
    assert json.loads(fields["payload"]) == {"note": "hi", "n": [1, 2]}
    assert fields["queue"] == "mail" and fields["priority"] == "5" and fields["status"] == "pending"


def test_enqueue_a_typed_task_with_its_arguments(cli_url: str, cli_engine: Engine) -> None:
    """--tasks checks --arg (text, or JSON with :=) against the handler; the task's queue and priority apply."""
    typed = ["enqueue", "greet", "--tasks", "cli_tasks:typed_tasks"]
    first = int(ok(cli_url, *typed, "--arg", "name=ada", "--arg", "times:=2"))
    second = int(ok(cli_url, *typed, "--payload", '{"name": "bob"}', "--queue", "other"))
    with Session(cli_engine) as session:
        rows = {j.id: j for j in session.scalars(select(Job))}
    assert (rows[first].payload, rows[first].queue, rows[first].priority) == ({"name": "ada", "times": 2}, "typed", 2)
    assert (rows[second].payload, rows[second].queue) == ({"name": "bob"}, "other")
    for args, contains in [
        ([*typed, "--arg", "nme=ada"], "nme"),
        ([*typed], "name"),
        ([*typed, "--arg", "name=ada", "--arg", "times:=two"], "not valid JSON"),
        ([*typed, "--arg", "name"], "NAME=TEXT"),
        ([*typed, "--payload", "[1]"], "JSON object"),
        ([*typed, "--payload", "{}", "--arg", "name=x"], "one of them"),
        ([*typed, "--arg", "name=ada", "--priority", "99999"], "--priority"),
        (["enqueue", "greet", "--arg", "name=ada"], "--tasks"),
        (["enqueue", "nope", "--tasks", "cli_tasks:typed_tasks"], "greet"),
        (["enqueue", "record", "--tasks", "cli_tasks:tasks", "--arg", "note=x"], "--payload"),
        (["enqueue", "greet", "--tasks", "cli_tasks:Done"], "TaskRegistry"),
    ]:
        assert_one_line_error(run(cli_url, *args), contains=contains)
    with Session(cli_engine) as session:
        assert session.scalar(select(func.count()).select_from(Job)) == 2  # nothing written by the refused ones
    Worker(cli_engine, repo, cli_tasks.typed_tasks, queues=["typed", "other"], listen=False).run(until_empty=True)
    with Session(cli_engine) as session:
        assert sorted(session.scalars(select(cli_tasks.Done.note))) == ["ada x2", "bob x1"]


def _payload(engine: Engine, job_id: int) -> object:
    with engine.connect() as conn:
        return conn.execute(text("SELECT payload FROM sa_jobqueue_jobs WHERE id = :id"), {"id": job_id}).scalar_one()


def test_a_missing_or_null_payload_is_stored_as_an_empty_object(cli_url: str, cli_engine: Engine) -> None:
    """docs/cli.md: no --payload (or --payload null) is the library's payload=None, stored as {}."""
    missing = int(ok(cli_url, "enqueue", "record"))
    null = int(ok(cli_url, "enqueue", "record", "--payload", "null"))
    listed = int(ok(cli_url, "enqueue", "record", "--payload", "[1, 2]"))
    assert (_payload(cli_engine, missing), _payload(cli_engine, null), _payload(cli_engine, listed)) == ({}, {}, [1, 2])
    fields = dict(line.split(None, 1) for line in ok(cli_url, "jobs", "show", str(missing)).splitlines())
    assert fields["payload"] == "{}"
    assert "default: {}" in ok(None, "enqueue", "--help")


def test_cancel_and_retry(cli_url: str, cli_engine: Engine) -> None:
    a = int(ok(cli_url, "enqueue", "record"))
    b = int(ok(cli_url, "enqueue", "record"))
    assert "cancelled 2" in ok(cli_url, "cancel", str(a), str(b))
    assert _status(cli_engine, a) == _status(cli_engine, b) == "cancelled"
    assert_one_line_error(run(cli_url, "cancel", str(a)), contains=f"job {a} is cancelled, not pending")
    assert "retried 1" in ok(cli_url, "retry", str(a))
    assert _status(cli_engine, a) == "pending"

    dead = _dead_job(cli_engine)
    assert "retried 1" in ok(cli_url, "retry", str(dead))
    assert _status(cli_engine, dead) == "pending"
    # A refusal rolls the whole command back.
    assert_one_line_error(run(cli_url, "retry", str(b), str(a)), contains=f"job {a} is pending")
    assert _status(cli_engine, b) == "cancelled"

    d1, d2 = _dead_job(cli_engine, queue="q1"), _dead_job(cli_engine, queue="q2")
    assert "retried 1 dead" in ok(cli_url, "retry", "--all-dead", "--queue", "q1")
    assert (_status(cli_engine, d1), _status(cli_engine, d2)) == ("pending", "dead")
    assert "retried 1 dead" in ok(cli_url, "retry", "--all-dead", "--task", "record")
    assert _status(cli_engine, d2) == "pending"
    assert_one_line_error(run(cli_url, "retry"), contains="--all-dead")


def test_purge_in_batches(cli_url: str, cli_engine: Engine) -> None:
    old = [_dead_job(cli_engine) for _ in range(5)]
    recent = _dead_job(cli_engine)
    with cli_engine.begin() as conn:
        conn.execute(update(Job).where(Job.id.in_(old)).values(finished_at=Job.finished_at - timedelta(days=10)))
    result = run(cli_url, "purge", "--older-than", "7d", "--status", "dead", "--batch-size", "2")
    assert result.exit_code == 0, result.stderr
    assert "purged 5 job(s)" in result.stdout
    with cli_engine.connect() as conn:
        assert conn.execute(select(Job.id)).scalars().all() == [recent]
    assert "purged 0" in ok(cli_url, "purge", "--older-than", "12h")
    assert "purged 1" in ok(cli_url, "purge", "--older-than", "0s")


def test_reap(cli_url: str, cli_engine: Engine) -> None:
    int(ok(cli_url, "enqueue", "record"))
    with Session(cli_engine) as session, session.begin():
        (job,) = repo.claim(session, limit=1)
    assert ok(cli_url, "reap").strip() == "requeued 0, dead 0"
    with cli_engine.begin() as conn:
        conn.execute(update(Job).values(lease_expires_at=Job.lease_expires_at - timedelta(hours=1)))
    assert ok(cli_url, "reap").strip() == "requeued 1, dead 0"
    assert _status(cli_engine, job.id) == "pending"


def test_health(cli_url: str, cli_engine: Engine) -> None:
    ok(cli_url, "enqueue", "record")
    out = ok(cli_url, "health")
    assert out.startswith("database          ok")
    assert "pending 1" in out and "dead tuples" in out and "oldest xmin age" in out
    assert_one_line_error(run(cli_url, "health", "--model", "jobapp:TaskJob"), contains="does not exist")


def test_health_shows_the_connections_against_the_budget(cli_url: str, cli_engine: Engine) -> None:
    with cli_engine.connect() as conn:
        most, reserved = conn.execute(text(
            "SELECT current_setting('max_connections')::int, current_setting('superuser_reserved_connections')::int"
        )).one()
        # A connection of this test, idle, is one of those health counts.
        out = ok(cli_url, "health")
    line = next(line for line in out.splitlines() if line.startswith("connections"))
    here = int(line.split()[1])
    assert here >= 2 and f"of max_connections {most} ({reserved} reserved for superusers)" in line
    assert "worker budget" not in out

    out = ok(cli_url, "health", "--processes", "2", "--concurrency", "4")
    assert f"worker budget     26 at most = 2 x (2 x 4 + 5), 18 in steady state, of {most - reserved} usable" in out
    assert "worker budget     13 at most = 1 x (2 x 4 + 5)" in ok(cli_url, "health", "--concurrency", "4")

    # A budget that can never fit fails, after the report.
    result = run(cli_url, "health", "--concurrency", str(most))
    assert_one_line_error(result, contains=f"exceeds the {most - reserved} connections the server allows")
    assert result.exit_code == 1 and "worker budget" in result.stdout
    assert run(cli_url, "health", "--processes", "2").exit_code == 2


def test_health_fails_when_the_oldest_runnable_job_waits_too_long(cli_url: str, cli_engine: Engine) -> None:
    """--max-runnable-age (default 300 s): a runnable job nobody takes is one error line, exit 1."""
    ok(cli_url, "enqueue", "record", "--delay", "86400")  # scheduled tomorrow: not runnable, not counted
    ok(cli_url, "health")
    stale = int(ok(cli_url, "enqueue", "record"))
    with cli_engine.begin() as conn:
        conn.execute(text("UPDATE sa_jobqueue_jobs SET run_at = now() - interval '1 hour' WHERE id = :id"),
                     {"id": stale})

    result = run(cli_url, "health")
    line = assert_one_line_error(result, contains="--max-runnable-age 300s")
    assert result.exit_code == 1
    assert "waited 1h00m" in line and "sa_jobqueue_jobs" in line
    assert "oldest runnable   1h00m" in result.stdout  # the report is still printed

    assert_one_line_error(run(cli_url, "health", "--max-runnable-age", "600"), contains="--max-runnable-age 600s")
    assert "oldest runnable   1h00m" in ok(cli_url, "health", "--max-runnable-age", "7200")
    ok(cli_url, "health", "--max-runnable-age", "off")
    # Taken by a worker (running), it no longer counts.
    with Session(cli_engine) as session, session.begin():
        assert [job.id for job in repo.claim(session, limit=1)] == [stale]
    assert "oldest runnable   -" in ok(cli_url, "health")


# -- mistakes: one line, non-zero, no traceback, no password -----------------


@pytest.mark.parametrize(
    ("args", "contains"),
    [
        (["enqueue", "record", "--payload", "{not json"], "not valid JSON"),
        (["enqueue", "record", "--priority", "-99999"], "priority"),
        (["enqueue", "  "], "task"),
        (["jobs", "show", "987654321"], "job 987654321 not found"),
        (["cancel", "987654321"], "job 987654321 not found"),
        (["retry", "987654321"], "job 987654321 not found"),
        (["purge", "--older-than", "7 parsecs"], "--older-than"),
        (["stats", "--model", "no_such_module_xyz:Job"], "cannot import module"),
        (["stats", "--model", "sa_jobqueue.default:Nope"], "has no attribute"),
        (["stats", "--model", "sa_jobqueue.default"], "module:attribute"),
        (["stats", "--model", "cli_tasks:Done"], "not a JobMixin model"),
        (["worker", "no_such_module_xyz:tasks"], "cannot import module"),
        (["worker", "cli_tasks:Done"], "TaskRegistry"),
        (["worker", "cli_tasks:make_worker", "--concurrency", "3"], "factory"),
        (["worker", "cli_tasks:tasks", "--concurrency", "0"], "concurrency"),
        (["worker", "cli_tasks:broken_factory"], "RuntimeError: no configuration here"),
        (["worker", "cli_tasks:not_a_worker"], "not a Worker"),
        (["worker", "cli_tasks:tasks", "--mode", "transaction", "--batch-size", "0"], "batch_size"),
    ],
)
def test_user_mistakes(cli_url: str, cli_engine: Engine, args: list[str], contains: str) -> None:
    assert_one_line_error(run(cli_url, *args), contains=contains)


@pytest.mark.parametrize(
    ("args", "contains", "command"),
    [
        (["jobs", "show", "abc"], "Invalid value for 'ID': 'abc' is not a valid integer.", "jobs show"),
        (["enqueue"], "Missing argument 'TASK'.", "enqueue"),
        (["cancel"], "Missing argument 'ID...'.", "cancel"),
        (["purge"], "Missing option '--older-than'.", "purge"),
        (["no-such-command"], "No such command 'no-such-command'.", ""),
        (["jobs", "frob"], "No such command 'frob'.", "jobs"),
        (["stats", "--bogus"], "--bogus", "stats"),
        (["jobs", "list", "--status", "nope"], "Invalid value for '--status'", "jobs list"),
        (["jobs", "list", "--limit", "0"], "Invalid value for '--limit'", "jobs list"),
        (["--log-level", "LOUD", "stats"], "Invalid value for '--log-level'", ""),
        (["health", "--max-runnable-age", "-3"], "Invalid value for '--max-runnable-age'", "health"),
        (["health", "--max-runnable-age", "soon"], "Invalid value for '--max-runnable-age'", "health"),
    ],
)
def test_usage_errors_are_one_line(args: list[str], contains: str, command: str) -> None:
    """click's usage errors print the usage and a hint on lines of their own; here they are one line,
    the hint at its end."""
    result = run("postgresql://postgres@127.0.0.1:1/test", *args)
    line = assert_one_line_error(result, contains=contains)
    assert result.exit_code == 2
    assert line.endswith(f" Try '{' '.join(['sa-jobqueue', command]).strip()} --help' for help."), line


def test_usage_errors_are_one_line_in_a_process() -> None:
    """The same through ``python -m sa_jobqueue.cli``: exactly one line on stderr, nothing on stdout."""
    for args in (["jobs", "show", "abc"], ["enqueue"]):
        out = subprocess.run([sys.executable, "-m", "sa_jobqueue.cli", *args], cwd=ROOT, capture_output=True,
                             text=True, timeout=60, env=os.environ | {"DATABASE_URL": ""})
        assert out.returncode == 2, out.stderr
        assert out.stdout == ""
        assert len(out.stderr.splitlines()) == 1 and out.stderr.startswith("Error: "), out.stderr


def test_a_group_without_a_command_shows_its_help() -> None:
    result = run(None, "jobs")
    assert "Commands:" in result.output and "show" in result.output
    assert "Error" not in result.output + result.stderr


@pytest.mark.timeout(120)  # the bound, should a connection attempt hang; no timing is asserted
@pytest.mark.parametrize("command", [["stats"], ["health"], ["enqueue", "record"], ["jobs", "list"]])
def test_unreachable_database_hides_the_password(command: list[str]) -> None:
    result = run("postgresql://postgres:s3cret-pw@127.0.0.1:1/test", *command)
    assert_one_line_error(result, contains="cannot connect to postgresql+psycopg://postgres:***@127.0.0.1:1/test")
    assert result.exit_code == 1
    assert "s3cret-pw" not in result.output + result.stderr


@pytest.mark.parametrize("url", [None, "", "not a url at all :: s3cret-pw", "mysql://u:s3cret-pw@h/db"])
def test_missing_or_bad_database_url(url: str | None) -> None:
    result = run(url, "stats")
    line = assert_one_line_error(result)
    assert "s3cret-pw" not in result.output + result.stderr
    assert "DATABASE_URL" in line or "URL" in line


def test_parse_duration_and_format_age() -> None:
    assert parse_duration("7d") == timedelta(days=7)
    assert parse_duration("1h30m") == timedelta(minutes=90)
    assert parse_duration("2w") == timedelta(weeks=2)
    for bad in ["", "7", "d", "7y", "-1d", "1h x"]:
        with pytest.raises(ValueError):
            parse_duration(bad)
    assert format_age(None) == "-"
    assert format_age(timedelta(seconds=5)) == "5s"
    assert format_age(timedelta(days=1, seconds=61)) == "1d00h01m01s"


def test_core_does_not_import_click() -> None:
    code = "import sys, sa_jobqueue, sa_jobqueue.default; print('click' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


# -- the worker command, in a process of its own -----------------------------


def _run_worker(cli_url: str, cli_engine: Engine, args: list[str], queue: str) -> dict[str, int]:
    """Start ``sa-jobqueue worker ARGS`` in a process, enqueue a job before and one after, wait for both
    to commit their ledger rows, stop it with SIGTERM; return its printed result. Both jobs ran with
    the objects the process built before its worker frozen (worker_flags.freeze_startup)."""
    ok(cli_url, "enqueue", "record", "--payload", '{"note": "before"}', "--queue", queue)
    env = os.environ | {"DATABASE_URL": cli_url, "PYTHONPATH": os.pathsep.join([str(TESTS), str(ROOT)])}
    proc = subprocess.Popen(
        [sys.executable, "-m", "sa_jobqueue.cli", "worker", *args],
        env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        ok(cli_url, "enqueue", "record", "--payload", '{"note": "after"}', "--queue", queue)
        deadline = time.monotonic() + 20
        notes: list[str | None] = []
        while time.monotonic() < deadline and proc.poll() is None:
            with cli_engine.connect() as conn:
                notes = list(conn.execute(select(cli_tasks.Done.note).order_by(cli_tasks.Done.note)).scalars())
            if len(notes) == 2:
                break
            time.sleep(0.1)
        assert notes == ["after", "before"], proc.poll()
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=10)
    assert proc.returncode == 0, stderr
    with cli_engine.connect() as conn:
        assert conn.execute(select(Job.id)).first() is None
        assert list(conn.execute(select(cli_tasks.Done.frozen)).scalars()) == [True, True]
    result: dict[str, int] = json.loads(stdout.strip().splitlines()[-1])
    return result


def test_worker_runs_a_registry_until_sigterm(cli_url: str, cli_engine: Engine) -> None:
    args = ["cli_tasks:tasks", "--concurrency", "2", "--queue", "default", "--queue", "other"]
    assert _run_worker(cli_url, cli_engine, args, "other")["completed"] == 2


def test_worker_runs_a_factory_until_sigterm(cli_url: str, cli_engine: Engine) -> None:
    assert _run_worker(cli_url, cli_engine, ["cli_tasks:make_worker"], "default")["completed"] == 2


def test_worker_runs_an_async_registry_until_sigterm(cli_url: str, cli_engine: Engine) -> None:
    args = ["cli_tasks:async_tasks", "--concurrency", "50", "--queue", "default", "--queue", "other"]
    assert _run_worker(cli_url, cli_engine, args, "other")["completed"] == 2


def test_worker_runs_an_async_worker_factory_until_sigterm(cli_url: str, cli_engine: Engine) -> None:
    assert _run_worker(cli_url, cli_engine, ["cli_tasks:make_async_worker"], "default")["completed"] == 2


def test_an_async_worker_stops_gracefully_on_sigterm_and_at_once_on_a_second(cli_url: str, cli_engine: Engine) -> None:
    """A real process and real signals: the first SIGTERM waits for the running
    job (shutdown timeout 10 minutes), the second stops the worker at once."""
    job_id = int(ok(cli_url, "enqueue", "hang"))
    env = os.environ | {"DATABASE_URL": cli_url, "PYTHONPATH": os.pathsep.join([str(TESTS), str(ROOT)])}
    proc = subprocess.Popen(
        [sys.executable, "-m", "sa_jobqueue.cli", "worker", "cli_tasks:async_tasks", "--shutdown-timeout", "600"],
        env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        wait_for(lambda: _status(cli_engine, job_id) == "running", 60, "the job to start")
        proc.send_signal(signal.SIGTERM)
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(1)  # waiting for the running job (not a timing claim: it would wait ten minutes)
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=10)
    assert proc.returncode == 0, stderr
    assert "received again, stopping at once" in stderr, stderr
    if importlib.util.find_spec("uvloop") is not None:  # the test extra installs it
        assert "event loop: uvloop" in stderr, stderr
    assert json.loads(stdout.strip().splitlines()[-1])["completed"] == 0
    assert _status(cli_engine, job_id) == "running"  # left to its lease, as after a kill


def test_worker_runs_an_async_registry_in_transaction_mode_until_sigterm(cli_url: str, cli_engine: Engine) -> None:
    args = ["cli_tasks:async_tasks", "--mode", "transaction", "--concurrency", "2"]
    assert _run_worker(cli_url, cli_engine, args, "default")["completed"] == 2


def test_a_worker_with_too_many_stuck_threads_exits_non_zero_in_one_line(cli_url: str, cli_engine: Engine) -> None:
    for _ in range(3):
        ok(cli_url, "enqueue", "stuck")
    env = os.environ | {"DATABASE_URL": cli_url, "PYTHONPATH": os.pathsep.join([str(TESTS), str(ROOT)])}
    proc = subprocess.run(
        [sys.executable, "-m", "sa_jobqueue.cli", "worker", "cli_tasks:tasks", "--concurrency", "1", "--no-listen"],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 1, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1 and "stuck in handlers past their deadline" in errors[0], proc.stderr
    with cli_engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(Job).where(Job.status == "dead")).scalar_one() == 2


def test_custom_model(libpq_url: str, engine: Engine) -> None:
    import jobapp

    job_id = int(ok(libpq_url, "enqueue", "ledger", "--model", "jobapp:EmailJob", "--queue", "q"))
    stats = ok(libpq_url, "stats", "--model", "jobapp:EmailJob").splitlines()
    assert stats[2].split()[:3] == ["q", "pending", "1"]
    assert ok(libpq_url, "stats", "--model", "jobapp:TaskJob").startswith("no jobs in task_jobs")
    with engine.connect() as conn:
        assert conn.execute(select(jobapp.EmailJob.task).where(jobapp.EmailJob.id == job_id)).scalar_one() == "ledger"


# -- docs/cli.md ---------------------------------------------------------------


def _doc_blocks(language: str) -> list[str]:
    return re.findall(rf"^ *```{language}\n(.*?)^ *```", CLI_DOC.read_text(encoding="utf-8"), re.S | re.M)


def test_the_documented_error_lines(cli_url: str, cli_engine: Engine) -> None:
    """Every ``$ sa-jobqueue …`` of the error examples in docs/cli.md prints the line shown under it."""
    (block,) = [b for b in _doc_blocks("text") if b.startswith("$ sa-jobqueue")]
    lines = block.splitlines()
    pairs = list(zip(lines[::2], lines[1::2], strict=True))
    assert len(pairs) >= 5
    for command, shown in pairs:
        assert command.startswith("$ sa-jobqueue "), command
        result = run(cli_url, *shlex.split(command)[2:])
        assert assert_one_line_error(result) == shown, command


def test_the_documented_worker_factory(libpq_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/cli.md's ``myapp/worker.py`` builds its Worker (with a ``myapp/jobs.py`` of two tables)."""
    (block,) = [b for b in _doc_blocks("python") if b.lstrip().startswith("# myapp/worker.py")]
    package = tmp_path / "myapp"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "jobs.py").write_text(
        "from jobapp import EmailJob, ReportJob\n"
        "from sa_jobqueue import JobRepository, TaskRegistry\n"
        "emails, reports, tasks = JobRepository(EmailJob), JobRepository(ReportJob), TaskRegistry()\n"
    )
    (package / "worker.py").write_text(textwrap.dedent(block))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("DATABASE_URL", libpq_url)
    import myapp.worker  # type: ignore[import-not-found]

    built = myapp.worker.make_worker()
    assert isinstance(built, Worker)
    assert (built.queues, built.concurrency) == (["signup", "mail"], 8)
    for name in [m for m in sys.modules if m == "myapp" or m.startswith("myapp.")]:
        del sys.modules[name]
