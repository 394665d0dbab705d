"""What the dashboard reads and writes of the operations tables (revision 0007).

The Workers page reads ``sa_jobqueue_workers`` (:mod:`sa_jobqueue.presence`),
the overview the paused queues (:mod:`sa_jobqueue.pausing`) and the
throughput the workers counted (:mod:`sa_jobqueue.throughput`); pausing and
resuming a queue goes through the library's own verbs. Each reader returns
None when its table does not exist, so a database that has not run the
revision shows a notice instead of failing the page.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Engine, text
from sqlalchemy.orm import Session

from ..control_tables import PAUSED_TABLE, THROUGHPUT_TABLE, WORKERS_TABLE
from ..pausing import pause_queue, paused_queues, resume_queue
from ..presence import WorkerPresence, list_workers
from ..progress import Progress
from ..throughput import Minute, per_minute

__all__ = ["QUEUE_OPERATIONS", "RunningJob", "change_queue", "paused_of", "running_of", "throughput_of",
           "workers_of"]

# What the overview offers per queue: the operation, and its button's label.
QUEUE_OPERATIONS = {"pause": "Pause", "resume": "Resume"}


@dataclass(frozen=True)
class RunningJob:
    """A job a worker's last beat said it runs."""

    table: str
    id: int
    task: str
    queue: str
    attempt: int
    since: datetime
    progress: Progress | None


def _exists(session: Session, name: str) -> bool:
    return session.execute(text("SELECT to_regclass(:name)"), {"name": name}).scalar_one() is not None


def workers_of(session: Session, tables: Sequence[str]) -> list[WorkerPresence] | None:
    """The workers serving any of ``tables``, alive first; None without the table."""
    if not _exists(session, WORKERS_TABLE):
        return None
    return list_workers(session, tables=list(tables))


def running_of(worker: WorkerPresence) -> list[RunningJob]:
    """The running jobs of ``worker``'s row, read defensively (the row is JSON)."""
    found = []
    for entry in worker.running:
        try:
            found.append(RunningJob(str(entry["table"]), int(entry["id"]), str(entry["task"]), str(entry["queue"]),
                                    int(entry["attempt"]), datetime.fromisoformat(entry["since"]),
                                    Progress.from_json(entry.get("progress"))))
        except (KeyError, TypeError, ValueError):
            continue
    return found


def paused_of(session: Session, tables: Sequence[str]) -> dict[str, set[str]] | None:
    """The paused queues of ``tables``; None without the table."""
    if not _exists(session, PAUSED_TABLE):
        return None
    return paused_queues(session, tables)


def throughput_of(session: Session, table: str) -> list[Minute] | None:
    """The jobs workers finished per minute over the last hour in ``table``; None without the table."""
    if not _exists(session, THROUGHPUT_TABLE):
        return None
    return per_minute(session, table)


def change_queue(engine: Engine, repo: Any, operation: str, queue: str) -> bool:
    """Pause or resume ``queue`` of ``repo``'s table in a transaction of its own; True when it changed."""
    with Session(engine) as session, session.begin():
        if operation == "pause":
            return pause_queue(session, repo, queue, by="dashboard")
        return resume_queue(session, repo, queue)
