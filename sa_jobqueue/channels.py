"""The NOTIFY channels of a job table: their names, and nothing else.

One channel per table wakes idle workers when jobs are enqueued (the payload
is the queue's name); another carries the cancel requests of running jobs
(the payload is the job's id). Both are namespaced by table.
"""

from __future__ import annotations

CHANNEL_PREFIX = "sa_jobqueue_"


def channel_name(table_name: str) -> str:
    """The NOTIFY channel of a job table: one per table, named after it."""
    return f"{CHANNEL_PREFIX}{table_name}"


def cancel_channel_name(table_name: str) -> str:
    """The NOTIFY channel of a job table's cancel requests (``JobRepository.cancel_channel``);
    each notification's payload is the id of a running job whose cancel was requested.

    The ``:`` keeps it apart from every table's wake-up channel
    (:func:`channel_name`: no plain identifier holds a
    ``:``); quote the name in a hand-written ``LISTEN``. It fits PostgreSQL's
    63 bytes for the longest job table name.
    """
    return f"{CHANNEL_PREFIX}cancel:{table_name}"


def results_channel_name(table_name: str) -> str:
    """The NOTIFY channel of a job table's stored results: each notification's
    payload is the comma-separated ids of the jobs whose results a transaction
    stored (see :mod:`sa_jobqueue.results`); quoted like :func:`cancel_channel_name`."""
    return f"{CHANNEL_PREFIX}done:{table_name}"
