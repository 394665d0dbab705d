"""The worker loop's decisions (sa_jobqueue/worker/pace.py) as a plain object:
no database, no threads, no clock; time is passed in."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from sa_jobqueue.worker.pace import AHEAD, CLAIMS_PER_JOB, SHORT_JOB, Pacer


def _fixed(value: float) -> Iterator[float]:
    while True:
        yield value


def pacer(**options: object) -> Pacer:
    base: dict[str, object] = {"capacity": 4, "concurrency": 4, "batch_size": None, "poll_interval": 1.0,
                               "claimers": 2, "jitter": lambda low, high: 1.0}
    base.update(options)
    return Pacer(**base)  # type: ignore[arg-type]


def test_a_busy_worker_claims_its_free_capacity_at_once() -> None:
    p = pacer()
    assert p.claims(0.0, held=0, claiming=0) == [4]
    assert p.claims(0.0, held=1, claiming=0) == [3]
    assert p.claims(0.0, held=4, claiming=0) == []


def test_with_a_batch_size_claims_go_out_in_whole_batches_up_to_the_claimers() -> None:
    p = pacer(capacity=30, batch_size=10)
    # The first claim goes alone: two at once would split the same rows between them.
    assert p.claims(0.0, held=0, claiming=0) == [10]
    p.claim_sent(10)
    p.claim_ended(10, 10)  # it came back full: a backlog, two claimers from now on
    assert p.claims(0.0, held=0, claiming=0) == [10, 10]
    for ask in (10, 10):
        p.claim_sent(ask)
    # 20 reserved, 10 free: no third claim while two are in flight.
    assert p.claims(0.0, held=0, claiming=2) == []
    p.claim_ended(10, 10)
    p.claim_ended(10, 10)
    # 20 held, a whole batch fits again.
    assert p.claims(0.0, held=20, claiming=0) == [10]
    # 25 held and the threads busy: 5 free is less than a batch, wait.
    assert p.claims(0.0, held=25, claiming=0) == []
    # A thread is idle (held < concurrency): top it up even with a short batch.
    assert pacer(capacity=30, concurrency=8, batch_size=10).claims(0.0, held=25, claiming=0) == []
    topped = pacer(capacity=30, concurrency=8, batch_size=10)
    topped.last_claim_full = True
    assert topped.claims(0.0, held=7, claiming=0) == [10, 10]


def test_after_a_short_claim_only_one_claim_is_in_flight() -> None:
    p = pacer(capacity=30, batch_size=10)
    p.claim_sent(10)
    p.claim_ended(10, 3)
    assert not p.last_claim_full
    assert p.claims(0.0, held=3, claiming=0) == [10]


def test_an_empty_claim_makes_the_worker_idle_until_its_next_probe() -> None:
    p = pacer()
    p.results(10.0, hits=0, misses=1, claiming=0, ran=0, listening=False)
    assert not p.found
    assert p.next_probe == pytest.approx(10.05)
    assert p.claims(10.0, held=0, claiming=0) == []
    assert p.claims(10.06, held=0, claiming=0) == [4]  # one probe once the wait is over
    # While idle, one probe at a time.
    assert pacer(capacity=30, batch_size=10, found=False).claims(0.0, held=0, claiming=0) == [10]


def test_a_miss_while_another_claim_is_in_flight_does_not_make_the_worker_idle() -> None:
    p = pacer()
    p.results(0.0, hits=0, misses=1, claiming=1, ran=0, listening=False)
    assert p.found


def test_idle_waits_back_off_from_50_ms_to_the_poll_interval_with_jitter() -> None:
    p = pacer(poll_interval=2.0)
    waits = []
    for _ in range(8):
        p.go_idle(0.0, listening=False)
        waits.append(p.idle_wait)
    assert waits[:4] == pytest.approx([0.05, 0.1, 0.2, 0.4])
    assert waits[-1] == pytest.approx(2.0)
    jittered = pacer(poll_interval=2.0, jitter=lambda low, high: low)
    jittered.go_idle(0.0, listening=False)
    assert jittered.idle_wait == pytest.approx(0.05 * 0.75)


def test_with_a_listener_the_idle_wait_is_about_the_poll_interval() -> None:
    p = pacer(poll_interval=2.0, jitter=lambda low, high: low)
    p.go_idle(0.0, listening=True)
    assert p.idle_wait == pytest.approx(1.6)


def test_a_hit_a_notification_or_a_finished_job_ends_the_idle_wait() -> None:
    for event in ("hit", "notified", "ran"):
        p = pacer()
        p.go_idle(0.0, listening=False)
        if event == "hit":
            p.results(0.0, hits=1, misses=0, claiming=0, ran=0, listening=False)
        elif event == "notified":
            p.notified()
        else:
            p.results(0.0, hits=0, misses=0, claiming=0, ran=1, listening=False)
        assert p.found, event
        assert p.claims(0.0, held=0, claiming=0) == [4], event


def test_a_hit_resets_the_backoff() -> None:
    p = pacer()
    for _ in range(5):
        p.go_idle(0.0, listening=False)
    p.results(0.0, hits=1, misses=0, claiming=0, ran=0, listening=False)
    p.go_idle(0.0, listening=False)
    assert p.idle_wait == pytest.approx(0.05)


def test_a_failed_claim_backs_off_a_poll_interval() -> None:
    p = pacer()
    p.back_off(5.0)
    assert p.claims(5.5, held=0, claiming=0) == []
    assert p.claims(6.0, held=0, claiming=0) == [4]


def test_transaction_mode_probes_every_free_slot_when_busy_and_one_when_idle() -> None:
    p = pacer(claimers=0)
    assert p.probes(0.0, free=3) == 3
    p.results(0.0, hits=0, misses=2, claiming=0, ran=0, listening=False)
    assert p.probes(0.0, free=3) == 0
    assert p.probes(0.06, free=3) == 1
    assert p.probes(0.07, free=3) == 0  # the next probe one idle wait later
    assert p.probes(0.2, free=0) == 0


def test_drained_only_when_idle_and_nothing_is_in_flight() -> None:
    p = pacer()
    assert not p.drained(busy=False)  # found work last time
    p.go_idle(0.0, listening=False)
    assert not p.drained(busy=True)
    assert p.drained(busy=False)


def test_the_sleep_ends_at_the_next_probe_or_deadline_and_never_passes_the_poll_interval() -> None:
    p = pacer(poll_interval=1.0)
    assert p.sleep(0.0, busy=False, deadline=100.0) == 1.0
    assert p.sleep(0.0, busy=False, deadline=0.25) == 0.25
    p.go_idle(0.0, listening=False)
    assert p.sleep(0.0, busy=False, deadline=100.0) == pytest.approx(0.05)
    assert p.sleep(0.0, busy=True, deadline=100.0) == 1.0
    assert p.sleep(1.0, busy=False, deadline=0.5) == 0.0


def test_a_notification_while_a_claim_is_in_flight_is_not_lost() -> None:
    p = pacer()
    assert p.claims(0.0, held=0, claiming=0) == [4]  # a claim goes out...
    p.notified()  # ...a job is enqueued while it travels...
    p.results(0.0, hits=0, misses=1, claiming=0, ran=0, listening=True)  # ...and it comes back empty
    assert p.found
    assert p.claims(0.0, held=0, claiming=0) == [4]  # claim again at once
    p.results(0.0, hits=0, misses=1, claiming=0, ran=0, listening=True)
    assert not p.found  # a claim sent after the notification found nothing: idle now


def test_in_transaction_mode_a_notification_during_a_probe_is_not_lost_either() -> None:
    p = pacer(claimers=0)
    assert p.probes(0.0, free=1) == 1
    p.notified()
    p.results(0.0, hits=0, misses=1, claiming=0, ran=0, listening=True)
    assert p.probes(0.0, free=1) == 1


def test_a_job_that_finishes_while_a_claim_is_in_flight_is_looked_for_again() -> None:
    p = pacer(capacity=30, batch_size=10)
    p.results(0.0, hits=0, misses=0, claiming=1, ran=1, listening=False)  # a job finished; a claim travels
    p.results(0.0, hits=0, misses=1, claiming=0, ran=0, listening=False)  # the claim, sent before, comes back empty
    assert p.found and not p.drained(busy=False)
    assert p.claims(0.0, held=0, claiming=0)  # look once more: a retry may be due now


def test_in_transaction_mode_a_batch_that_ends_while_others_probe_is_looked_for_again() -> None:
    p = pacer(claimers=0)
    p.results(0.0, hits=1, misses=0, claiming=0, ran=1, listening=False, probing=1)
    p.results(0.0, hits=0, misses=1, claiming=0, ran=0, listening=False)
    assert p.found and p.probes(0.0, free=1) == 1


def test_without_a_batch_size_short_jobs_are_claimed_ahead_and_long_ones_never() -> None:
    p = pacer()
    assert p.claims(0.0, held=0, claiming=0) == [4]  # nothing ran yet: the free threads only
    p.claim_sent(4)
    p.claim_ended(4, 4)
    for _ in range(5):
        p.job_ran(0.002)
    assert p.batch() == AHEAD and p.held_at_most() == 3 * AHEAD
    assert p.claims(0.0, held=4, claiming=0) == [AHEAD, AHEAD]  # ahead of the busy threads, two claimers
    assert p.claims(0.0, held=3 * AHEAD - AHEAD + 1, claiming=0) == []  # less than a batch free: wait
    for _ in range(30):
        p.job_ran(2.0)  # the jobs got long
    assert p.mean_run is not None and p.mean_run > SHORT_JOB
    assert p.batch() is None and p.claims(0.0, held=4, claiming=0) == []
    assert p.claims(0.0, held=3, claiming=0) == [1]  # one thread free: one job


def test_jobs_slowed_as_much_as_the_claims_are_still_claimed_ahead() -> None:
    # A loaded machine (more worker processes than cores): 33 ms per job and
    # 17 ms per claim, as measured with 8 processes on 2 cores. Claiming for the
    # free threads only made a claim per job or two, which loaded the machine more.
    p = pacer()
    for _ in range(30):
        p.job_ran(0.033)
        p.claim_ended(0, 0, 0.017)
    assert p.mean_run is not None and p.mean_run > SHORT_JOB
    assert p.batch() == AHEAD
    assert p.claims(0.0, held=4, claiming=0) == [AHEAD, AHEAD]


def test_jobs_much_longer_than_a_claim_are_not_claimed_ahead() -> None:
    p = pacer()
    for _ in range(30):
        p.job_ran(0.033)
        p.claim_ended(0, 0, 0.033 / CLAIMS_PER_JOB / 2)
        p.claim_ended(0, 0, None)  # a failed claim is not timed
    assert p.batch() is None and p.claims(0.0, held=3, claiming=0) == [1]


def test_the_claim_ahead_follows_a_given_batch_size_or_the_concurrency() -> None:
    given = pacer(capacity=30, batch_size=10)
    given.job_ran(0.001)
    assert given.batch() == 10 and given.held_at_most() == 30
    wide = pacer(capacity=64, concurrency=64)
    wide.job_ran(0.001)
    assert wide.batch() == 64 and wide.held_at_most() == 3 * 64
    transaction = pacer(claimers=0)  # transaction mode claims in its batches, never ahead
    transaction.job_ran(0.001)
    assert transaction.batch() is None and transaction.held_at_most() == 4
