"""Claiming: runnable jobs taken in one statement and handed back as snapshots.

:class:`Claimer` runs the claim behind :meth:`JobRepository.claim` (its
arguments already checked). The statement (:func:`sa_jobqueue.statements.claim`)
returns the payload and the job's other JSON values as JSON text, decoded row
by row with the decoder the driver would use
(:func:`~sa_jobqueue.snapshot.json_loads`). A claimed row with a value that
cannot be decoded is not handed back: it goes to ``dead`` at
once, in the same session, in one fenced statement; when only such rows came
back, the claim is made again, so an empty result still means an empty queue.
A claim's owner is named by :func:`default_worker_name` unless given, and
its lease lasts :data:`DEFAULT_LEASE` unless given.
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
from datetime import timedelta
from operator import itemgetter
from typing import Any, Generic, TypeVar

from sqlalchemy import Connection
from sqlalchemy.orm import Session

from . import statements
from .checks import clean_error
from .direct import DirectStatement
from .mixin import JobMixin
from .snapshot import Snapshots, json_loads

M = TypeVar("M", bound=JobMixin)

log = logging.getLogger("sa_jobqueue.repository")

DEFAULT_LEASE = timedelta(seconds=60)


def default_worker_name() -> str:
    """``host:pid:random``: unique per process, readable in ``locked_by``."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


class Claimer(Generic[M]):
    """Claims jobs of one table (see :func:`sa_jobqueue.statements.claim` for the statement)."""

    def __init__(self, model: type[M], snapshots: Snapshots[M]) -> None:
        self.model = model
        self.snapshots = snapshots
        # Built once per number of queues and bound (statements.limit_bound),
        # reused with new parameters (SQLAlchemy's compiled cache).
        self._claims: dict[tuple[int, int], DirectStatement] = {}
        self._bury = statements.bury(model)
        # Claim order (priority, then run_at, then id), as positions in a row of the snapshots' columns.
        self._order = itemgetter(*(snapshots.keys.index(key) for key in ("priority", "run_at", "id")))

    def claim(self, session: Session, params: dict[str, Any]) -> list[M]:
        """Run the claim with checked ``params`` (``queues``, ``limit``,
        ``worker``, ``lease``) in ``session``'s transaction; return the
        decodable jobs in claim order."""
        return self.claim_on(self._statement(params["queues"], params["limit"]).connection(session), params)

    def claim_on(self, connection: Connection, params: dict[str, Any]) -> list[M]:
        """The same on ``connection``, in its current transaction (at once in
        autocommit): what a worker's claimer threads run on the connection
        each holds, without a session's checkout and bookkeeping per claim."""
        queues = list(dict.fromkeys(params["queues"]))  # a queue named twice is read once
        claim = self._statement(queues, params["limit"])
        loads = json_loads(connection)
        params = {k: v for k, v in params.items() if k != "queues"} | dict(zip(statements.queue_keys(len(queues)),
                                                                               queues, strict=True))
        while True:
            # In claim order: an UPDATE returns its rows in no particular order. Sorted as rows, by
            # their values, rather than as snapshots, whose attributes cost more to read.
            rows = sorted(claim.rows(connection, params), key=self._order)
            jobs, failed = self.snapshots.decode(rows, loads)
            if not failed:
                break
            self._bury_undecodable(connection, failed)  # each round takes rows off the queue for good
            if jobs:
                break
        return jobs

    def _statement(self, queues: list[str], limit: int) -> DirectStatement:
        """The claim for this many distinct queues and this limit's bound, built once."""
        shape = len(dict.fromkeys(queues)), statements.limit_bound(limit)
        claim = self._claims.get(shape)
        if claim is None:
            returning = self.snapshots.text_columns
            claim = DirectStatement(statements.claim(self.model, *shape).returning(*returning),
                                    results=[column.type for column in returning])
            self._claims[shape] = claim
        return claim

    def _bury_undecodable(self, connection: Connection, failed: list[tuple[M, str]]) -> None:
        """Send claimed jobs with a value that cannot be decoded to dead, in one fenced statement."""
        errors = [clean_error(error) for _, error in failed]
        params = {"ids": [j.id for j, _ in failed], "tokens": [j.lock_token for j, _ in failed], "errors": errors}
        connection.execute(self._bury, params)
        for (job, _), error in zip(failed, errors, strict=True):
            log.warning("%s %s (%s) sent to dead: %s", self.model.__name__, job.id, job.task, error[:500])
