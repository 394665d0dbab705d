"""Signals about jobs (sa_jobqueue/signals.py): sent once per event, after
the transaction that records it committed, in both modes."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import pytest
from jobapp import Ledger, TaskJob, jobs
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from sa_jobqueue import JobSpec, RetryPolicy, TaskRegistry, Worker, signals

NOW = RetryPolicy(base=timedelta(0), max_delay=timedelta(0), jitter=0)
ALL = [signals.job_started, signals.job_succeeded, signals.job_failed, signals.job_retried, signals.job_dead]


@pytest.fixture
def events() -> Iterator[list[tuple[str, dict[str, Any]]]]:
    seen: list[tuple[str, dict[str, Any]]] = []
    lock = threading.Lock()
    receivers = []
    for signal in ALL:
        def receiver(sender: Any, _name: str = signal.name, **kwargs: Any) -> None:
            assert isinstance(sender, Worker)
            with lock:
                seen.append((_name, kwargs))

        signal.connect(receiver)
        receivers.append((signal, receiver))
    try:
        yield seen
    finally:
        for signal, receiver in receivers:
            signal.disconnect(receiver)


# How long each handler call took, by (job id, attempt), as the handler
# measured it: a span the reported duration must cover.
Spans = dict[tuple[int, int], float]

# Each handler runs at least this long (it blocks until then), so that a
# duration measured around anything less than the whole call falls short.
HANDLER_SPAN = 0.02


@contextmanager
def _measured(spans: Spans, job: TaskJob) -> Iterator[None]:
    start = time.monotonic()
    try:
        yield
    finally:
        while time.monotonic() - start < HANDLER_SPAN:
            time.sleep(HANDLER_SPAN / 4)
        spans[(job.id, job.attempts)] = time.monotonic() - start


def _registry(spans: Spans | None = None) -> TaskRegistry:
    registry = TaskRegistry()
    spans = {} if spans is None else spans

    @registry.task("quick")
    def quick(job: TaskJob) -> None:
        with _measured(spans, job):
            pass

    @registry.task("write")
    def write(job: TaskJob, session: Session) -> None:
        with _measured(spans, job):
            session.add(Ledger(job_id=job.id))

    @registry.task("flaky", retry=NOW)
    def flaky(job: TaskJob, session: Session) -> None:
        with _measured(spans, job):
            if job.attempts < 2:
                raise RuntimeError("first attempt fails")

    @registry.task("doomed", retry=NOW)
    def doomed(job: TaskJob, session: Session) -> None:
        with _measured(spans, job):
            raise ValueError("always")

    return registry


@pytest.mark.parametrize("mode", ["lease", "transaction"])
def test_each_event_is_signalled_once_after_it_committed(
    engine: Engine, sessions: sessionmaker[Session], events: list[tuple[str, dict[str, Any]]], mode: str
) -> None:
    with sessions.begin() as session:
        quick, write, flaky = jobs.enqueue_many(session, [JobSpec("quick"), JobSpec("write"), JobSpec("flaky")])
        doomed = jobs.enqueue(session, "doomed", max_attempts=1)
        unknown = jobs.enqueue(session, "nobody_handles_this")
    spans: Spans = {}
    result = Worker(engine, jobs, _registry(spans), mode=mode, concurrency=2, poll_interval=0.05,
                    listen=False).run(until_empty=True)
    assert (result.completed, result.retried, result.dead) == (3, 1, 2)

    def ids(name: str) -> list[int]:
        return sorted(kwargs["job"].id for n, kwargs in events if n == name)

    assert ids("job-started") == sorted([quick.id, write.id, flaky.id, flaky.id, doomed.id])
    assert ids("job-succeeded") == sorted([quick.id, write.id, flaky.id])
    assert ids("job-failed") == sorted([flaky.id, doomed.id, unknown.id])
    assert ids("job-retried") == [flaky.id]
    assert ids("job-dead") == sorted([doomed.id, unknown.id])
    by_job = {(n, kw["job"].id): kw for n, kw in events}
    assert by_job[("job-dead", doomed.id)]["status"] == "dead"
    assert isinstance(by_job[("job-dead", doomed.id)]["error"], ValueError)
    assert by_job[("job-dead", unknown.id)]["error"] is None
    assert by_job[("job-retried", flaky.id)]["status"] == "pending"
    assert by_job[("job-retried", flaky.id)]["job"].attempts == 1
    # A duration covers the handler's whole call: at least the span the handler
    # measured inside itself (for the unknown task, no handler ran).
    timed = [(n, kw) for n, kw in events if n != "job-started"]
    assert timed and all(isinstance(kw["duration"], float) for n, kw in timed)
    for name, kw in timed:
        span = spans.get((kw["job"].id, kw["job"].attempts))
        if kw["job"].id == unknown.id:
            assert span is None and kw["duration"] >= 0, (name, kw)
        else:
            assert span is not None and kw["duration"] >= span >= HANDLER_SPAN, (name, kw, span)


def test_a_failing_receiver_never_affects_the_job(engine: Engine, sessions: sessionmaker[Session]) -> None:
    def broken(sender: Any, **kwargs: Any) -> None:
        raise RuntimeError("receiver bug")

    signals.job_started.connect(broken)
    signals.job_succeeded.connect(broken)
    try:
        with sessions.begin() as session:
            jobs.enqueue_many(session, [JobSpec("write") for _ in range(5)])
        result = Worker(engine, jobs, _registry(), concurrency=2, listen=False).run(until_empty=True)
    finally:
        signals.job_started.disconnect(broken)
        signals.job_succeeded.disconnect(broken)
    assert (result.completed, result.retried, result.dead) == (5, 0, 0)
