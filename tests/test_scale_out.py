"""Worker processes on three hosts of the test's own, through PgBouncer in
transaction mode, to one PostgreSQL: nothing lost, nothing twice.

The hosts are network namespaces linked to this machine by veth pairs
(benchmarks/hosts.py); their only way to the database is a PgBouncer of the
test's own, listening on the links. This is a small case of
``benchmarks/scale.py``, which measures jobs/s and connections for 1 to 8
processes. It needs root, ``ip`` and ``pgbouncer``, and skips, saying which
is missing, without them.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
from sqlalchemy.engine import URL

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def _load(name: str) -> ModuleType:
    """benchmarks/NAME.py, as the module ``name`` (the name scale.py imports hosts.py by)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before running it: its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


hosts = _load("hosts")

pytestmark = pytest.mark.slow


@pytest.mark.skipif(hosts.missing() is not None, reason=f"scale-out hosts: {hosts.missing()}")
def test_workers_on_three_hosts_through_pgbouncer_complete_each_job_once(server_url: URL) -> None:
    scale = _load("scale")  # it puts benchmarks/ on sys.path for its own imports
    databases = scale.Databases(server_url)
    jobs, processes = 900, 3
    try:
        with scale.deployment(server_url, pool_size=4) as (machines, bouncer), databases.fresh() as url:
            at, admin = scale.places(machines, bouncer, url)
            out = scale.drain(scale.libpq(url), str(url.database), processes, 2, jobs, at, True, admin)
    finally:
        databases.close()
    assert (out["lost"], out["strays"], out["left"]) == (0, 0, 0)  # each job's row committed, none left behind
    assert out["twice"] == 0 and out["failed"] == 0  # no handler ran twice, no attempt failed
    # The workers ran on the three hosts, and reached the database through PgBouncer only.
    assert out["addresses"] == sorted(m.address for m in machines)
    assert out["server"] <= 4  # PgBouncer's pool: the sampler's own connection is not counted
