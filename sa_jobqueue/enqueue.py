"""Enqueueing: checked rows written in the caller's transaction, and their wake-up.

:class:`Enqueuer` writes the rows behind :meth:`JobRepository.enqueue` and
:meth:`JobRepository.enqueue_many` (rows already checked by
:func:`~sa_jobqueue.spec.to_row`) and returns them as detached snapshots
(:mod:`sa_jobqueue.snapshot`):

* one row without a dedupe key: one ``INSERT … RETURNING``, with the NOTIFY
  folded into the same statement when the transaction has not notified its
  queue yet; on a table whose defaults the client knows (as for COPY, see
  :mod:`sa_jobqueue.bulk`) it returns only ``id``, ``created_at`` and
  ``run_at``, and the snapshot is the row as stored (:func:`~sa_jobqueue.bulk.stored_row`);
* many rows: the statements of :func:`~sa_jobqueue.bulk.write_order`, rows
  with a dedupe key first in one global order (``INSERT … ON CONFLICT DO
  NOTHING``, the live holder of a key returned in place of a new row), then
  the others through COPY when it can stand in for the INSERT;
* the enqueue hooks of the process (:mod:`sa_jobqueue.enqueue_hooks`),
  when any is registered, around the writing of each call;
* the wake-up: a NOTIFY on the table's channel once per transaction and
  queue of runnable jobs (the session's ``info`` remembers which were
  sent, :mod:`sa_jobqueue.woken`); jobs scheduled later send nothing, polling
  picks them up on time.

Nothing here commits: the rows and the NOTIFY commit or vanish with the
caller's transaction.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from datetime import datetime, timezone
from typing import Any, Generic, TypeVar

from sqlalchemy import Table
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

from . import bulk, enqueue_hooks, keyed, statements
from .copying import copy_connection
from .dedupe import DEBOUNCED, DUPLICATE, INSERTED, REPLACED, ROW_KEY, Dedupe, EnqueueOutcome, OnConflict, Outcome
from .direct import DirectStatement
from .enqueue_hooks import EnqueueHook, Enqueueing
from .errors import InvalidArgumentError
from .jsontext import compact_json
from .mixin import JobMixin
from .payloads import check_meta
from .snapshot import Snapshots, json_loads
from .woken import mark_woken, woken

M = TypeVar("M", bound=JobMixin)

DEADLOCK = "40P01"  # deadlock_detected
DEADLOCK_TRIES = 5
# Under many producers a key's holder often finishes while the keyed INSERT
# waits behind later keys; each try that meets this writes again, in order.
FREED_KEY_TRIES = 20


def run_hooked(
    hooks: tuple[EnqueueHook, ...], table: str, rows: list[dict[str, Any]],
    write: Callable[[list[dict[str, Any]]], list[M]],
) -> list[M]:
    """Write checked ``rows`` with ``write`` inside the enqueue ``hooks``
    (:mod:`sa_jobqueue.enqueue_hooks`), each row's meta merged with what the
    hooks added (the row's own keys win); return what ``write`` returned."""
    enqueueing = Enqueueing(table, [row["queue"] for row in rows], [row["task"] for row in rows])
    jobs: list[M] | None = None
    with ExitStack() as stack:
        for hook in hooks:
            stack.enter_context(hook(enqueueing))
        if enqueueing.meta:
            added = check_meta(enqueueing.meta)
            rows = [{**row, "meta": {**added, **(row.get("meta") or {})}} for row in rows]
        jobs = write(rows)
        enqueueing.jobs = list(jobs)
    if jobs is None:  # a hook swallowed the writing's exception: the caller must not think it wrote
        raise RuntimeError(f"an enqueue hook of {table!r} swallowed the exception of the enqueue it wrapped")
    return jobs


class _KeyFreed(Exception):
    """A dedupe key was freed between an INSERT and its SELECT (internal)."""


def runnable_now(row: dict[str, Any]) -> bool:
    """Whether a checked row is runnable at once (no delay, no future run_at)."""
    return not row["delay"] and (row["run_at"] is None or row["run_at"] <= datetime.now(timezone.utc))


class Enqueuer(Generic[M]):
    """Writes checked rows of one job table and notifies their queues."""

    def __init__(self, model: type[M], table: Table, snapshots: Snapshots[M], *, channel: str, copy: bool) -> None:
        """``copy``: whether COPY may stand in for the INSERT of plain rows
        (a table without columns of the application's own, see :mod:`sa_jobqueue.bulk`)."""
        self.model = model
        self.table = table
        self.snapshots = snapshots
        self.channel = channel
        # What COPY leaves to the table's defaults; None: this table takes INSERT only (columns of the
        # application's own, defaults the client cannot know, or types COPY would not apply).
        self._defaults = bulk.stored_defaults(table) if copy and bulk.sent_as_is(table) else None
        self._omissible = bulk.omissible(table)  # what enqueue_many_fast's COPY may leave to the table
        # Statements are values: built once, reused with new parameters, so the
        # hot path skips construction and hits SQLAlchemy's compiled cache.
        returned = snapshots.columns
        self._insert = statements.insert_jobs(model, dedupe=False).returning(*returned, sort_by_parameter_order=True)
        self._insert_dedupe = statements.insert_jobs(model, dedupe=True).returning(*returned)
        self._take_over: dict[OnConflict, Any] = {
            "replace": keyed.take_over(model, returned, debounce=False),
            "debounce": keyed.take_over(model, returned, debounce=True),
        }
        self._done_holder = keyed.done_holder(model, returned)
        self._discard = keyed.discard(model)
        self._keep_done = bool(getattr(model, "__keep_done__", False))
        # One job: sent through psycopg's cursor where nothing would notice (:mod:`sa_jobqueue.direct`). On a
        # table whose defaults are known (as for COPY) it returns only what the server computes, and the
        # snapshot is built from the row: decoding twenty columns cost more client time than building them.
        one: list[Any] = list(returned) if self._defaults is None else [table.c.id, table.c.created_at,
                                                                           table.c.run_at]
        types = [column.type for column in one]
        self._insert_one = DirectStatement(statements.insert_jobs(model, dedupe=False).returning(*one),
                                           results=types)
        self._insert_one_notify = DirectStatement(statements.insert_jobs(model, dedupe=False).returning(
            *one, statements.notify_column(model)
        ), results=types)
        self._notify = statements.notify()
        self._sequence: str | None = None  # the id sequence, read at the first COPY

    def one(self, session: Session, row: dict[str, Any], *, notify: bool, payload_text: str | None = None) -> M:
        """Insert one row without a dedupe key; with ``notify``, wake its queue.
        ``payload_text``: the row's payload as its check encoded it, if known."""
        hooks = enqueue_hooks.HOOKS
        if hooks:  # a hook may change the row: its payload is read back from the row as the hook left it
            return run_hooked(hooks, self.table.name, [row], lambda rows: [self._one(session, rows[0], notify)])[0]
        return self._one(session, row, notify, payload_text)

    def _one(self, session: Session, row: dict[str, Any], notify: bool, payload_text: str | None = None) -> M:
        connection = self._insert_one.connection(session)
        # Where COPY could write the row, its payload's type is a plain JSON type: the text of the payload's
        # check is what that type sends, unless the engine has a json_serializer of its own.
        serializer = connection.dialect._json_serializer
        encoded = None if payload_text is None or self._defaults is None or serializer else {"payload": payload_text}
        if not (notify and runnable_now(row) and row["queue"] not in woken(session, self.channel)):
            [inserted] = self._insert_one.rows(connection, row, encoded=encoded)
        else:
            [inserted] = self._insert_one_notify.rows(connection, row | {"sajq_channel": self.channel}, encoded=encoded)
            mark_woken(session, self.channel, [row["queue"]])
        if self._defaults is None:
            return self.snapshots.one(inserted)
        job_id, created_at, run_at = inserted[:3]  # a NOTIFY's column may follow
        # The text sent, read back as the driver reads jsonb (the engine's json_deserializer, if any).
        loads, dumps = json_loads(connection), serializer or compact_json
        payload = loads(payload_text if encoded and payload_text is not None else dumps(row["payload"]))
        values = bulk.stored_row(bulk.left_out_values(self._defaults, created_at), job_id, row, run_at, payload)
        if "meta" in row:
            values["meta"] = loads(dumps(row["meta"]))
        return self.snapshots.of(values)

    def many(self, session: Session, rows: list[dict[str, Any]], *, notify: bool,
             payload_texts: list[str] | None = None) -> list[M]:
        """Insert ``rows`` and return their jobs in input order: a row whose
        dedupe key a live job (or an earlier row) holds comes back as that job.
        ``payload_texts``: per row, its payload as its check encoded it, if known."""
        return self._written(session, rows, notify, payload_texts)[0]

    def many_report(self, session: Session, rows: list[dict[str, Any]], *, notify: bool,
                    payload_texts: list[str] | None = None) -> list[EnqueueOutcome[M]]:
        """:meth:`many`, with what the call did for each row (:class:`~sa_jobqueue.dedupe.EnqueueOutcome`)."""
        jobs, outcomes = self._written(session, rows, notify, payload_texts)
        return [EnqueueOutcome(job, outcome) for job, outcome in zip(jobs, outcomes, strict=True)]

    def count(self, session: Session, specs: list[Any], check: Callable[[Any], tuple[dict[str, Any], str]],
              plain: Callable[[Any], tuple[str, str, str] | None], *, notify: bool) -> int:
        """Write ``specs`` (``check``: a spec's checked row and its payload's JSON text;
        ``plain``: :func:`~sa_jobqueue.spec.plain_fields`) as :meth:`many` writes their rows;
        return how many new jobs they made. Specs without a dedupe key that COPY can write go
        through :meth:`_stream`, unless an enqueue hook is registered (hooks are given the jobs
        as written): nothing is read back or built."""
        if not enqueue_hooks.HOOKS and all(spec.dedupe_key is None for spec in specs):
            streamed = self._stream(session, specs, check, plain, notify)
            if streamed is not None:
                return streamed
        checked = [check(spec) for spec in specs]
        outcomes = self._written(session, [row for row, _ in checked], notify, [text for _, text in checked])[1]
        return sum(outcome == INSERTED for outcome in outcomes)

    def _stream(self, session: Session, specs: list[Any], check: Callable[[Any], tuple[dict[str, Any], str]],
                plain: Callable[[Any], tuple[str, str, str] | None], notify: bool) -> int | None:
        """COPY plain ``specs``, each checked as it goes out (:func:`~sa_jobqueue.bulk.stream_new_rows`),
        so that the client checks rows while the server stores the ones before; None where COPY
        cannot stand in for the INSERT. The COPY runs in a SAVEPOINT: a spec that fails its
        check rolls the rows sent before it back, and the caller's transaction goes on as if
        the call had never been made."""
        conn = self._copy_connection(session, specs)
        if conn is None:
            return None
        runnable: set[str] = set()

        def checked(spec: Any) -> tuple[dict[str, Any], str]:
            row, text = check(spec)
            if runnable_now(row):
                runnable.add(row["queue"])
            return row, text

        def checked_plain(spec: Any) -> tuple[str, str, str] | None:
            fields = plain(spec)
            if fields is not None:  # no run_at, no delay: runnable at once
                runnable.add(fields[1])
            return fields

        with session.begin_nested():
            session.connection()  # sends the SAVEPOINT now: the COPY goes to the driver, which SQLAlchemy does not see
            bulk.stream_new_rows(session, conn, self.table, specs, checked, self._omissible, checked_plain)
        if notify:
            self.notify_queues(session, runnable)
        return len(specs)

    def _written(self, session: Session, rows: list[dict[str, Any]], notify: bool,
                 payload_texts: list[str] | None = None) -> tuple[list[M], list[Outcome]]:
        """Write ``rows`` inside the enqueue hooks; each row's job and outcome. Raise
        :class:`InvalidArgumentError` before writing anything when a row has a dedupe
        window and this table deletes finished jobs."""
        if not self._keep_done and any(row.get(ROW_KEY) and row[ROW_KEY].window is not None for row in rows):
            raise InvalidArgumentError("dedupe_key.window", f"counts finished jobs, which {self.table.name} does "
                                       "not keep (set __keep_done__ = True on its model)")
        hooks = enqueue_hooks.HOOKS
        if not (hooks and rows):  # an empty enqueue_many writes nothing: nothing to wrap
            return self._many(session, rows, notify, payload_texts)
        outcomes: list[Outcome] = []

        def write(hooked: list[dict[str, Any]]) -> list[M]:
            jobs, written = self._many(session, hooked, notify)
            outcomes.extend(written)
            return jobs

        return run_hooked(hooks, self.table.name, rows, write), outcomes

    def _many(self, session: Session, rows: list[dict[str, Any]], notify: bool,
              payload_texts: list[str] | None = None) -> tuple[list[M], list[Outcome]]:
        # Plain rows are the bulk path: a job and a constant per row, no object of their own.
        # payload_texts is given only where no hook ran: a hook may have changed a row's payload.
        result: list[M | None] = [None] * len(rows)
        outcomes: list[Outcome] = [INSERTED] * len(rows)
        latest: dict[int, M] = {}  # each keyed job as the last statement of the call left it
        for dedupe, indexes in bulk.write_order(rows):
            params = [rows[i] for i in indexes]
            if dedupe:
                for i, outcome in zip(indexes, self._insert_keyed_retrying(session, params), strict=True):
                    result[i], outcomes[i] = outcome.job, outcome.outcome
                    latest[outcome.job.id] = outcome.job
                continue
            copied = self._copy(session, params, None if payload_texts is None else [payload_texts[i] for i in indexes])
            written = copied if copied is not None else self.snapshots.all(session.execute(self._insert, params).all())
            for i, job in zip(indexes, written, strict=True):
                result[i] = job
        if notify:
            self.notify_queues(session, {row["queue"] for row in rows if runnable_now(row)})
        jobs = [job for job in result if job is not None]
        if latest:
            jobs = [latest.get(job.id, job) for job in jobs]
        return jobs, outcomes

    def _insert_keyed_retrying(self, session: Session, rows: list[dict[str, Any]]) -> list[EnqueueOutcome[M]]:
        """:meth:`_insert_keyed` in a SAVEPOINT, tried again when a key was
        freed under it or PostgreSQL ended it as a deadlock's victim.

        Keyed rows go in one global order, so producers wait for each other
        instead of deadlocking. A key whose live holder finished between this
        statement's INSERT and its SELECT is free again, but inserting it now
        would take it after keys that sort later, which this transaction
        holds, and another producer may hold it and wait for one of those.
        So the statement is rolled back to its SAVEPOINT (releasing its keys)
        and written again, in order, up to :data:`FREED_KEY_TRIES` times; only
        the last try inserts such a key on its own. A deadlock (which an
        application's own locks can still make) is tried again the same way,
        up to :data:`DEADLOCK_TRIES` times.
        """
        deadlocks = freed = 0
        dedupes: list[Dedupe] = [row[ROW_KEY] for row in rows]
        plain = [{k: v for k, v in row.items() if k != ROW_KEY} for row in rows]
        while True:
            last = freed == FREED_KEY_TRIES - 1
            try:
                with session.begin_nested():
                    outcomes = self._insert_keyed(session, plain, dedupes, free_keys_now=last)
                    if outcomes is None:
                        raise _KeyFreed  # rolls the SAVEPOINT back: the next try writes the key in order
                    return outcomes
            except _KeyFreed:
                freed += 1  # a job finished under the statement: progress elsewhere, so trying again is cheap
            except DBAPIError as exc:
                deadlocks += 1
                if getattr(exc.orig, "sqlstate", None) != DEADLOCK or deadlocks == DEADLOCK_TRIES:
                    raise

    def _insert_keyed(
        self, session: Session, rows: list[dict[str, Any]], dedupes: list[Dedupe], *, free_keys_now: bool
    ) -> list[EnqueueOutcome[M]] | None:
        """Rows with a dedupe key (one statement's worth, one ``on_conflict``)
        and their ``dedupes``: each row's new job, or the job holding its key,
        changed as ``on_conflict`` says when it is pending. None when a key
        was freed between the INSERT and the SELECT, unless ``free_keys_now``:
        then such a row is inserted on its own."""
        on_conflict = dedupes[0].on_conflict  # one per statement (bulk.write_order)
        if on_conflict != "skip" and len(rows) > 1:
            return self._insert_keyed_one_by_one(session, rows, dedupes, free_keys_now=free_keys_now)
        inserted = self.snapshots.all(session.execute(self._insert_dedupe, rows).all())
        # Each key's job as it stands now: the row this statement inserted, or a holder (changed or not).
        latest: dict[tuple[str, str | None], M] = {(job.queue, job.dedupe_key): job for job in inserted}
        fresh = set(latest)  # keys inserted here: the first row of each is the one inserted
        for row, dedupe in zip(rows, dedupes, strict=True):
            key = (row["queue"], row["dedupe_key"])
            if dedupe.window is not None and key in fresh:
                # After the INSERT, not before: a holder that finishes meanwhile is then seen, done.
                fresh.discard(key)
                holder = session.execute(self._done_holder, {
                    "sajq_queue": key[0], "sajq_key": key[1], "sajq_window": dedupe.window}).first()
                if holder is None:
                    fresh.add(key)
                else:  # a job of the key finished within the window: it wins, the new row goes
                    session.execute(self._discard, {"sajq_id": latest[key].id})
                    latest[key] = self.snapshots.one(holder)
        done: list[tuple[tuple[str, str | None], Outcome]] = []
        take_over = self._take_over.get(on_conflict)
        for row in rows:
            key = (row["queue"], row["dedupe_key"])
            if key in fresh:
                fresh.discard(key)
                done.append((key, INSERTED))
                continue
            if take_over is not None:  # replace or debounce: a pending holder takes this row's values
                changed = session.execute(take_over, keyed.take_over_params(row)).all()
                if changed:
                    latest[key] = self.snapshots.one(changed[0])
                    done.append((key, REPLACED if on_conflict == "replace" else DEBOUNCED))
                    continue
            done.append((key, DUPLICATE))
        missing = {key for key, _ in done} - set(latest)
        if missing:
            held = keyed.live_holders(
                self.model, self.snapshots.columns, [q for q, _ in missing], [k for _, k in missing if k is not None])
            holders = self.snapshots.all(session.execute(held).all())
            latest.update({(job.queue, job.dedupe_key): job for job in holders})
        outcomes: list[EnqueueOutcome[M]] = []
        for n, (row, (key, outcome)) in enumerate(zip(rows, done, strict=True)):
            if key not in latest:  # its holder finished under the statement: the key is free
                if not free_keys_now:
                    return None
                again = self._insert_keyed(session, [row], [dedupes[n]], free_keys_now=True)
                assert again is not None  # free_keys_now never gives up
                latest[key], outcome = again[0].job, again[0].outcome
            outcomes.append(EnqueueOutcome(latest[key], outcome))
        # Every row of a key shows the job as this call left it (a later row may have replaced it).
        return [EnqueueOutcome(latest[(o.job.queue, o.job.dedupe_key)] if o.job.dedupe_key is not None else o.job,
                               o.outcome) for o in outcomes]

    def _insert_keyed_one_by_one(
        self, session: Session, rows: list[dict[str, Any]], dedupes: list[Dedupe], *, free_keys_now: bool
    ) -> list[EnqueueOutcome[M]] | None:
        """:meth:`_insert_keyed` a row at a time. ``replace`` and ``debounce``
        lock the pending holder they change; after one INSERT of all the rows,
        those locks would come after the keys that sort later, which the INSERT
        took, and two producers could wait for each other. One row at a time,
        each key is inserted or changed in the one global order."""
        outcomes: list[EnqueueOutcome[M]] = []
        for row, dedupe in zip(rows, dedupes, strict=True):
            one = self._insert_keyed(session, [row], [dedupe], free_keys_now=free_keys_now)
            if one is None:
                return None
            outcomes.extend(one)
        latest = {outcome.job.id: outcome.job for outcome in outcomes}  # a later row's snapshot is the newer
        return [EnqueueOutcome(latest[outcome.job.id], outcome.outcome) for outcome in outcomes]

    def _copy(self, session: Session, rows: list[dict[str, Any]], payload_texts: list[str] | None) -> list[M] | None:
        """COPY plain rows when COPY can stand in for the INSERT (see :mod:`sa_jobqueue.bulk`);
        ``payload_texts``: their payloads' JSON text, if known."""
        conn = self._copy_connection(session, rows)
        if conn is None or self._defaults is None:  # the second: for the type checker, _copy_connection saw to it
            return None
        if self._sequence is None:
            self._sequence = bulk.sequence_of(session, self.table)
        return bulk.copy_rows(session, conn, self.table, self._sequence, rows, self._defaults, self.snapshots.of,
                              json_loads(session.connection()), payload_texts)

    def _copy_connection(self, session: Session, rows: list[Any]) -> Any | None:
        """The connection COPY writes ``rows`` on, or None where the INSERT must (see :mod:`sa_jobqueue.bulk`)."""
        if len(rows) < bulk.COPY_THRESHOLD or self._defaults is None:
            return None
        if session.connection().dialect._json_serializer is not None:
            return None  # COPY sends the checks' JSON text: the INSERT applies the engine's own serializer
        return copy_connection(session)

    def notify_queues(self, session: Session, queues: set[str]) -> None:
        """NOTIFY the ``queues`` not yet notified in this transaction, in one statement."""
        fresh = sorted(queues - woken(session, self.channel))
        if fresh:
            session.execute(self._notify, {"channel": self.channel, "queues": fresh})
            mark_woken(session, self.channel, fresh)
