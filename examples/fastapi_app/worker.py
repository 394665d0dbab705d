"""The worker, in a process of its own: python worker.py [--until-empty]."""

import asyncio
import sys

from app.db import engine
from app.jobs import emails, tasks

from sa_jobqueue.aio import AsyncWorker


async def main() -> None:
    worker = AsyncWorker(engine, emails, tasks, queues=["signup"], concurrency=50)
    result = await worker.run(until_empty="--until-empty" in sys.argv)  # else until SIGINT/SIGTERM
    print(f"worker: completed {result.completed}, retried {result.retried}, dead {result.dead}", flush=True)
    await engine.dispose()


asyncio.run(main())
