"""The stall judgment both watchdogs share (sa_jobqueue/stalls.py), on plain
records: no database, no clock."""

from __future__ import annotations

from dataclasses import dataclass

from sa_jobqueue.stalls import is_stalled, suspects


@dataclass
class Record:
    since: float | None = None
    statement: int = 0
    idle_checks: int = 0


def test_suspects_are_the_statements_in_flight_for_after_seconds() -> None:
    idle, young, old, exact = Record(), Record(since=95.0, statement=3), Record(since=80.0, statement=7), Record(
        since=90.0, statement=1)
    assert suspects([idle, young, old, exact], now=100.0, after=10.0) == [(old, 7, 80.0), (exact, 1, 90.0)]


def test_a_backend_idle_on_the_server_is_stalled_at_the_second_check_of_the_same_statement() -> None:
    record = Record(since=0.0, statement=4)
    assert not is_stalled(record, 4, state="idle in transaction", age=12.0, after=10.0)
    assert record.idle_checks == 1
    assert is_stalled(record, 4, state="idle", age=13.0, after=10.0)


def test_a_running_unknown_or_recently_changed_backend_is_left_alone_and_resets_the_count() -> None:
    for state, age in (("active", 60.0), ("unknown", 60.0), ("idle", 3.0)):
        record = Record(since=0.0, statement=1, idle_checks=1)
        assert not is_stalled(record, 1, state=state, age=age, after=10.0)
        assert record.idle_checks == 0


def test_a_statement_that_ended_or_was_followed_by_another_is_never_stalled() -> None:
    ended = Record(since=None, statement=2, idle_checks=1)
    followed = Record(since=5.0, statement=3, idle_checks=1)
    assert not is_stalled(ended, 2, state="idle", age=60.0, after=10.0)
    assert not is_stalled(followed, 2, state="idle", age=60.0, after=10.0)
    assert ended.idle_checks == followed.idle_checks == 1  # nothing counted for another statement
