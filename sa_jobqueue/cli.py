"""The ``sa-jobqueue`` command line: run workers, enqueue, inspect and tidy job tables.

::

    export DATABASE_URL=postgresql://app@db/app
    sa-jobqueue worker myapp.jobs:tasks --queue signup --concurrency 8
    sa-jobqueue enqueue send_welcome --payload '{"user_id": 42}' --queue signup
    sa-jobqueue stats
    sa-jobqueue jobs list --status dead
    sa-jobqueue retry --all-dead
    sa-jobqueue purge --older-than 7d
    sa-jobqueue health

The database URL comes from ``--database-url`` or ``DATABASE_URL``. Every
command runs in transactions of its own and commits them. Mistakes (a bad
URL, an unreachable server, a missing table, a bad import path, an argument
the library refuses, an unknown job id) end with one ``Error: …`` line on
stderr and a non-zero exit code; URLs are shown with their password hidden.

The core library never imports this module (nor click).
"""

from __future__ import annotations

import importlib
import json
import logging
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from datetime import datetime, timedelta
from typing import Any, NoReturn, cast

import click
from sqlalchemy import Engine, create_engine, func, literal, select, text
from sqlalchemy.engine import URL
from sqlalchemy.exc import ArgumentError, DBAPIError, NoSuchModuleError, SQLAlchemyError
from sqlalchemy.orm import Session

from .errors import JobQueueError
from .mixin import DEAD, DEFAULT_MAX_ATTEMPTS, PENDING, STATUSES, JobMixin
from .registry import TaskRegistry
from .repository import JobRepository
from .spec import FINISHED_STATUSES
from .urls import psycopg_url
from .worker import Mode, Worker

DEFAULT_MODEL = "sa_jobqueue.default:Job"
CONNECT_TIMEOUT = 5  # seconds: an unreachable server fails fast
PURGE_BATCH = 1000
REAP_BATCH = 1000

log = logging.getLogger("sa_jobqueue.cli")


class CliError(click.ClickException):
    """A user mistake or an unusable database: one line on stderr, exit 1."""


class CliUsageError(click.ClickException):
    """A bad argument found after parsing: one line on stderr, exit 2 (as click's usage errors)."""

    exit_code = 2


# -- helpers -----------------------------------------------------------------


def _first_line(value: object) -> str:
    lines = [line.strip() for line in str(value).splitlines() if line.strip()]
    return lines[0] if lines else type(value).__name__


def import_object(path: str, what: str) -> Any:
    """Import ``module:attr`` (attr may be dotted); raise :class:`CliUsageError` naming ``what``."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise CliUsageError(f"{what}: {path!r} is not an import path of the form module:attribute")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise CliUsageError(f"{what}: cannot import module {module_name!r}: {_first_line(exc)}") from None
    except Exception as exc:  # the module itself failed while importing
        raise CliError(f"{what}: importing {module_name!r} failed: {type(exc).__name__}: {_first_line(exc)}") from None
    for name in attr.split("."):
        try:
            obj = getattr(obj, name)
        except AttributeError:
            raise CliUsageError(f"{what}: {module_name!r} has no attribute {attr!r}") from None
    return obj


def load_repository(model_path: str) -> JobRepository[Any]:
    model = import_object(model_path, "--model")
    if not isinstance(model, type) or not issubclass(model, JobMixin):
        raise CliUsageError(f"--model: {model_path} is not a JobMixin model class")
    try:
        return JobRepository(model)
    except JobQueueError as exc:
        raise CliUsageError(str(exc)) from None


def show_url(url: URL) -> str:
    return url.render_as_string(hide_password=True)


def make_engine(raw_url: str | None, **kwargs: Any) -> Engine:
    """An engine for the URL given or from DATABASE_URL; errors never show the password."""
    if not raw_url:
        raise CliUsageError("no database URL: pass --database-url or set DATABASE_URL")
    try:
        url = psycopg_url(raw_url)
    except ArgumentError:
        # SQLAlchemy's message quotes the whole string, password included.
        raise CliUsageError("the database URL cannot be parsed; expected postgresql://user@host:port/db") from None
    if not url.drivername.startswith("postgresql"):
        raise CliUsageError(f"the database URL must be a PostgreSQL one, got {show_url(url)}")
    try:
        return create_engine(url, connect_args={"connect_timeout": CONNECT_TIMEOUT}, **kwargs)
    except (ArgumentError, NoSuchModuleError, ImportError) as exc:
        raise CliUsageError(f"cannot use the database URL {show_url(url)}: {_first_line(exc)}") from None


@contextmanager
def database_errors(engine: Engine, table: str | None = None) -> Iterator[None]:
    """Turn database and library errors into one-line :class:`CliError`s."""
    where = show_url(engine.url)
    try:
        yield
    except JobQueueError as exc:  # InvalidArgumentError and kin: the library's message
        raise CliError(str(exc)) from None
    except DBAPIError as exc:
        sqlstate = getattr(exc.orig, "sqlstate", None)
        message = _first_line(exc.orig) if exc.orig is not None else _first_line(exc)
        if sqlstate == "42P01" and table is not None:
            raise CliError(
                f"table {table!r} does not exist in {where}; create it (alembic upgrade head, "
                "or metadata.create_all) or pick the model with --model"
            ) from None
        if exc.connection_invalidated or sqlstate is None or sqlstate.startswith("08"):
            raise CliError(f"cannot connect to {where}: {message}") from None
        raise CliError(f"database error on {where}: {message}") from None
    except SQLAlchemyError as exc:
        raise CliError(f"database error on {where}: {_first_line(exc)}") from None


def format_age(age: timedelta | None) -> str:
    """``3d04h05m06s``, shortest form; ``-`` for None."""
    if age is None:
        return "-"
    seconds = max(0, int(age.total_seconds()))
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d{hours:02d}h{minutes:02d}m{secs:02d}s"
    if hours:
        return f"{hours}h{minutes:02d}m{secs:02d}s"
    if minutes:
        return f"{minutes}m{secs:02d}s"
    return f"{secs}s"


_DURATION_PART = re.compile(r"(\d+)\s*([wdhms])")
_UNITS = {"w": 604800, "d": 86400, "h": 3600, "m": 60, "s": 1}


def parse_duration(value: str) -> timedelta:
    """``7d``, ``12h``, ``30m``, ``45s``, ``2w`` or sums such as ``1h30m``; raise ValueError."""
    compact = value.strip().lower()
    parts = _DURATION_PART.findall(compact)
    if not compact or _DURATION_PART.sub("", compact).strip():
        raise ValueError(f"{value!r} is not a duration such as 7d, 12h, 30m, 45s or 1h30m")
    return timedelta(seconds=sum(int(n) * _UNITS[unit] for n, unit in parts))


def render_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [[str(h) for h in headers], *[["-" if v is None else str(v) for v in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


def _fail(message: str) -> NoReturn:
    raise CliError(message)


def _when(value: datetime | None) -> str:
    return "-" if value is None else value.isoformat(timespec="seconds")


def _short(value: object, limit: int = 60) -> str:
    text_value = "-" if value is None else str(value).replace("\n", " ")
    return text_value if len(text_value) <= limit else text_value[: limit - 1] + "…"


class _State:
    """What the commands share: the engine, built from the URL on first use.

    A ready ``engine`` (an application's, e.g. ``flask jobs``) is used as it
    is and never disposed here; ``repository`` is then the job table used
    when ``--model`` is not given.
    """

    def __init__(
        self, database_url: str | None, *, engine: Engine | None = None,
        repository: JobRepository[Any] | None = None,
    ) -> None:
        self.database_url = database_url
        self._engine: Engine | None = engine
        self._owns_engine = engine is None
        self.repository = repository

    def engine(self) -> Engine:
        if self._engine is None:
            self._engine = make_engine(self.database_url)
        return self._engine

    def close(self) -> None:
        if self._engine is not None and self._owns_engine:
            self._engine.dispose()


model_option = click.option(
    "--model", "model_path", default=DEFAULT_MODEL, show_default=True, metavar="MODULE:CLASS",
    help="The job model (a JobMixin class).",
)


def _state(ctx: click.Context) -> _State:
    state = ctx.find_object(_State)
    if state is None:  # pragma: no cover - the group always sets it
        raise CliError("internal error: no CLI state")
    return state


def _repository(ctx: click.Context, model_path: str) -> JobRepository[Any]:
    """The job table of ``--model``, or the state's own when ``--model`` was not given."""
    state = _state(ctx)
    if state.repository is not None and ctx.get_parameter_source("model_path") is click.core.ParameterSource.DEFAULT:
        return state.repository
    return load_repository(model_path)


# -- the group ---------------------------------------------------------------


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--database-url", envvar="DATABASE_URL", metavar="URL",
    help="postgresql://user:password@host:port/db (default: $DATABASE_URL).",
)
@click.option(
    "--log-level", default="INFO", show_default=True,
    type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
)
@click.version_option(package_name="sa_jobqueue")
@click.pass_context
def main(ctx: click.Context, database_url: str | None, log_level: str) -> None:
    """Job queues on PostgreSQL tables: workers, enqueueing, inspection, housekeeping."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    state = _State(database_url)
    ctx.obj = state
    ctx.call_on_close(state.close)


# -- worker ------------------------------------------------------------------

_WORKER_OPTIONS = {
    "queues": "--queue", "concurrency": "--concurrency", "mode": "--mode", "listen": "--listen/--no-listen",
    "batch_size": "--batch-size", "model_path": "--model", "name": "--name",
}


@main.command()
@click.argument("import_path", metavar="MODULE:ATTR")
@click.option("--queue", "queues", multiple=True, metavar="NAME", help="Queue to serve (repeatable, default: default).")
@click.option("--concurrency", type=int, default=4, show_default=True, help="Jobs run at once (threads).")
@click.option("--mode", type=click.Choice(["lease", "transaction"]), default="lease", show_default=True)
@click.option("--listen/--no-listen", default=True, show_default=True, help="Wake on LISTEN/NOTIFY, not only polls.")
@click.option("--batch-size", type=int, default=None, help="Jobs per claim.")
@click.option("--name", default=None, help="Worker name stored in locked_by (default host:pid:random).")
@model_option
@click.pass_context
def worker(
    ctx: click.Context, import_path: str, queues: tuple[str, ...], concurrency: int, mode: str, listen: bool,
    batch_size: int | None, name: str | None, model_path: str,
) -> None:
    """Run a worker until SIGINT or SIGTERM.

    MODULE:ATTR names either a TaskRegistry, run with the options given here
    on the database URL, or a zero-argument factory returning a configured
    Worker (the factory builds its own engine; the worker options here are
    then refused).
    """
    target = import_object(import_path, "IMPORT_PATH")
    if isinstance(target, TaskRegistry):
        repository = _repository(ctx, model_path)
        if concurrency < 1:
            raise CliUsageError(f"--concurrency: must be 1 or more, got {concurrency}")
        # A connection per slot, plus the control, claim and listener ones.
        engine = make_engine(_state(ctx).database_url, pool_size=concurrency + 4, max_overflow=4)
        try:
            with database_errors(engine, repository.table.name):
                with engine.connect() as conn:  # fail fast, in one line, when the server is unreachable
                    conn.execute(select(literal(1)).select_from(repository.table).limit(1)).all()
                try:
                    built = Worker(
                        engine, repository, target, queues=list(queues) or "default", concurrency=concurrency,
                        mode=cast(Mode, mode), listen=listen, batch_size=batch_size, name=name,
                    )
                except JobQueueError as exc:
                    raise CliUsageError(str(exc)) from None
                _run(built)
        finally:
            engine.dispose()
        return
    elif callable(target) and not isinstance(target, type):
        given = [
            flag for param, flag in _WORKER_OPTIONS.items()
            if ctx.get_parameter_source(param) is not click.core.ParameterSource.DEFAULT
        ]
        if given:
            raise CliUsageError(
                f"{import_path} is a worker factory: it configures the worker itself, so "
                f"{', '.join(given)} "
                "cannot be given"
            )
        try:
            built = target()
        except Exception as exc:  # the factory is user code: report it in one line
            raise CliError(f"{import_path}() failed: {type(exc).__name__}: {_first_line(exc)}") from None
        if not isinstance(built, Worker):
            raise CliUsageError(f"{import_path}() returned {type(built).__name__}, not a Worker")
    else:
        raise CliUsageError(
            f"IMPORT_PATH: {import_path} is a {type(target).__name__}; name a TaskRegistry "
            "or a zero-argument function returning a Worker"
        )
    _run(built)


def _run(built: Worker) -> None:
    log.info("worker %s serving %s in %s mode", built.name, ", ".join(built.queues), built.mode)
    result = built.run()
    click.echo(json.dumps(
        {"completed": result.completed, "retried": result.retried, "dead": result.dead, "lost": result.lost}
    ))


# -- enqueue -----------------------------------------------------------------


@main.command()
@click.argument("task")
@click.option("--payload", default=None, metavar="JSON", help="The job's payload as JSON (default: null).")
@click.option("--queue", default="default", show_default=True)
@click.option("--priority", type=int, default=0, show_default=True, help="Lower runs first (-32768 … 32767).")
@click.option("--delay", type=float, default=None, metavar="SECONDS", help="Run no earlier than this from now.")
@click.option("--max-attempts", type=int, default=None, help="Attempts before the job is dead (default 20).")
@click.option("--dedupe-key", default=None, help="Skip the insert while a live job of the queue holds this key.")
@model_option
@click.pass_context
def enqueue(
    ctx: click.Context, task: str, payload: str | None, queue: str, priority: int, delay: float | None,
    max_attempts: int | None, dedupe_key: str | None, model_path: str,
) -> None:
    """Enqueue one job of TASK and print its id."""
    value: Any = None
    if payload is not None:
        try:
            value = json.loads(payload)
        except ValueError as exc:
            raise CliUsageError(f"--payload: not valid JSON: {exc}") from None
    repository = _repository(ctx, model_path)
    engine = _state(ctx).engine()
    with database_errors(engine, repository.table.name), Session(engine) as session, session.begin():
        job = repository.enqueue(
            session, task, value, queue=queue, priority=priority, delay=delay, dedupe_key=dedupe_key,
            max_attempts=DEFAULT_MAX_ATTEMPTS if max_attempts is None else max_attempts,
        )
        job_id = job.id
    click.echo(job_id)


# -- stats and jobs ----------------------------------------------------------


@main.command()
@model_option
@click.pass_context
def stats(ctx: click.Context, model_path: str) -> None:
    """Jobs per queue and status, with the age of the oldest runnable job."""
    repository = _repository(ctx, model_path)
    engine = _state(ctx).engine()
    with database_errors(engine, repository.table.name), Session(engine) as session, session.begin():
        rows = repository.stats(session)
    if not rows:
        click.echo(f"no jobs in {repository.table.name}")
        return
    click.echo(render_table(
        ["queue", "status", "count", "oldest runnable"],
        [(r.queue, r.status, r.count, format_age(r.oldest_runnable_age) if r.status == PENDING else "") for r in rows],
    ))


@main.group()
def jobs() -> None:
    """Look at jobs (read-only)."""


@jobs.command("list")
@click.option("--queue", default=None)
@click.option("--status", "statuses", multiple=True, type=click.Choice(STATUSES), help="Repeatable.")
@click.option("--task", default=None)
@click.option("--limit", type=click.IntRange(1, 100_000), default=50, show_default=True)
@model_option
@click.pass_context
def jobs_list(
    ctx: click.Context, queue: str | None, statuses: tuple[str, ...], task: str | None, limit: int, model_path: str
) -> None:
    """Jobs, newest first."""
    repository = _repository(ctx, model_path)
    engine = _state(ctx).engine()
    t = repository.table
    stmt = select(t.c.id, t.c.queue, t.c.task, t.c.status, t.c.priority, t.c.attempts, t.c.run_at, t.c.last_error)
    if queue is not None:
        stmt = stmt.where(t.c.queue == queue)
    if statuses:
        stmt = stmt.where(t.c.status.in_(statuses))
    if task is not None:
        stmt = stmt.where(t.c.task == task)
    stmt = stmt.order_by(t.c.id.desc()).limit(limit)
    with database_errors(engine, t.name), Session(engine) as session, session.begin():
        rows = session.execute(stmt).all()
    if not rows:
        click.echo("no jobs")
        return
    click.echo(render_table(
        ["id", "queue", "task", "status", "priority", "attempts", "run_at", "last_error"],
        [(r.id, r.queue, r.task, r.status, r.priority, r.attempts, _when(r.run_at), _short(r.last_error, 40))
         for r in rows],
    ))


@jobs.command("show")
@click.argument("job_id", type=int, metavar="ID")
@model_option
@click.pass_context
def jobs_show(ctx: click.Context, job_id: int, model_path: str) -> None:
    """Every column of one job; the payload as JSON."""
    repository = _repository(ctx, model_path)
    engine = _state(ctx).engine()
    t = repository.table
    with database_errors(engine, t.name), Session(engine) as session, session.begin():
        row = session.execute(select(t).where(t.c.id == job_id)).mappings().first()
    if row is None:
        _fail(f"job {job_id} not found in {t.name}")
    width = max(len(key) for key in row)
    for key, value in row.items():
        if key == "payload":
            shown = json.dumps(value, ensure_ascii=False)
        elif isinstance(value, datetime):
            shown = value.isoformat()
        else:
            shown = "-" if value is None else str(value)
        click.echo(f"{key.ljust(width)}  {shown}")


# -- retry, cancel -----------------------------------------------------------


def _change_each(
    engine: Engine, repository: JobRepository[Any], ids: Sequence[int],
    verb: Callable[[Session, int], bool], wanted: str,
) -> int:
    """Apply ``verb`` to every id in one transaction; on any refusal, roll back and raise one line."""
    t = repository.table
    with database_errors(engine, t.name), Session(engine) as session, session.begin():
        problems: list[str] = []
        for job_id in dict.fromkeys(ids):
            if verb(session, job_id):
                continue
            status = session.execute(select(t.c.status).where(t.c.id == job_id)).scalar_one_or_none()
            problems.append(f"job {job_id} " + ("not found" if status is None else f"is {status}, not {wanted}"))
        if problems:
            session.rollback()
            _fail("; ".join(problems) + " (nothing changed)")
    return len(dict.fromkeys(ids))


@main.command()
@click.argument("job_ids", type=int, nargs=-1, metavar="[ID]...")
@click.option("--all-dead", is_flag=True, help="Retry every dead job (of --queue / --task when given).")
@click.option("--queue", default=None)
@click.option("--task", default=None)
@model_option
@click.pass_context
def retry(
    ctx: click.Context, job_ids: tuple[int, ...], all_dead: bool, queue: str | None, task: str | None,
    model_path: str,
) -> None:
    """Send dead (or cancelled) jobs back to pending now."""
    if bool(job_ids) == all_dead:
        raise CliUsageError("give job ids or --all-dead (one of the two)")
    if job_ids and (queue is not None or task is not None):
        raise CliUsageError("--queue and --task go with --all-dead only")
    repository = _repository(ctx, model_path)
    engine = _state(ctx).engine()
    if job_ids:
        count = _change_each(engine, repository, job_ids, repository.retry, "dead or cancelled (or its dedupe key "
                             "is held by a live job)")
        click.echo(f"retried {count} job(s)")
        return
    t = repository.table
    stmt = select(t.c.id).where(t.c.status == DEAD).order_by(t.c.id)
    if queue is not None:
        stmt = stmt.where(t.c.queue == queue)
    if task is not None:
        stmt = stmt.where(t.c.task == task)
    retried = skipped = 0
    with database_errors(engine, t.name), Session(engine) as session, session.begin():
        for job_id in session.scalars(stmt).all():
            if repository.retry(session, job_id):
                retried += 1
            else:
                skipped += 1
    click.echo(f"retried {retried} dead job(s)" + (f", skipped {skipped} (dedupe key held)" if skipped else ""))


@main.command()
@click.argument("job_ids", type=int, nargs=-1, required=True, metavar="ID...")
@model_option
@click.pass_context
def cancel(ctx: click.Context, job_ids: tuple[int, ...], model_path: str) -> None:
    """Cancel pending jobs (all or none)."""
    repository = _repository(ctx, model_path)
    count = _change_each(_state(ctx).engine(), repository, job_ids, repository.cancel, "pending")
    click.echo(f"cancelled {count} job(s)")


# -- purge, reap -------------------------------------------------------------


@main.command()
@click.option("--older-than", "older_than_text", required=True, metavar="DURATION",
              help="Finished longer ago than this: 7d, 12h, 30m, 45s, 1h30m.")
@click.option("--status", "statuses", multiple=True, type=click.Choice(FINISHED_STATUSES),
              help="Repeatable (default: done, dead, cancelled).")
@click.option("--batch-size", type=click.IntRange(1, 100_000), default=PURGE_BATCH, show_default=True,
              help="Rows deleted per transaction.")
@model_option
@click.pass_context
def purge(
    ctx: click.Context, older_than_text: str, statuses: tuple[str, ...], batch_size: int, model_path: str
) -> None:
    """Delete finished jobs, in batches of their own transaction each."""
    try:
        older_than = parse_duration(older_than_text)
    except ValueError as exc:
        raise CliUsageError(f"--older-than: {exc}") from None
    repository = _repository(ctx, model_path)
    engine = _state(ctx).engine()
    chosen = list(statuses) or list(FINISHED_STATUSES)
    t = repository.table
    count_stmt = select(func.count()).select_from(t).where(
        t.c.status.in_(chosen), t.c.finished_at < func.now() - older_than
    )
    total = 0
    with database_errors(engine, t.name):
        with Session(engine) as session, session.begin():
            expected = int(session.execute(count_stmt).scalar_one())
        # A progress bar on a terminal; logs and pipes get the final line only.
        bar = click.progressbar(length=expected, label=f"purging {t.name}", file=sys.stderr)
        with bar if sys.stderr.isatty() else nullcontext(bar):
            while True:
                with Session(engine) as session, session.begin():
                    deleted = repository.purge(session, statuses=chosen, older_than=older_than, limit=batch_size)
                total += deleted
                if sys.stderr.isatty():
                    bar.update(deleted)
                if deleted == 0:
                    break
    click.echo(f"purged {total} job(s)")


@main.command()
@model_option
@click.pass_context
def reap(ctx: click.Context, model_path: str) -> None:
    """Send running jobs whose lease expired back to pending (or to dead)."""
    repository = _repository(ctx, model_path)
    engine = _state(ctx).engine()
    requeued = dead = 0
    with database_errors(engine, repository.table.name):
        while True:
            with Session(engine) as session, session.begin():
                result = repository.reap(session, limit=REAP_BATCH)
            requeued += result.requeued
            dead += result.dead
            if result.requeued + result.dead < REAP_BATCH:
                break
    click.echo(f"requeued {requeued}, dead {dead}")


# -- health ------------------------------------------------------------------


@main.command()
@model_option
@click.pass_context
def health(ctx: click.Context, model_path: str) -> None:
    """Check the database and the job table; exit non-zero when either is unusable."""
    repository = _repository(ctx, model_path)
    engine = _state(ctx).engine()
    t = repository.table
    schema: str | None = t.schema
    with database_errors(engine, t.name), Session(engine) as session, session.begin():
        server = session.execute(text("SHOW server_version")).scalar_one()
        qualified = f"{schema}.{t.name}" if schema else t.name
        oid = session.execute(
            text("SELECT c.oid FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
                 "WHERE c.relname = :name AND n.nspname = coalesce(:schema, current_schema())"),
            {"name": t.name, "schema": schema},
        ).scalar_one_or_none()
        if oid is None:
            _fail(f"table {qualified!r} does not exist in {show_url(engine.url)}")
        counts: dict[str, int] = {
            str(status): int(n) for status, n in session.execute(select(t.c.status, func.count()).group_by(t.c.status))
        }
        oldest = session.execute(
            select(func.max(func.now() - t.c.run_at)).where(t.c.status == PENDING, t.c.run_at <= func.now())
        ).scalar_one()
        dead_tuples = session.execute(
            text("SELECT n_dead_tup, n_live_tup, last_autovacuum FROM pg_stat_user_tables WHERE relid = :oid"),
            {"oid": oid},
        ).first()
        xmin_age = session.execute(
            text("SELECT max(age(backend_xmin)) FROM pg_stat_activity WHERE pid <> pg_backend_pid()")
        ).scalar_one()
    click.echo(f"database          ok ({show_url(engine.url)}, PostgreSQL {server})")
    click.echo(f"table             {qualified}")
    click.echo("jobs              " + ", ".join(f"{s} {counts.get(s, 0)}" for s in STATUSES))
    click.echo(f"oldest runnable   {format_age(oldest)}")
    if dead_tuples is not None:
        click.echo(f"dead tuples       {dead_tuples.n_dead_tup} (live {dead_tuples.n_live_tup}, "
                   f"last autovacuum {_when(dead_tuples.last_autovacuum)})")
    click.echo("oldest xmin age   " + ("- (no transaction holds back vacuum)" if xmin_age is None
                                      else f"{xmin_age} transactions"))


if __name__ == "__main__":  # python -m sa_jobqueue.cli
    main()
