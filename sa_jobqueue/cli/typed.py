"""``enqueue --tasks MODULE:ATTR --arg …``: a typed task's arguments from the command line.

``--arg name=text`` gives the text as a string; ``--arg name:=json`` gives
a JSON value (a number, a list, ``null`` …), as HTTPie spells the two.
The arguments are bound against the handler's signature by the task
itself (:meth:`~sa_jobqueue.Task.spec`): a bad one is one line on stderr,
and nothing is written.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidArgumentError
from ..registry import TaskRegistry
from .errors import CliUsageError
from .state import import_object

__all__ = ["TypedJob", "parse_arg", "typed_job"]


@dataclass(frozen=True)
class TypedJob:
    """What the registry's task makes of the command line: the payload and the job's defaults."""

    payload: Any
    queue: str
    priority: int
    repository: Any  # the task's job table, or None


def parse_arg(text: str) -> tuple[str, Any]:
    """One ``--arg``: ``name=text`` (a string) or ``name:=json`` (a JSON value)."""
    name, sep, raw = text.partition("=")
    if not sep:
        raise CliUsageError(f"--arg {text!r}: write NAME=TEXT or NAME:=JSON")
    if name.endswith(":"):
        name = name[:-1]
        try:
            value: Any = json.loads(raw)
        except ValueError as exc:
            raise CliUsageError(f"--arg {name}: not valid JSON: {exc}") from None
    else:
        value = raw
    if not name.isidentifier():
        raise CliUsageError(f"--arg {text!r}: {name!r} is not a parameter name")
    return name, value


def typed_job(
    tasks_path: str, name: str, args: tuple[str, ...], payload: Any, *, queue: str | None, priority: int | None
) -> TypedJob:
    """Check TASK's arguments (``--arg``, or a ``--payload`` object) against the handler of ``--tasks``."""
    registry = import_object(tasks_path, "--tasks")
    if not isinstance(registry, TaskRegistry):
        raise CliUsageError(f"--tasks: {tasks_path} is not a TaskRegistry")
    task = registry.get(name)
    if task is None:
        known = ", ".join(sorted(t.name for t in registry)) or "none"
        raise CliUsageError(f"TASK: {name!r} is not a task of {tasks_path} (its tasks: {known})")
    if task.parameters.form == "job":
        if args:
            raise CliUsageError(f"--arg: task {name!r} takes the job, not arguments: give its --payload")
        return TypedJob(payload, task.queue if queue is None else queue,
                        task.priority if priority is None else priority, task.repository)
    kwargs = dict(parse_arg(a) for a in args)
    if payload is not None:
        if not isinstance(payload, dict):
            raise CliUsageError(f"--payload: task {name!r} takes arguments: give a JSON object of them by name")
        kwargs = payload
    try:
        spec = task.configure(queue=queue, priority=priority).spec(**kwargs)
    except InvalidArgumentError as exc:
        option = "--arg " if exc.parameter not in ("queue", "priority") else "--"
        raise CliUsageError(f"{option}{exc}") from None
    return TypedJob(spec.payload, spec.queue, spec.priority, task.repository)
