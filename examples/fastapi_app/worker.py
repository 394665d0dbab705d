"""The worker, in a process of its own: python worker.py [--until-empty]."""

import os
import sys

from sqlalchemy import create_engine

from app.jobs import emails, tasks
from sa_jobqueue import Worker, psycopg_url

engine = create_engine(psycopg_url(os.environ["DATABASE_URL"]))
worker = Worker(engine, emails.sync, tasks, queues=["signup"], concurrency=4)
result = worker.run(until_empty="--until-empty" in sys.argv)  # else until SIGINT/SIGTERM
print(f"worker: completed {result.completed}, retried {result.retried}, dead {result.dead}", flush=True)
