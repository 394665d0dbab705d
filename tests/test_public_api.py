"""The public face: what ``sa_jobqueue`` exports, and that importing does no I/O."""

from __future__ import annotations

import subprocess
import sys
import typing

import sa_jobqueue
from sa_jobqueue.repository import LeaseReport as RepositoryLeaseReport

# The pinned public API; tests/test_packaging.py checks the installed wheel against it too.
PUBLIC_API = [
    "STATUSES", "InvalidArgumentError", "JobLostError", "JobMixin", "JobQueueError",
    "JobRepository", "JobSpec", "JobTableError", "LeaseReport", "QueueStats", "ReapResult", "RetryJob",
    "RetryPolicy", "Task", "TaskRegistry", "Worker", "WorkerResult", "WorkerStuckError", "job_table_args",
    "psycopg_url", "Periodic", "PeriodicScheduler", "create_periodic_table", "ConfiguredTask", "JobContext",
    "HandlerCall", "JobFailedError", "JobNotFoundError", "ResultNotReadyError", "ResultTimeoutError", "read_result",
    "wait_for_result", "Dedupe", "EnqueueOutcome", "create_control_tables", "pause_queue", "paused_queues",
    "resume_queue", "Progress", "progress_of", "report_progress", "WorkerPresence", "list_workers",
]


def test_public_api_is_pinned() -> None:
    assert sorted(sa_jobqueue.__all__) == sorted(PUBLIC_API)
    for name in sa_jobqueue.__all__:
        assert getattr(sa_jobqueue, name) is not None


def test_lease_report_is_exported_as_extend_leases_return_type() -> None:
    hints = typing.get_type_hints(sa_jobqueue.JobRepository.extend_leases)
    assert hints["return"] is sa_jobqueue.LeaseReport is RepositoryLeaseReport  # the older path stays


def test_error_tree() -> None:
    assert issubclass(sa_jobqueue.InvalidArgumentError, (sa_jobqueue.JobQueueError, ValueError))
    assert issubclass(sa_jobqueue.JobTableError, (sa_jobqueue.JobQueueError, TypeError))
    assert issubclass(sa_jobqueue.JobLostError, sa_jobqueue.JobQueueError)


def test_import_opens_no_connection_and_reads_no_environment() -> None:
    # Reads of the environment are refused when they come from sa_jobqueue's own modules.
    code = (
        "import os, socket, sys\n"
        "def refuse(*a, **k): raise AssertionError('I/O at import')\n"
        "socket.socket.connect = refuse\n"
        "def check():\n"
        "    name = sys._getframe(2).f_globals.get('__name__', '')\n"
        "    if name.startswith('sa_jobqueue'): raise AssertionError('environment read by ' + name)\n"
        "class Env(type(os.environ)):\n"
        "    def __getitem__(self, k): check(); return super().__getitem__(k)\n"
        "    def get(self, k, d=None): check(); return super().get(k, d)\n"
        "os.environ.__class__ = Env\n"
        "import sa_jobqueue, sa_jobqueue.default, sa_jobqueue.testing, sa_jobqueue.worker, sa_jobqueue.aio\n"
        "print('ok')\n"
    )
    _prints_ok(code)


def test_psycopg_url() -> None:
    assert sa_jobqueue.psycopg_url("postgresql://u@h:5432/d").drivername == "postgresql+psycopg"
    assert sa_jobqueue.psycopg_url("postgres://u@h/d").drivername == "postgresql+psycopg"
    assert sa_jobqueue.psycopg_url("postgresql+psycopg2://u@h/d").drivername == "postgresql+psycopg2"


def test_the_sync_api_never_imports_sqlalchemys_asyncio_support() -> None:
    """``import sa_jobqueue`` works without greenlet (the ``asyncio`` extra):
    only ``sa_jobqueue.aio`` imports SQLAlchemy's asyncio extension."""
    code = (
        "import sys\n"
        "import sa_jobqueue, sa_jobqueue.default, sa_jobqueue.testing, sa_jobqueue.cli, sa_jobqueue.worker\n"
        "assert 'sqlalchemy.ext.asyncio' not in sys.modules, 'imported by the sync API'\n"
        "assert 'greenlet' not in sys.modules, 'imported by the sync API'\n"
        "import sa_jobqueue.aio\n"
        "assert 'sqlalchemy.ext.asyncio' in sys.modules\n"
        "print('ok')\n"
    )
    _prints_ok(code)


def _prints_ok(code: str) -> None:
    """Run ``code`` in a fresh interpreter: it must exit 0 having printed ``ok``."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
