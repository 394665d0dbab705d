"""Two duties of every worker, both drivers: its presence beat, and reading the paused queues.

* :class:`PresenceBeat` writes the worker's row of ``sa_jobqueue_workers``
  (:mod:`sa_jobqueue.presence`) every ``heartbeat_interval``, with the jobs
  its handlers run and their progress, adds the jobs it finished since the
  last beat to ``sa_jobqueue_throughput`` (:mod:`sa_jobqueue.throughput`),
  and deletes its row at a clean stop.
* :class:`PauseWatch` reads the paused queues of the worker's tables
  (:mod:`sa_jobqueue.pausing`) every ``poll_interval`` into
  ``WorkerContext.paused``, which the claims leave out.

Each runs one statement in a transaction of its own and logs a failure
once per run of failures instead of raising: a database without revision
0007 runs jobs as before, with no presence and no queue paused.
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING

from ..pausing import paused_queues
from ..presence import beat, prune_gone, withdraw
from ..throughput import add_finished, prune_throughput

if TYPE_CHECKING:
    from .context import WorkerContext

log = logging.getLogger("sa_jobqueue.worker")

__all__ = ["BEATS_TO_EXPIRE", "PauseWatch", "PresenceBeat"]

# A worker whose row was not refreshed for this many beats counts as gone.
BEATS_TO_EXPIRE = 3
# Every this many beats a worker deletes the rows of workers long gone.
PRUNE_EVERY = 10


class PresenceBeat:
    """The worker's row in ``sa_jobqueue_workers``: written every ``interval`` seconds."""

    def __init__(self, ctx: WorkerContext, driver: str) -> None:
        self.ctx = ctx
        self.interval = ctx.options.heartbeat_interval
        self.id = uuid.uuid4().hex
        self._fixed = {
            "id": self.id, "name": ctx.name, "host": socket.gethostname(), "pid": os.getpid(), "driver": driver,
            "mode": ctx.options.mode, "concurrency": ctx.options.concurrency,
            "tables": [repo.table.name for repo in ctx.repositories], "queues": list(ctx.options.queues),
            "started_at": datetime.now(timezone.utc),
        }
        self._beats = 0
        self._failing = False

    def run(self) -> bool:
        ctx = self.ctx
        tally = ctx.books.take_tally()
        try:
            with ctx.control() as session:
                beat(session, dict(self._fixed, running=ctx.running.described()),
                     expires_in=timedelta(seconds=self.interval * BEATS_TO_EXPIRE))
                add_finished(session, tally)
                if self._beats % PRUNE_EVERY == 0:
                    prune_gone(session)
                    prune_throughput(session)
        except Exception as exc:
            ctx.books.give_back_tally(tally)  # counted by a later beat
            if not self._failing:
                log.warning("worker %s: cannot write its presence (%s); is the table sa_jobqueue_workers "
                            "created (revision 0007, or sa_jobqueue.create_control_tables)? Jobs run as before",
                            ctx.name, _first_line(exc))
            self._failing = True
            return False
        if self._failing:
            log.info("worker %s: its presence is written again", ctx.name)
        self._failing = False
        self._beats += 1
        return False

    def withdraw(self) -> None:
        """The worker stops: write its last counts and delete its row (a failure leaves it to expire)."""
        if not self._beats:
            return
        tally = self.ctx.books.take_tally()
        try:
            with self.ctx.control() as session:
                withdraw(session, self.id)
            with self.ctx.control() as session:
                add_finished(session, tally)
        except Exception as exc:
            log.warning("worker %s: cannot delete its presence or write its last counts (%s); the presence "
                        "expires by itself", self.ctx.name, _first_line(exc))


class PauseWatch:
    """Reads which of the worker's queues are paused, every ``interval`` seconds."""

    def __init__(self, ctx: WorkerContext) -> None:
        self.ctx = ctx
        self.interval = ctx.options.poll_interval
        self._tables = [repo.table.name for repo in ctx.repositories]
        self._failing = False

    def run(self) -> bool:
        """True when a queue was resumed: the worker claims at once."""
        ctx = self.ctx
        try:
            with ctx.control() as session:
                found = paused_queues(session, self._tables)
        except Exception as exc:
            # The last known pauses stay in force: a database that fails a
            # read fails the claims too.
            if not self._failing:
                log.warning("worker %s: cannot read the paused queues (%s); is the table "
                            "sa_jobqueue_paused_queues created (revision 0007, or "
                            "sa_jobqueue.create_control_tables)?", ctx.name, _first_line(exc))
            self._failing = True
            return False
        self._failing = False
        mine = set(ctx.options.queues)
        paused = {table: frozenset(queues & mine) for table, queues in found.items() if queues & mine}
        before = ctx.paused
        if paused == before:
            return False
        for table in sorted(set(paused) | set(before)):
            now, then = paused.get(table, frozenset()), before.get(table, frozenset())
            for queue in sorted(now - then):
                log.info("worker %s: queue %s of %s is paused: not claiming from it", ctx.name, queue, table)
            for queue in sorted(then - now):
                log.info("worker %s: queue %s of %s is resumed", ctx.name, queue, table)
        ctx.paused = paused
        return any(before.get(table, frozenset()) - paused.get(table, frozenset()) for table in before)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"
