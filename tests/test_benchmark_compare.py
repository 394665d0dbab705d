"""benchmarks/compare.py names every figure benchmarks/run.py reports (no database)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest


def _compare() -> ModuleType:
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "compare.py"
    spec = importlib.util.spec_from_file_location("sajq_benchmarks_compare", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_labels_of_the_thread_and_the_asyncio_drains() -> None:
    label = _compare().label
    assert label("drain-a-4") == "drain a, C=4"
    assert label("drain-async-b-asyncpg-4") == "drain async b asyncpg, C=4"
    assert label("enqueue") == "enqueue"


def test_a_report_of_asyncio_drains() -> None:
    compare = _compare()
    rounds = [({"drain-async-a-psycopg-4": [100.0]}, {"drain-async-a-psycopg-4": [95.0]})]
    text = compare.report("before", "after", rounds, 0.10, [])
    assert "| drain async a psycopg, C=4 | 100.0 | 95.0 | 0.95 | 0.95 to 0.95 | ok |" in text


def test_an_odd_number_of_rounds_is_refused_before_anything_runs() -> None:
    """Each revision must go first in half of the rounds (see the module's docstring)."""
    compare = _compare()
    for rounds in ("3", "1", "0"):
        with pytest.raises(SystemExit) as info:
            compare.main(["main", "HEAD", "--rounds", rounds])
        assert info.value.code == 2


def test_times_and_sizes_are_flagged_when_they_grow() -> None:
    """Latency, RSS and the outbox's µs are costs: more is worse, less is an improvement."""
    compare = _compare()
    for name in ("latency-p50-a-4", "rss-total", "outbox-cpu-us", "outbox-wall-us", "outbox-python-us"):
        grew = compare.report("before", "after", [({name: [100.0]}, {name: [130.0]})], 0.10, [])
        fell = compare.report("before", "after", [({name: [100.0]}, {name: [70.0]})], 0.10, [])
        assert grew.splitlines()[-1].endswith("| HIGHER |"), grew
        assert fell.splitlines()[-1].endswith("| ok |"), fell


def test_the_raw_reference_of_the_outbox_is_a_control() -> None:
    """The raw INSERT beside the outbox runs the same code for both revisions: its change is the machine's drift."""
    text = _compare().report("before", "after", [({"outbox-raw-cpu-us": [100.0]}, {"outbox-raw-cpu-us": [130.0]})],
                             0.10, [])
    assert text.splitlines()[-1].endswith("| reference loop (drift) |"), text


@pytest.mark.parametrize("name", [
    "drain-grouped-session-4", "enqueue-async-insert-asyncpg", "drain-textbook-session-4", "drain-batch-session-4",
    "bulk-orm",
])
def test_the_loops_done_naively_on_the_products_stack_are_controls(name: str) -> None:
    """The loops on SQLAlchemy's Session, ORM and AsyncSession run the same code for both revisions."""
    text = _compare().report("before", "after", [({name: [100.0]}, {name: [130.0]})], 0.10, [])
    assert text.splitlines()[-1].endswith("| reference loop (drift) |"), text
