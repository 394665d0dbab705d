"""OpenTelemetry tracing: a span per enqueue and a span per attempt, linked (the ``opentelemetry`` extra).

::

    from sa_jobqueue.contrib.opentelemetry import instrument

    tasks = TaskRegistry(repository=jobs)
    instrument(tasks)                    # the global tracer provider, or tracer_provider=...

* **At enqueue** (every ``enqueue``/``enqueue_many`` of the process, through an
  enqueue hook, :mod:`sa_jobqueue.enqueue_hooks`): a ``PRODUCER`` span
  ``send <queue>``, a child of the enqueuing code's current span, around the
  INSERT (or COPY). Its context is injected with the global propagator
  (W3C ``traceparent``/``tracestate`` unless configured otherwise) into the
  job's ``meta["otel"]``, written by the same statement, so it commits or
  vanishes with the application's transaction. A rolled-back enqueue leaves
  no job, only an ended producer span that nothing links to.
* **Around every attempt** (a middleware, :mod:`sa_jobqueue.middleware`): a
  ``CONSUMER`` span ``process <queue>`` with a *link* to the producer span
  (not a parent: OpenTelemetry's messaging conventions link the processing of
  a message to its creation, since it may run much later and more than once).
  Its parent is the worker's current context (none, usually: a new trace).
  A handler's exception is recorded on it as an event, with status ERROR.
  A retry is a new span, linked to the same producer span; all attempts of
  a job share that link and carry their number (``sa_jobqueue.job.attempt``).

Attributes follow the messaging semantic conventions: ``messaging.system``
is ``sa_jobqueue`` (the conventions name the messaging *product*; PostgreSQL
is its storage, which database instrumentation reports as ``db.system``),
``messaging.destination.name`` the queue, ``messaging.operation.type`` and
``messaging.operation.name`` ``send``/``process`` (``publish`` is the
deprecated name of ``send``), ``messaging.message.id`` the job id (on the
producer span when the call wrote one job), ``messaging.batch.message_count``
for ``enqueue_many``; and ``sa_jobqueue.task``, ``sa_jobqueue.job.attempt``.

Nothing of OpenTelemetry is imported, and no environment variable read,
until :func:`instrument` or :class:`Tracing` is called.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from ..enqueue_hooks import Enqueueing, add_enqueue_hook, enqueue_hooks, remove_enqueue_hook
from ..middleware import HandlerCall

if TYPE_CHECKING:
    from opentelemetry.trace import TracerProvider

__all__ = ["META_KEY", "SYSTEM", "Tracing", "instrument", "uninstrument"]

#: The key of a job's ``meta`` that holds the enqueue's trace context (the propagator's carrier).
META_KEY = "otel"
#: The ``messaging.system`` of every span.
SYSTEM = "sa_jobqueue"
_TRACER_NAME = "sa_jobqueue"


class Tracing:
    """The spans of one tracer provider: :meth:`enqueue_hook` (producer) and :meth:`middleware` (consumer).

    :func:`instrument` registers both; give them yourself for more control
    (``TaskRegistry(middleware=[tracing.middleware])``, ``add_enqueue_hook(tracing.enqueue_hook)``).
    """

    def __init__(self, tracer_provider: TracerProvider | None = None) -> None:
        from opentelemetry import propagate, trace

        self._trace = trace
        self._propagate = propagate
        self.tracer = trace.get_tracer(_TRACER_NAME, tracer_provider=tracer_provider)

    @contextmanager
    def enqueue_hook(self, enqueueing: Enqueueing) -> Iterator[None]:
        """The producer span around one enqueue's writing; its context goes into the jobs' ``meta``."""
        queues = sorted(set(enqueueing.queues))
        count = len(enqueueing.queues)
        attributes: dict[str, Any] = {
            "messaging.system": SYSTEM, "messaging.operation.type": "send", "messaging.operation.name": "send",
        }
        if len(queues) == 1:  # else no single destination: the conventions leave it out of the name too
            attributes["messaging.destination.name"] = queues[0]
        if count > 1:
            attributes["messaging.batch.message_count"] = count
        tasks = set(enqueueing.tasks)
        if len(tasks) == 1:
            attributes["sa_jobqueue.task"] = enqueueing.tasks[0]
        name = f"send {queues[0]}" if len(queues) == 1 else "send"
        with self.tracer.start_as_current_span(name, kind=self._trace.SpanKind.PRODUCER,
                                               attributes=attributes) as span:
            carrier: dict[str, str] = {}
            self._propagate.inject(carrier)
            if carrier:  # nothing to carry without a valid span (the API's no-op provider): meta stays as it was
                enqueueing.meta[META_KEY] = carrier
            yield
            if len(enqueueing.jobs) == 1:
                span.set_attribute("messaging.message.id", str(enqueueing.jobs[0].id))

    def middleware(self, call: HandlerCall) -> Any:
        """The consumer span around one attempt (sync handlers and ``async def`` ones alike)."""
        return self._process(call)

    @contextmanager
    def _process(self, call: HandlerCall) -> Iterator[None]:
        # A sync context manager serves both kinds of handler: starting and ending a span never awaits,
        # and around an async def handler it is entered in the handler's own task (its context variables).
        context = call.context
        links = []
        enqueued = self.enqueue_context(context.job)
        if enqueued is not None:
            links.append(self._trace.Link(enqueued))
        attributes: dict[str, Any] = {
            "messaging.system": SYSTEM, "messaging.operation.type": "process", "messaging.operation.name": "process",
            "messaging.destination.name": context.queue, "messaging.message.id": str(context.id),
            "sa_jobqueue.task": call.task, "sa_jobqueue.job.attempt": context.attempt,
        }
        with self.tracer.start_as_current_span(f"process {context.queue}", kind=self._trace.SpanKind.CONSUMER,
                                               links=links, attributes=attributes):
            yield

    def enqueue_context(self, job: Any) -> Any:
        """The span context of ``job``'s enqueue, read from its meta; None when it has none."""
        meta = getattr(job, "meta", None)
        carrier = meta.get(META_KEY) if isinstance(meta, dict) else None
        if not isinstance(carrier, dict):
            return None
        span_context = self._trace.get_current_span(self._propagate.extract(carrier)).get_span_context()
        return span_context if span_context.is_valid else None


def instrument(registry: Any = None, *, tracer_provider: TracerProvider | None = None) -> Tracing:
    """Trace every enqueue of the process and, with ``registry`` (a
    :class:`~sa_jobqueue.TaskRegistry`), every attempt of its tasks; return
    the :class:`Tracing`. Called again, it replaces the enqueue hook (one
    producer span per enqueue) and the registry's tracing middleware."""
    tracing = Tracing(tracer_provider)
    uninstrument(registry)
    add_enqueue_hook(tracing.enqueue_hook)
    if registry is not None:
        registry.use(tracing.middleware)
    return tracing


def uninstrument(registry: Any = None) -> None:
    """Stop tracing enqueues (the hooks :func:`instrument` registered) and,
    with ``registry``, remove its tracing middleware."""
    for hook in enqueue_hooks():
        if isinstance(getattr(hook, "__self__", None), Tracing):
            remove_enqueue_hook(hook)
    if registry is not None:
        registry.middleware[:] = [m for m in registry.middleware if not isinstance(getattr(m, "__self__", None),
                                                                                      Tracing)]
