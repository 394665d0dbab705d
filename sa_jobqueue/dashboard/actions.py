"""The dashboard's actions on jobs, and the CSRF tokens that guard them.

An action (:data:`ACTIONS`) applies one of the library's verbs to every job
matching a filter (one job: the filter ``id``), in batches of
:data:`BATCH` jobs, each batch a transaction of its own, newest first. Each
verb changes only jobs in a state it may change and leaves the others as
they are, so an action over a mixed filter is safe: the result counts what
changed and what was left. None touches a running job except ``cancel``,
which asks its worker to stop it (:meth:`~sa_jobqueue.JobRepository.cancel`).

A CSRF token is the HMAC of a random per-browser cookie under the app's
secret: a form posted from another site has the cookie (the browser sends
it) but cannot know the token, so the action is refused.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
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
CSRF_COOKIE = "sajq_csrf"

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


def new_cookie() -> str:
    """A fresh random value for the CSRF cookie."""
    return secrets.token_urlsafe(32)


def csrf_token(secret: bytes, cookie: str) -> str:
    """The token a form must carry for a browser whose CSRF cookie is ``cookie``."""
    return hmac.new(secret, cookie.encode(), hashlib.sha256).hexdigest()


def csrf_valid(secret: bytes, cookie: str | None, token: str | None) -> bool:
    """Whether ``token`` is the one for ``cookie`` (both given), compared in constant time."""
    return bool(cookie) and bool(token) and hmac.compare_digest(csrf_token(secret, cookie or ""), token or "")


__all__ = ["ACTIONS", "BATCH", "CSRF_COOKIE", "Action", "Outcome", "apply", "csrf_token", "csrf_valid", "new_cookie"]
