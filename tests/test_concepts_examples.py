"""The code of docs/concepts.md's "Deadlines" and "Cancelling a running job"
sections runs against the library as shown (a worker built, tasks registered
with the options the page names)."""

from __future__ import annotations

import re
from datetime import timedelta
from pathlib import Path
from typing import Any

from jobapp import jobs
from sqlalchemy import Engine

from sa_jobqueue import TaskRegistry, Worker

PAGE = Path(__file__).resolve().parent.parent / "docs" / "concepts.md"


def _blocks(section: str) -> list[str]:
    text = PAGE.read_text(encoding="utf-8")
    body = text.split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^```python\n(.*?)^```", body, re.S | re.M)


def test_the_deadlines_example(engine: Engine) -> None:
    (block,) = _blocks("Deadlines")
    namespace: dict[str, Any] = {"tasks": TaskRegistry(), "engine": engine, "exports": jobs, "timedelta": timedelta,
                                 "Worker": Worker}
    exec(block, namespace)
    task = namespace["tasks"].get("export")
    assert task is not None and task.timeout == timedelta(minutes=5)


def test_the_cooperative_cancel_example(engine: Engine) -> None:
    (block,) = _blocks("Cancelling a running job")
    processed: list[int] = []

    class Job:
        payload = {"file": "f"}
        cancel_requested_at: object = None

    namespace: dict[str, Any] = {"tasks": TaskRegistry(), "chunks": lambda f: iter(range(3)),
                                 "process": lambda chunk, session: processed.append(chunk)}
    exec(block, namespace)
    crunch = namespace["tasks"].get("crunch")
    assert crunch is not None and crunch.takes_session
    job = Job()
    crunch.handler(job, None)
    assert processed == [0, 1, 2]
    processed.clear()
    job.cancel_requested_at = object()
    crunch.handler(job, None)
    assert processed == []  # a cooperative handler stops once the cancel is asked for
