"""Which queues a transaction has woken: one NOTIFY per channel and queue per transaction.

An enqueue wakes a queue's workers with a NOTIFY that is delivered at
commit; a second one in the same transaction would wake nobody new. The
session's ``info`` remembers the (channel, queue) pairs sent in its current
transaction; a new transaction starts with none.
"""

from __future__ import annotations

from collections.abc import Iterable

from sqlalchemy.orm import Session

# session.info key: (transaction, {(channel, queue)}) already notified in it.
NOTIFIED = "sa_jobqueue.notified"


def woken(session: Session, channel: str) -> set[str]:
    """The queues of ``channel`` already notified in the session's current transaction."""
    seen: tuple[object, set[tuple[str, str]]] | None = session.info.get(NOTIFIED)
    if seen is None or seen[0] is not session.get_transaction():
        return set()
    return {queue for sent, queue in seen[1] if sent == channel}


def mark_woken(session: Session, channel: str, queues: Iterable[str]) -> None:
    """Remember that ``queues`` of ``channel`` were notified in the session's current transaction."""
    transaction = session.get_transaction()
    seen: tuple[object, set[tuple[str, str]]] | None = session.info.get(NOTIFIED)
    if seen is None or seen[0] is not transaction:
        seen = (transaction, set())
        session.info[NOTIFIED] = seen
    seen[1].update((channel, queue) for queue in queues)


__all__ = ["NOTIFIED", "mark_woken", "woken"]
