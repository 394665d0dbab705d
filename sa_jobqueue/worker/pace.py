"""Pacer: the worker loop's decisions, as a plain object.

Claim now? How many? Sleep how long? Done? The driver tells the pacer what
happened (a claim came back with so many jobs, jobs finished, a
notification arrived) and asks it what to do next, passing the time in
(monotonic seconds) and the counts it sees. The pacer does no I/O, starts
no thread and reads no clock, so a unit test drives it step by step.

The rules, shared by both modes:

* A claim or probe that finds work keeps the worker busy: claim again as
  capacity frees up. A short batch is not an empty queue (READ COMMITTED
  drops rows another claimer took), only an empty one is.
* An empty claim makes the worker idle: it waits ``idle_wait`` before the
  next probe, growing from 50 ms to ``poll_interval`` with ±25% jitter
  while no listener is connected, so that many idle workers do not poll in
  step; with a listener, enqueues wake it and the wait is about
  ``poll_interval`` (it only catches scheduled jobs and retries).
* A notification, or a job that finished (it may have made work runnable:
  a retry due now, a job its handler enqueued), ends the idle wait.
* Lease mode without a ``batch_size`` claims as many jobs as it has free
  threads, while its jobs are long; once they are short (their running mean
  at most :data:`SHORT_JOB`), it claims ahead, :data:`AHEAD` jobs at a time
  (more with more threads), as with that ``batch_size``: each claim is a
  round trip and a commit, which a job of a few milliseconds must not pay
  alone. A job is short too while it runs no longer than
  :data:`CLAIMS_PER_JOB` claims take (their running mean): on a loaded
  machine every job and every claim takes longer, and a claim per job would
  add the most work where there is least room for it. Long jobs are never
  claimed ahead, so they do not wait behind each other in one worker while
  another has idle threads.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

Jitter = Callable[[float, float], float]

#: A job this short or shorter (seconds, running mean) is claimed ahead in lease mode.
SHORT_JOB = 0.01
#: A job that runs no longer than this many claims take (running means) is short too:
#: claiming it alone would spend a quarter of its time or more on claims.
CLAIMS_PER_JOB = 4
#: The claim-ahead batch of short jobs, when no ``batch_size`` is given (or the concurrency, if larger).
AHEAD = 32
# The weight of the latest job in the running mean of job durations.
_MEAN_WEIGHT = 0.2


@dataclass
class Pacer:
    """What the loop does next; see the module docstring for the rules."""

    capacity: int
    concurrency: int
    batch_size: int | None
    poll_interval: float
    claimers: int = 2  # claims in flight at once (lease mode; 0 in transaction mode)
    jitter: Jitter = random.uniform
    found: bool = True  # did the latest claim find work?
    idle_wait: float = 0.0
    next_probe: float = 0.0  # while idle: when to probe again (unless woken)
    # False at the start: the first claim goes alone, and a second joins it only
    # once a claim came back full. Two claims sent at once into the same rows
    # split them between them (SKIP LOCKED), which for grouped commits makes
    # smaller groups than one claim would; a backlog costs one round trip more.
    last_claim_full: bool = False
    reserved: int = 0  # jobs asked for by claims in flight (lease mode)
    # A notification no claim has been sent since: an empty result of a claim
    # sent before it must not make the worker idle, or the job it announced
    # would wait a whole poll interval.
    woken: bool = False
    mean_run: float | None = None  # running mean of the jobs' durations (lease mode), None before the first
    mean_claim: float | None = None  # running mean of the claims' durations (lease mode), None before the first
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    # -- what happened -------------------------------------------------------

    def results(
        self, now: float, *, hits: int, misses: int, claiming: int, ran: int, listening: bool, probing: int = 0
    ) -> None:
        """Claims (or probes) that came back with work (``hits``) or empty
        (``misses``) since the last call, ``claiming`` claims still in flight
        (``probing``: transaction-mode probes), and ``ran`` calls that ran jobs."""
        if ran and (claiming or probing):
            # A claim sent before these jobs finished cannot have seen what they
            # made runnable (a retry due now, a job they enqueued): its empty
            # result must not make the worker idle.
            self.woken = True
        if hits:
            self.found, self.idle_wait = True, 0.0
        elif misses and not claiming:
            if self.woken:
                self.found = True  # the empty claim was sent before the notification: claim again
            else:
                self.go_idle(now, listening)
        if ran and not self.found:
            self.found = True

    def go_idle(self, now: float, listening: bool) -> None:
        """Nothing was claimable: wait before the next probe."""
        self.found = False
        self.idle_wait = self._next_idle_wait(self.idle_wait, listening)
        self.next_probe = now + self.idle_wait

    def notified(self) -> None:
        """A job was enqueued on a queue the worker serves."""
        self.found = True
        self.woken = True

    def back_off(self, now: float) -> None:
        """A claim failed, or a job's session could not connect: wait a poll interval."""
        self.found = False
        self.next_probe = now + self.poll_interval

    def job_ran(self, seconds: float) -> None:
        """A job's handler ran for ``seconds``; called from the slot's thread."""
        with self._lock:
            self.mean_run = _next_mean(self.mean_run, seconds)

    def batch(self) -> int | None:
        """The size of a claim ahead: the ``batch_size``, else :data:`AHEAD` (at
        least the concurrency) while jobs are short, else None (claim for the
        free threads only)."""
        if self.batch_size:
            return self.batch_size
        mean, claim = self.mean_run, self.mean_claim
        if self.claimers and mean is not None and (
            mean <= SHORT_JOB or (claim is not None and mean <= CLAIMS_PER_JOB * claim)
        ):
            return max(AHEAD, self.concurrency)
        return None

    def held_at_most(self) -> int:
        """How many claimed jobs the worker may hold now (the options' capacity,
        or what claiming ahead short jobs needs: as with that batch size)."""
        batch = self.batch()
        if batch is None or self.batch_size:
            return self.capacity
        return max(self.capacity, (self.claimers + 1) * batch)

    def claim_sent(self, ask: int) -> None:
        with self._lock:
            self.reserved += ask

    def claim_ended(self, asked: int, got: int, seconds: float | None = None) -> None:
        """Called from the claiming thread once the claimed jobs are handed to
        the slots; ``seconds``: how long the claim took (None when it failed)."""
        with self._lock:
            self.reserved -= asked
            self.last_claim_full = got == asked
            if seconds is not None:
                self.mean_claim = _next_mean(self.mean_claim, seconds)

    # -- what to do ----------------------------------------------------------

    def wants_claim(self, inflight: int) -> bool:
        """Lease mode: claim while a thread is idle, or once a whole batch fits.

        Topping up one job per completion would turn each claim of 100 into
        100 claims of 1. ``inflight`` counts jobs held, claims in flight included.
        """
        free = self.held_at_most() - inflight
        return free > 0 and (inflight < self.concurrency or free >= (self.batch() or 1))

    def claims(self, now: float, *, held: int, claiming: int) -> list[int]:
        """Lease mode: the sizes of the claims to send now (``held``: jobs the
        slots hold; ``claiming``: claims in flight). Call :meth:`claim_sent`
        for each one sent."""
        asks: list[int] = []
        may_claim = self.found or (not claiming and now >= self.next_probe)
        # Two claims at once only while claims come back full: after a short
        # one the queue is about empty, and one probe will do.
        parallel = self.claimers if self.last_claim_full else 1
        reserved = self.reserved
        capacity, batch = self.held_at_most(), self.batch()
        while may_claim and claiming + len(asks) < parallel and self.wants_claim(held + reserved):
            ask = min(capacity - held - reserved, batch or (capacity - held))
            asks.append(ask)
            reserved += ask
            may_claim = self.found  # while idle, one probe at a time
        if asks:
            self.woken = False
        return asks

    def probes(self, now: float, *, free: int) -> int:
        """Transaction mode: how many slots should claim a batch now."""
        if self.found:
            if free > 0:
                self.woken = False
            return free
        if free > 0 and now >= self.next_probe:
            # While idle, one probe per idle wait, whatever the other slots do:
            # a long batch must not keep jobs that became runnable without a
            # NOTIFY (retries, scheduled jobs, rows a dead transaction released)
            # waiting for it to end.
            self.next_probe = now + (self.idle_wait or self.poll_interval)
            return 1
        return 0

    def drained(self, *, busy: bool) -> bool:
        """until_empty: the last claim found nothing and nothing runs (``busy``:
        jobs, claims or completions still in flight)."""
        return not self.found and not busy

    def sleep(self, now: float, *, busy: bool, deadline: float) -> float:
        """How long the loop may sleep (a wake-up ends it sooner): until the
        next probe while idle, else a poll interval; never past ``deadline``
        (the next heartbeat, reap, periodic pass or flush)."""
        wait = self.poll_interval if self.found or busy else self.next_probe - now
        return max(0.0, min(wait, deadline - now, self.poll_interval))

    def _next_idle_wait(self, previous: float, listening: bool) -> float:
        if listening:
            return self.poll_interval * self.jitter(0.8, 1.0)
        base = min(self.poll_interval, max(0.05, previous * 2))
        return base * self.jitter(0.75, 1.25)


def _next_mean(mean: float | None, sample: float) -> float:
    """The running mean after ``sample`` (exponentially weighted; the first sample starts it)."""
    return sample if mean is None else mean + _MEAN_WEIGHT * (sample - mean)
