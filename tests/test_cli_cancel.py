"""``sa-jobqueue cancel``: pending jobs are cancelled, running ones get a cancel request.

JobRepository.cancel returns True for both; the command reads the job's
status after it to say which happened. Before, a running job was reported
"cancelled" while it went on running.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from click.testing import CliRunner, Result
from sqlalchemy import Engine, select, text
from sqlalchemy.orm import Session

from sa_jobqueue import JobRepository
from sa_jobqueue.cli import main
from sa_jobqueue.default import Job

repo = JobRepository(Job)




@pytest.fixture(autouse=True)
def _empty(default_table: tuple[str, Engine]) -> Iterator[None]:
    yield
    with default_table[1].begin() as conn:
        conn.execute(text("TRUNCATE sa_jobqueue_jobs"))


def _cancel(url: str, *ids: int) -> Result:
    return CliRunner().invoke(main, ["cancel", *map(str, ids)], env={"DATABASE_URL": url}, prog_name="sa-jobqueue")


def _jobs(engine: Engine) -> dict[int, tuple[str, bool]]:
    """Per job: its status, and whether its cancel was requested."""
    with Session(engine) as session:
        rows = session.execute(select(Job.id, Job.status, Job.cancel_requested_at)).all()
    return {job_id: (status, requested is not None) for job_id, status, requested in rows}


def _pending_and_running(engine: Engine, running: int = 1) -> tuple[int, list[int]]:
    with Session(engine) as session, session.begin():
        claimed = [repo.enqueue(session, "noop", priority=-1).id for _ in range(running)]
        pending = repo.enqueue(session, "noop").id
    if running:
        with Session(engine) as session, session.begin():
            assert sorted(job.id for job in repo.claim(session, limit=running)) == sorted(claimed)
    return pending, claimed


def test_cancel_says_which_jobs_it_cancelled_and_which_it_asked_to_stop(default_table: tuple[str, Engine]) -> None:
    url, engine = default_table
    pending, [running] = _pending_and_running(engine)
    result = _cancel(url, pending, running)
    assert result.exit_code == 0, result.output
    assert result.output.strip() == "cancelled 1 job(s), cancel requested for 1 running job(s)"
    assert _jobs(engine) == {pending: ("cancelled", False), running: ("running", True)}
    # Asked again: still running, still only requested.
    result = _cancel(url, running)
    assert (result.exit_code, result.output.strip()) == (0, "cancel requested for 1 running job(s)")


def test_cancel_of_pending_jobs_only_says_cancelled(default_table: tuple[str, Engine]) -> None:
    url, engine = default_table
    pending, _ = _pending_and_running(engine, running=0)
    result = _cancel(url, pending, pending)
    assert (result.exit_code, result.output.strip()) == (0, "cancelled 1 job(s)")


def test_cancel_is_all_or_none_requests_included(default_table: tuple[str, Engine]) -> None:
    url, engine = default_table
    pending, [running] = _pending_and_running(engine)
    assert _cancel(url, pending).exit_code == 0
    result = _cancel(url, running, pending)
    assert result.exit_code != 0
    assert f"job {pending} is cancelled, not pending or running (nothing changed)" in result.output
    assert _jobs(engine) == {pending: ("cancelled", False), running: ("running", False)}
