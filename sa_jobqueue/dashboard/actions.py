"""The dashboard's actions on jobs.

An action (:data:`ACTIONS`) applies one of the library's verbs to every job
matching a filter (one job: the filter ``id``), in batches of
:data:`BATCH` jobs, each batch a transaction of its own, newest first. Each
verb changes only jobs in a state it may change and leaves the others as
they are, so an action over a mixed filter is safe: the result counts what
changed and what was left. None touches a running job except ``cancel``,
which asks its worker to stop it (:meth:`~sa_jobqueue.JobRepository.cancel`).

The forms that post them carry a CSRF token (:mod:`sa_jobqueue.dashboard.csrf`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from sqlalchemy import Engine
from sqlalchemy.orm import Session

from ..edits import delete_job, run_now, set_priority
from ..repository import JobRepository
from . import queries
from .filters import JobFilter

BATCH = 500

Verb = Callable[[Session, JobRepository[Any], int, int], bool]


@dataclass(frozen=True)
class Action:
    """One action: its words on the page, the verb, and what it leaves alone (for the result's words)."""

    label: str
    verb: Verb
    applies_to: str


ACTIONS: dict[str, Action] = {
    "retry": Action("Retry", lambda s, r, i, p: r.retry(s, i), "dead or cancelled jobs"),
    "cancel": Action("Cancel", lambda s, r, i, p: r.cancel(s, i), "pending or running jobs"),
    "run_now": Action("Run now", lambda s, r, i, p: run_now(s, r, i), "pending jobs"),
    "priority": Action("Change priority", lambda s, r, i, p: set_priority(s, r, i, p), "pending jobs"),
    "delete": Action("Delete", lambda s, r, i, p: delete_job(s, r, i), "jobs that are not running"),
}


@dataclass(frozen=True)
class Outcome:
    """What an action did: jobs changed, and jobs matched but left as they were."""

    changed: int
    left: int


def apply(engine: Engine, repository: JobRepository[Any], name: str, wanted: JobFilter, priority: int = 0) -> Outcome:
    """Apply action ``name`` to every job of ``repository`` matching ``wanted``."""
    action = ACTIONS[name]
    changed = left = 0
    keyset = wanted
    while True:
        with Session(engine) as session, session.begin():
            ids = queries.matching_ids(session, repository, keyset, BATCH)
            for job_id in ids:
                if action.verb(session, repository, job_id, priority):
                    changed += 1
                else:
                    left += 1
        if len(ids) < BATCH:
            return Outcome(changed, left)
        keyset = replace(wanted, before=ids[-1])


__all__ = ["ACTIONS", "BATCH", "Action", "Outcome", "apply"]
