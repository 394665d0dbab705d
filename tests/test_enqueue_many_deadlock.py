"""Concurrent ``enqueue_many`` with overlapping dedupe keys: no deadlock, one job per key.

Producers on separate connections enqueue the same fresh keys at the same
instant, each in an order of its own. An INSERT that meets a key another
transaction inserted but has not committed waits for that transaction; two
producers writing the keys in opposite orders then wait for each other, and
PostgreSQL breaks the cycle by failing one of them (DeadlockDetected) after
``deadlock_timeout``. Written in one order, they only ever queue up behind
each other.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from typing import Any

import pytest
from jobapp import EmailJob, emails
from sqlalchemy import Engine, create_engine, delete, event, func, select, text
from sqlalchemy.orm import Session, sessionmaker
from waiting import wait_for

from sa_jobqueue import Dedupe, JobSpec
from sa_jobqueue.enqueue import DEADLOCK

PRODUCERS = 8
# SQLAlchemy sends the rows of one INSERT in pages of this many (default
# 1000): a small page makes a call of 50 rows several statements, with the
# rows of the first pages locked while the next are sent, as a call of a few
# thousand rows is with the default page.
PAGE = 10
KEYS = 50
ROUNDS = 20
TIMEOUT = 60.0


def test_concurrent_enqueue_many_with_shuffled_dedupe_keys_does_not_deadlock(engine: Engine) -> None:
    paged = create_engine(engine.url, pool_size=PRODUCERS, insertmanyvalues_page_size=PAGE)
    try:
        _race(sessionmaker(paged, expire_on_commit=False))
    finally:
        paged.dispose()


def _race(sessions: sessionmaker[Session]) -> None:
    # Each round uses fresh keys (a live job holding a key commits once, and a
    # key already committed makes no one wait), so every round is a new race.
    barrier = threading.Barrier(PRODUCERS, timeout=TIMEOUT)
    errors: list[BaseException] = []
    # results[round][producer]: the ids enqueue_many returned, keyed by dedupe key.
    results: list[list[dict[str, int]]] = [[{} for _ in range(PRODUCERS)] for _ in range(ROUNDS)]

    def produce(producer: int) -> None:
        shuffler = random.Random(producer)
        try:
            for round_ in range(ROUNDS):
                keys = [f"r{round_}-k{i}" for i in range(KEYS)]
                shuffler.shuffle(keys)
                # Rows of two shapes (with and without a column of the
                # app's own: one statement takes one shape), differing per
                # producer, and a row without a key.
                specs = [
                    JobSpec("noop", {"k": key}, dedupe_key=key, extra={"tenant_id": producer} if i % 3 else {})
                    for i, key in enumerate(keys)
                ]
                specs.insert(KEYS // 2, JobSpec("noop", {"plain": round_}))
                barrier.wait()
                with sessions.begin() as session:
                    created = emails.enqueue_many(session, specs)
                assert [job.dedupe_key for job in created] == [spec.dedupe_key for spec in specs]
                assert [job.payload for job in created] == [spec.payload for spec in specs]
                results[round_][producer] = {job.dedupe_key: job.id for job in created if job.dedupe_key}
        except BaseException as exc:  # noqa: B036 - reported by the test below
            errors.append(exc)
            barrier.abort()

    _run_producers(produce, errors, ROUNDS)

    # Every producer got the same job for a key: the one job that holds it.
    for round_ in range(ROUNDS):
        first = results[round_][0]
        assert len(first) == KEYS
        assert all(seen == first for seen in results[round_])
    with sessions() as session:
        keyed = session.scalar(select(func.count()).select_from(EmailJob).where(EmailJob.dedupe_key.is_not(None)))
        distinct = session.scalar(select(func.count(func.distinct(EmailJob.dedupe_key))))
        plain = session.scalar(select(func.count()).select_from(EmailJob).where(EmailJob.dedupe_key.is_(None)))
    assert keyed == distinct == ROUNDS * KEYS
    assert plain == ROUNDS * PRODUCERS


def _run_producers(produce: Callable[[int], None], errors: list[BaseException], rounds: int) -> None:
    """Run ``produce(p)`` for each producer in a thread of its own; fail on a hang or an error."""
    threads = [threading.Thread(target=produce, args=(p,), daemon=True) for p in range(PRODUCERS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT * rounds)
    assert not any(thread.is_alive() for thread in threads), "a producer hangs"
    real = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)]
    assert not real, f"{len(real)} producer(s) failed, first: {real[0]!r}"
    assert not errors


def test_a_key_freed_between_insert_and_select_is_written_again_in_order(engine: Engine) -> None:
    """The one case the global order does not cover by itself: producer B's
    INSERT skips key ``a`` (a live job holds it) and takes ``b``; the holder
    finishes before B's SELECT, and producer A inserts ``a`` and waits for
    B's ``b``. Were B to insert ``a`` now, on its own, it would wait for A
    while A waits for it; B's statement is rolled back to its SAVEPOINT
    instead (freeing ``b``) and written again in order. B detects deadlocks
    at once and A never does, so a cycle would fail B's call every time."""
    paused = create_engine(engine.url, pool_size=2)
    b_inserted, b_go = threading.Event(), threading.Event()
    outcome: dict[str, Any] = {}

    def pause_after_first_insert(conn: Any, cursor: Any, statement: str, *rest: Any) -> None:
        if threading.current_thread().name == "producer-b" and "ON CONFLICT" in statement and not b_inserted.is_set():
            b_inserted.set()
            b_go.wait(TIMEOUT)

    event.listen(paused, "after_cursor_execute", pause_after_first_insert)
    # Every error a statement of B's meets, the ones the library catches and retries included.
    met: list[str | None] = []
    event.listen(paused, "handle_error", lambda context: met.append(getattr(context.original_exception,
                                                                              "sqlstate", None)))
    specs = [JobSpec("noop", {"k": key}, dedupe_key=key) for key in ("dl-a", "dl-b")]

    def produce(name: str, bind: Engine, deadlock_timeout: str) -> None:
        try:
            with Session(bind) as session, session.begin():
                session.execute(text(f"SET LOCAL deadlock_timeout = '{deadlock_timeout}'"))
                outcome[f"{name}-pid"] = session.execute(select(func.pg_backend_pid())).scalar_one()
                outcome[name] = {job.dedupe_key: job.id for job in emails.enqueue_many(session, specs)}
        except BaseException as exc:  # noqa: B036 - reported below
            outcome[f"{name}-error"] = exc

    try:
        with Session(engine) as session, session.begin():
            holder = emails.enqueue(session, "noop", dedupe_key="dl-a")
        b = threading.Thread(target=produce, args=("b", paused, "10ms"), name="producer-b", daemon=True)
        b.start()
        assert b_inserted.wait(TIMEOUT), "producer B never inserted"
        with Session(engine) as session, session.begin():
            session.execute(delete(EmailJob).where(EmailJob.id == holder.id))  # the holder finished: "dl-a" is free
        a = threading.Thread(target=produce, args=("a", engine, "60s"), name="producer-a", daemon=True)
        a.start()

        def a_waits_for_b() -> bool:
            pid = outcome.get("a-pid")
            with engine.connect() as conn:
                return pid is not None and bool(conn.execute(
                    text("SELECT count(*) FROM pg_stat_activity WHERE pid = :pid AND wait_event_type = 'Lock'"),
                    {"pid": pid},
                ).scalar())

        wait_for(a_waits_for_b, TIMEOUT, "producer A to wait for producer B's key")
        b_go.set()
        for thread in (a, b):
            thread.join(TIMEOUT)
            assert not thread.is_alive(), f"{thread.name} hangs"
    finally:
        b_go.set()
        paused.dispose()
    errors = {k: v for k, v in outcome.items() if k.endswith("-error")}
    assert not errors, errors
    assert met == []  # B never waited for A: no deadlock to break, not even one retried
    assert outcome["a"] == outcome["b"]  # one job per key, A's: B waited for it and returned it
    with Session(engine) as session:
        keys = session.scalars(select(EmailJob.dedupe_key).where(EmailJob.dedupe_key.like("dl-%"))).all()
    assert sorted(keys) == ["dl-a", "dl-b"]


@pytest.mark.parametrize("on_conflict", ["replace", "debounce"])
def test_concurrent_replacing_enqueues_take_their_keys_in_order(engine: Engine, on_conflict: str) -> None:
    """``replace`` and ``debounce`` change the pending holder of a key, which
    locks its row: were the changes made after the call's whole INSERT, a
    producer would lock an earlier key after a later one, and two producers
    would wait for each other. Each key is inserted or changed in turn, in the
    one global order, so no statement ever meets a deadlock (not even one the
    library would retry)."""
    paged = create_engine(engine.url, pool_size=PRODUCERS, insertmanyvalues_page_size=PAGE)
    met: list[str | None] = []
    event.listen(paged, "handle_error", lambda context: met.append(getattr(context.original_exception,
                                                                            "sqlstate", None)))
    sessions = sessionmaker(paged, expire_on_commit=False)
    barrier = threading.Barrier(PRODUCERS, timeout=TIMEOUT)
    errors: list[BaseException] = []
    rounds = ROUNDS // 2
    # outcomes[round][producer]: {key: (job id, outcome)}
    outcomes: list[list[dict[str | None, tuple[int, str]]]] = [[{} for _ in range(PRODUCERS)] for _ in range(rounds)]

    def produce(producer: int) -> None:
        shuffler = random.Random(producer)
        try:
            for round_ in range(rounds):
                keys = [f"c{round_}-k{i}" for i in range(KEYS // 2)]
                shuffler.shuffle(keys)
                specs = [JobSpec("noop", {"k": key, "by": producer},
                                 dedupe_key=Dedupe(key, on_conflict=on_conflict))  # type: ignore[arg-type]
                         for key in keys]
                barrier.wait()
                with sessions.begin() as session:
                    reported = emails.enqueue_many_report(session, specs)
                outcomes[round_][producer] = {o.job.dedupe_key: (o.job.id, o.outcome) for o in reported}
        except BaseException as exc:  # noqa: B036 - reported by the test below
            errors.append(exc)
            barrier.abort()

    try:
        _run_producers(produce, errors, rounds)
        assert DEADLOCK not in met, met
        changed = "replaced" if on_conflict == "replace" else "debounced"
        for round_ in range(rounds):
            for key in outcomes[round_][0]:
                seen = [outcomes[round_][p][key] for p in range(PRODUCERS)]
                assert len({job_id for job_id, _ in seen}) == 1  # one job per key, the same for everyone
                assert sorted(outcome for _, outcome in seen) == sorted(["inserted"] + [changed] * (PRODUCERS - 1))
        with sessions() as session:
            keyed = session.scalar(select(func.count()).select_from(EmailJob).where(EmailJob.dedupe_key.is_not(None)))
        assert keyed == rounds * (KEYS // 2)
    finally:
        paged.dispose()
