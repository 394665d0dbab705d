"""A payload (or meta) the client cannot decode sends its own job to dead, never the claim's other jobs.

Rows written by SQL can hold JSON that PostgreSQL accepts and Python cannot
decode: nesting deeper than Python's recursion limit (PostgreSQL's own limit
comes from ``max_stack_depth``: about 14,000 levels of arrays with the
default 2 MB) or an integer longer than Python converts (4,300 digits by
default since 3.11). Decoded while the rows were fetched, one such row failed
the fetch of the whole claim, after a lease-mode claim had committed: every
job of the batch stayed running, unreachable, until its lease expired.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from datetime import timedelta
from decimal import Decimal
from typing import Any

import pytest
from jobapp import TaskJob, jobs
from sqlalchemy import Engine, create_engine, select, text
from sqlalchemy.orm import Session, sessionmaker
from sqllog import recorded_sql

from sa_jobqueue import JobSpec

LEASE = timedelta(seconds=60)
# Deep enough for Python's decoder to give up (at about sys.getrecursionlimit(),
# 1,000 by default), shallow enough for PostgreSQL to accept.
DEPTH = 5000
DEEP_ARRAY = f"CAST(repeat('[', {DEPTH}) || repeat(']', {DEPTH}) AS jsonb)"
DEEP_OBJECT = f"CAST(repeat('{{\"a\": ', {DEPTH}) || '1' || repeat('}}', {DEPTH}) AS jsonb)"
LONG_INTEGER = "CAST('[' || repeat('7', 5000) || ']' AS jsonb)"
RECURSION = "payload cannot be decoded: RecursionError: maximum recursion depth exceeded"


def _poison(session: Session, job_id: int, payload_sql: str) -> None:
    session.execute(text(f"UPDATE task_jobs SET payload = {payload_sql} WHERE id = :id"), {"id": job_id})


def _decodes(session: Session, payload_sql: str) -> bool:
    """Whether this process's json.loads decodes what PostgreSQL stores for ``payload_sql``."""
    stored = session.scalar(text(f"SELECT CAST({payload_sql} AS text)"))
    try:
        json.loads(stored)
    except (RecursionError, ValueError):
        return False
    return True


def _rows(session: Session) -> dict[int, tuple[Any, ...]]:
    found = session.execute(
        select(TaskJob.id, TaskJob.status, TaskJob.attempts, TaskJob.lock_token, TaskJob.last_error,
               TaskJob.finished_at)
    )
    return {row.id: tuple(row[1:]) for row in found}


@pytest.fixture(params=["lease", "transaction"])
def claiming(request: pytest.FixtureRequest, engine: Engine) -> tuple[str, sessionmaker[Session]]:
    """Sessions to claim in: autocommit, as a lease-mode worker's claim runs, or
    a transaction that holds the claim until it commits, as in transaction mode."""
    if request.param == "lease":
        return request.param, sessionmaker(engine.execution_options(isolation_level="AUTOCOMMIT"))
    return request.param, sessionmaker(engine, expire_on_commit=False)


def test_undecodable_payloads_go_to_dead_and_the_rest_of_the_claim_is_returned(
    sessions: sessionmaker[Session], claiming: tuple[str, sessionmaker[Session]], engine: Engine
) -> None:
    mode, claim_sessions = claiming
    with sessions.begin() as session:
        assert not _decodes(session, DEEP_ARRAY) and not _decodes(session, DEEP_OBJECT), (
            f"json.loads decodes {DEPTH} levels here (recursion limit {sys.getrecursionlimit()})"
        )
        created = jobs.enqueue_many(session, [JobSpec("noop", {"n": n}, priority=n) for n in range(5)])
        _poison(session, created[1].id, DEEP_ARRAY)
        _poison(session, created[3].id, DEEP_OBJECT)
    good = [created[0].id, created[2].id, created[4].id]
    bad = [created[1].id, created[3].id]

    with recorded_sql(engine) as sent, claim_sessions() as session, session.begin():
        claimed = jobs.claim(session, limit=5, worker="w", lease=LEASE)
        # The decoded jobs, in claim order, claimed as usual.
        assert [j.id for j in claimed] == good
        assert [j.payload for j in claimed] == [{"n": 0}, {"n": 2}, {"n": 4}]
        assert all(j.status == "running" and j.attempts == 1 and j.lock_token is not None for j in claimed)
        if mode == "lease":
            # Autocommit: both statements took effect as they ran.
            with sessions() as other:
                rows = _rows(other)
            assert all(rows[j.id][:3] == ("running", 1, j.lock_token) for j in claimed)
            assert all(rows[i][0] == "dead" for i in bad)
        jobs.complete_many(session, claimed)
    # One claim, one statement for the undecodable rows, one completion (and the check above).
    assert [s.split()[0] for s in sent if not s.startswith("SELECT")] == ["WITH", "UPDATE", "DELETE"]
    assert "unnest" in sent[1]

    with sessions() as session:
        rows = _rows(session)
    assert set(rows) == set(bad)  # the decoded jobs were completed
    for job_id in bad:
        status, attempts, token, error, finished_at = rows[job_id]
        assert (status, attempts, token) == ("dead", 1, None) and finished_at is not None
        assert error.startswith(RECURSION)
    # The queue is not wedged: the dead rows are not claimed again.
    with sessions.begin() as session:
        later = jobs.enqueue(session, "noop", {"n": 5})
    with claim_sessions() as session, session.begin():
        assert [j.id for j in jobs.claim(session, limit=5, lease=LEASE)] == [later.id]


def test_a_claim_of_undecodable_rows_only_claims_again_so_empty_still_means_empty(
    sessions: sessionmaker[Session], claiming: tuple[str, sessionmaker[Session]]
) -> None:
    _, claim_sessions = claiming
    with sessions.begin() as session:
        created = jobs.enqueue_many(session, [JobSpec("noop", {"n": n}, priority=n) for n in range(4)])
        for job in created[:3]:
            _poison(session, job.id, DEEP_ARRAY)
    with claim_sessions() as session, session.begin():
        [claimed] = jobs.claim(session, limit=2, lease=LEASE)  # two rounds of two dead, then n=3
        assert claimed.id == created[3].id and claimed.payload == {"n": 3}
        assert jobs.claim(session, limit=2, lease=LEASE) == []
    with sessions() as session:
        rows = _rows(session)
    assert [rows[j.id][0] for j in created] == ["dead", "dead", "dead", "running"]


def test_a_too_long_integer_is_undecodable_too(
    sessions: sessionmaker[Session], claiming: tuple[str, sessionmaker[Session]]
) -> None:
    _, claim_sessions = claiming
    with sessions.begin() as session:
        if _decodes(session, LONG_INTEGER):
            pytest.skip("this Python converts integers of any length")
        poisoned, fine = jobs.enqueue_many(session, [JobSpec("noop", {"n": 0}), JobSpec("noop", {"n": 1})])
        _poison(session, poisoned.id, LONG_INTEGER)
    with claim_sessions() as session, session.begin():
        assert [j.id for j in jobs.claim(session, limit=2, lease=LEASE)] == [fine.id]
    with sessions() as session:
        status, _, _, error, _ = _rows(session)[poisoned.id]
    assert status == "dead" and error.startswith("payload cannot be decoded: ValueError: ")
    assert "4300" in error


def test_an_undecodable_meta_sends_its_own_job_to_dead_too(
    sessions: sessionmaker[Session], claiming: tuple[str, sessionmaker[Session]]
) -> None:
    """meta, result and progress are read as text and decoded row by row, as the payload is: a
    meta Python cannot decode fails its own job, not the fetch of the claim that took the others."""
    _, claim_sessions = claiming
    with sessions.begin() as session:
        poisoned, fine, plain = jobs.enqueue_many(session, [
            JobSpec("noop", {"n": n}, priority=n, meta={"trace": f"t{n}"}) for n in range(3)
        ])
        session.execute(text(f"UPDATE task_jobs SET meta = {DEEP_OBJECT} WHERE id = :id"), {"id": poisoned.id})
        session.execute(text("UPDATE task_jobs SET meta = NULL WHERE id = :id"), {"id": plain.id})
    with claim_sessions() as session, session.begin():
        claimed = jobs.claim(session, limit=3, lease=LEASE)
        assert [(j.id, j.payload, j.meta, j.result, j.progress) for j in claimed] == [
            (fine.id, {"n": 1}, {"trace": "t1"}, None, None), (plain.id, {"n": 2}, None, None, None),
        ]
    with sessions() as session:
        status, attempts, token, error, _ = _rows(session)[poisoned.id]
    assert (status, attempts, token) == ("dead", 1, None)
    assert error.startswith("meta cannot be decoded: RecursionError: maximum recursion depth exceeded")


DECODED: list[object] = []


def _application_loads(value: bytes) -> Any:
    """An application's json_deserializer (module level: psycopg caches its loader per function)."""
    DECODED.append(value)
    if b"refused" in value:
        raise LookupError("refused by the application's decoder")
    return json.loads(value, parse_float=Decimal)


def test_payloads_are_decoded_with_the_engines_json_deserializer(db_url: Any, engine: Engine) -> None:
    """The claim decodes with what the dialect would have used: the engine's
    ``json_deserializer``, given what psycopg gives it (bytes); whatever it
    raises fails only its row."""
    custom = create_engine(db_url, json_deserializer=_application_loads)
    sessions: Callable[[], Session] = sessionmaker(custom, expire_on_commit=False)
    try:
        with sessions() as session, session.begin():
            kept, refused = jobs.enqueue_many(session, [
                JobSpec("noop", {"price": 1.5}, priority=0), JobSpec("noop", {"note": "-"}, priority=1),
            ])
            # Written by SQL: the INSERT's RETURNING would decode it with the same function.
            _poison(session, refused.id, """'{"note": "refused"}'""")
        DECODED.clear()
        with sessions() as session, session.begin():
            [claimed] = jobs.claim(session, limit=2, lease=LEASE)
            assert claimed.id == kept.id
            assert claimed.payload == {"price": Decimal("1.5")} and isinstance(claimed.payload["price"], Decimal)
        assert len(DECODED) == 2 and all(isinstance(value, bytes) for value in DECODED)
        with Session(engine) as session:
            status, _, _, error, _ = _rows(session)[refused.id]
        assert status == "dead"
        assert error == "payload cannot be decoded: LookupError: refused by the application's decoder"
    finally:
        custom.dispose()
