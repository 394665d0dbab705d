"""Unique jobs: what an enqueue does when its dedupe key is taken.

A dedupe key is held by at most one live job of a queue, enforced by the
table's partial unique index ``(queue, dedupe_key)`` over pending and running
jobs (so concurrent enqueues of one key cannot both insert). A plain string
key keeps the behaviour it always had: while a live job holds the key, the
enqueue returns that job and inserts nothing. :class:`Dedupe` says more:

* ``on_conflict``: ``"skip"`` (return the holder, as a string key does),
  ``"replace"`` (a pending holder takes the new payload and run_at) or
  ``"debounce"`` (a pending holder's run_at moves to the new one when that is
  later: a burst of enqueues runs once, after the last). A running holder is
  never changed: the enqueue returns it, as with ``"skip"``.
* ``until``: ``"finished"`` (the key is held while the job is pending or
  running) or ``"started"`` (held while it is pending only: the claim that
  starts the job gives its key up, so a new job of the key may wait while it
  runs).
* ``window``: on a table that keeps finished jobs, a job of the key that
  finished ``done`` and was enqueued less than ``window`` ago holds the key
  too: at most one job of a key per window (Oban's ``period``), measured on
  the database's clock from the finished job's ``created_at``.

:class:`EnqueueOutcome` is what
:meth:`~sa_jobqueue.JobRepository.enqueue_many_report` returns per job: the
job that holds the key after the call, and what the call did.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Generic, Literal, TypeVar

OnConflict = Literal["skip", "replace", "debounce"]
HeldUntil = Literal["finished", "started"]
Outcome = Literal["inserted", "duplicate", "replaced", "debounced"]

INSERTED: Outcome = "inserted"
DUPLICATE: Outcome = "duplicate"
REPLACED: Outcome = "replaced"
DEBOUNCED: Outcome = "debounced"

# The key of a keyed row's Dedupe in the row spec.to_row returns; not a column,
# so the enqueue takes it out before any statement sees the row.
ROW_KEY = "sajq_dedupe"

J = TypeVar("J")


@dataclass(frozen=True)
class Dedupe:
    """A dedupe key and what an enqueue does when a job holds it (module docstring).

    Give it where a ``dedupe_key`` is taken (:class:`~sa_jobqueue.JobSpec`,
    ``enqueue``, ``task.configure``); a plain string there is ``Dedupe(key)``.
    """

    key: str
    on_conflict: OnConflict = "skip"
    until: HeldUntil = "finished"
    window: timedelta | None = None


@dataclass(frozen=True)
class EnqueueOutcome(Generic[J]):
    """One job of :meth:`~sa_jobqueue.JobRepository.enqueue_many_report`.

    ``job``: the job that holds the spec's place after the call (the new one,
    or the one that held its key: the winner). ``outcome``: ``"inserted"``
    (a new job), ``"duplicate"`` (an existing job, unchanged), ``"replaced"``
    or ``"debounced"`` (an existing pending job, changed by this spec).
    """

    job: J
    outcome: Outcome


__all__ = [
    "DEBOUNCED", "DUPLICATE", "INSERTED", "REPLACED", "ROW_KEY", "Dedupe", "EnqueueOutcome", "HeldUntil",
    "OnConflict", "Outcome",
]
