"""Slots, the worker's threads (sa_jobqueue/worker/slots.py), as plain objects: no database, no clock."""

from __future__ import annotations

import threading

from sa_jobqueue.worker.slots import Slots


def test_calls_submitted_at_once_each_count_in_flight_and_start_in_their_order() -> None:
    """submit_each: one call per argument, each counted in flight from the moment it returns,
    started in the arguments' order; those no thread started come back in that order."""
    gate, started, ran = threading.Event(), threading.Event(), []

    def call(arg: str) -> bool:
        ran.append(arg)
        started.set()
        return gate.wait(30)

    slots = Slots(1, name="t", on_done=lambda _: None)
    slots.submit_each(call, ["one", "two", "three"])
    assert len(slots) == 3
    assert started.wait(30)
    assert slots.take_unstarted() == [("two",), ("three",)]
    assert len(slots) == 1
    slots.submit_each(call, ["four", "five"])
    slots.submit_each(call, [])
    assert len(slots) == 3
    gate.set()
    assert slots.wait_idle(30)
    assert ran == ["one", "four", "five"]
    assert slots.take_results() == (3, 0, 0)
    slots.close()
