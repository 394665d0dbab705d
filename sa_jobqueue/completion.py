"""Completion: a claimed job's fenced finish, of one job or of many in one statement.

:class:`Completions` holds the two statements behind
:meth:`JobRepository.complete` and :meth:`JobRepository.complete_many`
(:func:`sa_jobqueue.statements.complete` and ``complete_many``), built once
and sent straight through the driver (:mod:`sa_jobqueue.direct`), with their
arguments already checked. A worker's completer calls :meth:`Completions.many_on`
with the jobs its own claims returned, on a connection of its own engine,
without a session around the write.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection
from sqlalchemy.orm import Session

from . import statements
from .direct import DirectStatement


class Completions:
    """The completions of one job table (``model``); ``keep_done``: mark jobs ``done`` instead of deleting them."""

    def __init__(self, model: Any, *, keep_done: bool) -> None:
        self._one = DirectStatement(statements.complete(model, keep_done=keep_done))
        self._many = DirectStatement(statements.complete_many(model, keep_done=keep_done))

    def one(self, session: Session, job: Any) -> bool:
        """Finish ``job`` in ``session``'s transaction; False when it was no longer owned (nothing changed)."""
        params = {"job_id": job.id, "token": job.lock_token}
        return bool(self._one.rows(self._one.connection(session), params))

    def many(self, session: Session, jobs: Sequence[Any]) -> set[int]:
        """Finish ``jobs`` in ``session``'s transaction, in one statement; the ids finished."""
        return self.many_on(self._many.connection(session), jobs) if jobs else set()

    def many_on(self, connection: Connection, jobs: Sequence[Any]) -> set[int]:
        """The same on ``connection``, in its current transaction (at once in autocommit).
        A job missing from the result was no longer owned: its row is left as it was."""
        if not jobs:
            return set()
        params = {"ids": [job.id for job in jobs], "tokens": [job.lock_token for job in jobs]}
        return {row[0] for row in self._many.rows(connection, params)}
