"""OpenTelemetry tracing (sa_jobqueue.contrib.opentelemetry), on the real SDK with its in-memory exporter:
the enqueue's producer span and its trace context written into the job's meta in the application's
transaction, a consumer span per attempt linked to it (retries too), errors recorded, in the thread
worker (both modes) and the asyncio worker (both drivers); without instrumentation, meta stays NULL."""

from __future__ import annotations

import contextlib
import io
import re
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from jobapp import TaskJob
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from sqlalchemy import Engine, create_engine, select
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession
from sqlalchemy.orm import Session

from sa_jobqueue import JobContext, JobRepository, RetryPolicy, TaskRegistry, Worker
from sa_jobqueue.aio import AsyncJobRepository, AsyncWorker
from sa_jobqueue.bulk import COPY_THRESHOLD
from sa_jobqueue.contrib.opentelemetry import META_KEY, instrument, uninstrument
from sa_jobqueue.enqueue_hooks import enqueue_hooks

jobs = JobRepository(TaskJob)
QUICK = RetryPolicy(base=timedelta(0), max_delay=timedelta(0), jitter=0)


class Traced:
    """A real SDK tracer provider exporting to memory, and the registry instrumented with it."""

    def __init__(self) -> None:
        self.exporter = InMemorySpanExporter()
        self.provider = TracerProvider()
        self.provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        self.app = self.provider.get_tracer("the application")
        self.registry = TaskRegistry(repository=jobs)

    def spans(self, kind: SpanKind) -> list[ReadableSpan]:
        return [span for span in self.exporter.get_finished_spans() if span.kind is kind]


@pytest.fixture
def traced() -> Iterator[Traced]:
    made = Traced()
    instrument(made.registry, tracer_provider=made.provider)
    try:
        yield made
    finally:
        uninstrument(made.registry)
        made.provider.shutdown()
    assert not enqueue_hooks() and not made.registry.middleware


def _meta(engine: Engine) -> dict[int, Any]:
    with Session(engine) as session:
        return {job_id: meta for job_id, meta in session.execute(select(TaskJob.id, TaskJob.meta))}


def _linked_to(span: ReadableSpan, producer: ReadableSpan) -> bool:
    assert producer.context is not None
    return [link.context.span_id for link in span.links] == [producer.context.span_id] and all(
        link.context.trace_id == producer.context.trace_id for link in span.links)


@pytest.mark.parametrize("mode", ["lease", "transaction"])
def test_an_enqueue_and_its_attempt_are_a_linked_producer_and_consumer(
    engine: Engine, traced: Traced, mode: str
) -> None:
    seen: list[Any] = []

    @traced.registry.task
    def send_welcome(user_id: int) -> None:
        seen.append(trace.get_current_span().get_span_context())

    with traced.app.start_as_current_span("POST /signup") as request:
        with Session(engine) as session, session.begin():
            job = send_welcome.configure(queue="signup").enqueue(session, 42)
    stored = _meta(engine)[job.id]
    assert set(stored) == {META_KEY} and "traceparent" in stored[META_KEY] and job.meta == stored
    Worker(engine, jobs, traced.registry, queues=["signup"], mode=mode, listen=False, poll_interval=0.05).run(
        until_empty=True)

    [producer] = traced.spans(SpanKind.PRODUCER)
    [consumer] = traced.spans(SpanKind.CONSUMER)
    assert producer.name == "send signup" and consumer.name == "process signup"
    assert producer.parent is not None and producer.parent.span_id == request.get_span_context().span_id
    assert producer.context is not None and producer.context.trace_id == request.get_span_context().trace_id
    assert f"{producer.context.span_id:016x}" in stored[META_KEY]["traceparent"]  # the producer's context
    assert dict(producer.attributes or {}) == {
        "messaging.system": "sa_jobqueue", "messaging.operation.type": "send", "messaging.operation.name": "send",
        "messaging.destination.name": "signup", "sa_jobqueue.task": "send_welcome",
        "messaging.message.id": str(job.id),
    }
    assert _linked_to(consumer, producer) and consumer.parent is None  # linked, not a child
    assert dict(consumer.attributes or {}) == {
        "messaging.system": "sa_jobqueue", "messaging.operation.type": "process",
        "messaging.operation.name": "process", "messaging.destination.name": "signup",
        "messaging.message.id": str(job.id), "sa_jobqueue.task": "send_welcome", "sa_jobqueue.job.attempt": 1,
    }
    assert consumer.status.status_code is StatusCode.UNSET
    assert consumer.context is not None and seen == [consumer.context]  # the handler runs in its span


def test_each_attempt_is_a_span_linked_to_the_enqueue_and_failures_are_errors(
    engine: Engine, traced: Traced
) -> None:
    @traced.registry.task(retry=QUICK, max_attempts=4)
    def flaky(ctx: JobContext) -> None:
        if ctx.attempt < 3:
            raise ConnectionError(f"attempt {ctx.attempt} failed")

    @traced.registry.task(max_attempts=1)
    def doomed() -> None:
        raise ValueError("never works")

    with Session(engine) as session, session.begin():
        retried, dead = flaky.enqueue(session), doomed.enqueue(session)
    result = Worker(engine, jobs, traced.registry, listen=False, poll_interval=0.05).run(until_empty=True)
    assert result.dead == 1

    producers = {int(span.attributes["messaging.message.id"]): span  # type: ignore[arg-type,index]
                 for span in traced.spans(SpanKind.PRODUCER)}
    attempts = [span for span in traced.spans(SpanKind.CONSUMER)
                if span.attributes and span.attributes["messaging.message.id"] == str(retried.id)]
    assert [span.attributes["sa_jobqueue.job.attempt"] for span in attempts] == [1, 2, 3]  # type: ignore[index]
    assert all(_linked_to(span, producers[retried.id]) for span in attempts)
    assert len({span.context.span_id for span in attempts if span.context}) == 3  # new spans
    assert [span.status.status_code for span in attempts] == [StatusCode.ERROR, StatusCode.ERROR, StatusCode.UNSET]
    for number, span in enumerate(attempts[:2], start=1):
        [event] = span.events
        assert event.name == "exception" and event.attributes is not None
        assert event.attributes["exception.type"] == "ConnectionError"
        assert event.attributes["exception.message"] == f"attempt {number} failed"
    [final] = [span for span in traced.spans(SpanKind.CONSUMER) if span.attributes
               and span.attributes["messaging.message.id"] == str(dead.id)]
    assert final.status.status_code is StatusCode.ERROR and _linked_to(final, producers[dead.id])
    assert final.events[0].attributes is not None and final.events[0].attributes["exception.type"] == "ValueError"


def test_enqueue_many_is_one_producer_span_that_every_job_links_to(engine: Engine, traced: Traced) -> None:
    @traced.registry.task
    def index(n: int) -> None:
        pass

    many = COPY_THRESHOLD + 4  # through COPY
    with Session(engine) as session, session.begin():
        made = jobs.enqueue_many(session, [index.spec(n) for n in range(many)])
    Worker(engine, jobs, traced.registry, listen=False, poll_interval=0.05, batch_size=8).run(until_empty=True)
    [producer] = traced.spans(SpanKind.PRODUCER)
    assert producer.name == "send default" and producer.attributes is not None
    assert producer.attributes["messaging.batch.message_count"] == many
    assert "messaging.message.id" not in producer.attributes
    consumers = traced.spans(SpanKind.CONSUMER)
    assert sorted(int(s.attributes["messaging.message.id"]) for s in consumers if s.attributes) == sorted(
        j.id for j in made)
    assert all(_linked_to(span, producer) for span in consumers)


def test_a_rolled_back_enqueue_leaves_no_job_and_only_an_ended_span(engine: Engine, traced: Traced) -> None:
    with Session(engine) as session:
        jobs.enqueue(session, "noop", meta={"own": True})
        session.rollback()
    assert _meta(engine) == {}
    [producer] = traced.spans(SpanKind.PRODUCER)
    assert producer.end_time is not None and producer.status.status_code is StatusCode.UNSET


def test_instrumenting_again_keeps_one_span_per_enqueue_and_the_callers_meta(engine: Engine, traced: Traced) -> None:
    instrument(traced.registry, tracer_provider=traced.provider)
    assert len(enqueue_hooks()) == 1 and len(traced.registry.middleware) == 1
    with Session(engine) as session, session.begin():
        job = jobs.enqueue(session, "noop", meta={"own": True})
    assert len(traced.spans(SpanKind.PRODUCER)) == 1
    assert set(_meta(engine)[job.id]) == {"own", META_KEY}


def test_without_instrumentation_meta_stays_null_and_jobs_run(engine: Engine) -> None:
    registry = TaskRegistry(repository=jobs)
    ran: list[int] = []

    @registry.task
    def plain(n: int) -> None:
        ran.append(n)

    exporter, provider = InMemorySpanExporter(), TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    instrument(registry, tracer_provider=provider)
    uninstrument(registry)
    with provider.get_tracer("app").start_as_current_span("request"), Session(engine) as session, session.begin():
        job = plain.enqueue(session, 1)
    assert _meta(engine) == {job.id: None}
    Worker(engine, jobs, registry, listen=False, poll_interval=0.05).run(until_empty=True)
    assert ran == [1] and [span.name for span in exporter.get_finished_spans()] == ["request"]


def test_the_api_alone_writes_no_meta(engine: Engine) -> None:
    # The API's no-op provider makes invalid spans: nothing to carry, so nothing is written.
    registry = TaskRegistry(repository=jobs)
    instrument(registry, tracer_provider=trace.NoOpTracerProvider())
    try:
        with Session(engine) as session, session.begin():
            job = jobs.enqueue(session, "noop")
        assert _meta(engine) == {job.id: None}
    finally:
        uninstrument(registry)


@pytest.mark.anyio
@pytest.mark.parametrize("mode", ["lease", "transaction"])
async def test_the_asyncio_worker_traces_async_and_sync_handlers(
    async_engine: AsyncEngine, engine: Engine, traced: Traced, mode: str
) -> None:
    seen: dict[str, Any] = {}

    @traced.registry.task(retry=QUICK)
    async def fetch(ctx: JobContext, session: AsyncSession) -> None:
        seen[f"fetch {ctx.attempt}"] = trace.get_current_span().get_span_context()
        if ctx.attempt == 1:
            raise TimeoutError("upstream slow")

    @traced.registry.task
    def store(ctx: JobContext) -> None:
        seen["store"] = trace.get_current_span().get_span_context()

    repository = AsyncJobRepository(TaskJob)
    with traced.app.start_as_current_span("POST /fetch"):
        async with AsyncSession(async_engine) as session, session.begin():
            fetched = await fetch.enqueue_async(session)  # the context reaches run_sync's greenlet
            stored = await repository.enqueue(session, "store", {})
    assert all(META_KEY in (meta or {}) for meta in _meta(engine).values())
    await AsyncWorker(async_engine, repository, traced.registry, sync_bind=engine, mode=mode, listen=False,
                      poll_interval=0.05).run(until_empty=True)

    producers = {int(s.attributes["messaging.message.id"]): s  # type: ignore[arg-type,index]
                 for s in traced.spans(SpanKind.PRODUCER)}
    consumers = traced.spans(SpanKind.CONSUMER)
    by_name = {f"{s.attributes['sa_jobqueue.task']} {s.attributes['sa_jobqueue.job.attempt']}": s  # type: ignore[index]
               for s in consumers}
    assert sorted(by_name) == ["fetch 1", "fetch 2", "store 1"]
    assert _linked_to(by_name["fetch 1"], producers[fetched.id]) and _linked_to(by_name["fetch 2"],
                                                                                producers[fetched.id])
    assert _linked_to(by_name["store 1"], producers[stored.id])
    assert by_name["fetch 1"].status.status_code is StatusCode.ERROR
    assert by_name["fetch 1"].events[0].name == "exception"
    assert by_name["fetch 2"].status.status_code is StatusCode.UNSET
    assert seen == {"fetch 1": by_name["fetch 1"].context, "fetch 2": by_name["fetch 2"].context,
                    "store": by_name["store 1"].context}


PAGE = Path(__file__).resolve().parent.parent / "docs" / "opentelemetry.md"


def test_the_opentelemetry_page_runs(create_database: Callable[[], URL]) -> None:
    [block] = re.findall(r"^```python\n(.*?)^```", PAGE.read_text(encoding="utf-8"), re.S | re.M)
    engine = create_engine(create_database())
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            exec(compile(block, "docs/opentelemetry.md", "exec", dont_inherit=True), {"engine": engine})
    finally:
        engine.dispose()
    assert not enqueue_hooks()  # the page uninstruments
    keys, *spans = printed.getvalue().splitlines()
    assert keys == "['traceparent']"
    rows = [line.split(" ", 4) for line in spans]
    assert [row[:4] for row in rows] == [
        ["PRODUCER", "send", "mail", "UNSET"], ["INTERNAL", "POST", "/signup", "UNSET"],
        ["CONSUMER", "process", "mail", "ERROR"], ["CONSUMER", "process", "mail", "UNSET"],
    ]
    producer_id = rows[0][4].split(" ")[0]
    assert [row[4].split(" ", 1)[1] for row in rows[2:]] == [f"['{producer_id}']"] * 2
