"""``sa-jobqueue worker --processes N``: a supervisor of N worker processes.

The supervisor runs no job and opens no connection. It starts N copies of
the worker command (each with ``--processes 1``), each a worker of its own
with its own pools, listener and watchdog, and:

* restarts one that exits while the supervisor is not stopping, after a
  backoff that doubles from 1 s up to 30 s while that process keeps dying
  young (within 60 s of its start), and logs why (its exit code, or the
  signal that killed it); a worker that exits with a usage error (exit
  code 2: a bad option or import path) is not restarted, and the
  supervisor stops the others and exits 2;
* forwards SIGTERM and SIGINT to every worker process: the first stops them
  gracefully, a second at once, as either does to a single worker;
* exits once all have stopped: 0 when each exited 0 (or, still starting,
  was ended by the signal itself), else 1.

The worker processes run in a process group of their own, so that a
terminal's Ctrl-C reaches them once, through the supervisor; on Linux
each is sent SIGTERM should the supervisor die without stopping them
(``PR_SET_PDEATHSIG``), so none outlives it unnoticed.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import FrameType

log = logging.getLogger("sa_jobqueue.cli")

__all__ = ["Backoff", "Supervisor"]

USAGE_ERROR = 2  # click's exit code for a bad option or argument
# How a worker process may end after the stop was forwarded: its own clean
# exit, or the signal itself when it came before the worker handled signals.
_STOPPED = (None, 0, -signal.SIGTERM, -signal.SIGINT)


@dataclass(frozen=True)
class Backoff:
    """When to restart a worker process that exited (pure: times are passed in)."""

    first: float = 1.0
    cap: float = 30.0
    healthy_after: float = 60.0  # a process alive this long died of something new: start the backoff over

    def failures(self, previous: int, lived: float) -> int:
        """Young deaths in a row, counting this one."""
        return 1 if lived >= self.healthy_after else previous + 1

    def delay(self, failures: int) -> float:
        """Seconds to wait before the restart after ``failures`` young deaths in a row."""
        return min(self.cap, self.first * 2.0 ** max(0, failures - 1))


@dataclass
class _Slot:
    number: int
    process: subprocess.Popen[bytes] | None = None
    started: float = 0.0
    failures: int = 0
    restart_at: float = 0.0
    exit_code: int | None = None


class Supervisor:
    """Runs ``processes`` worker processes until SIGTERM or SIGINT (see the
    module docstring); ``command(n)`` is the command line of the n-th (from 1)."""

    def __init__(self, command: Callable[[int], Sequence[str]], processes: int, *, backoff: Backoff = Backoff(),
                 poll: float = 0.2) -> None:
        self.command = command
        self.backoff = backoff
        self.poll = poll
        self.slots = [_Slot(n) for n in range(1, processes + 1)]
        self._signals = 0
        self._usage_error = False

    def run(self) -> int:
        """Supervise until every worker process has stopped; return the exit code."""
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            while True:
                now = time.monotonic()
                for slot in self.slots:
                    self._reap(slot, now)
                    if not self.stopping and slot.process is None and now >= slot.restart_at:
                        self._start(slot, now)
                        if self.stopping:  # a signal came while it started: it was not forwarded to it
                            self._forward(signal.SIGTERM)
                if self.stopping and all(slot.process is None for slot in self.slots):
                    break
                time.sleep(self.poll)  # a signal cuts it short
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        if self._usage_error:
            return USAGE_ERROR
        return 0 if all(slot.exit_code in _STOPPED for slot in self.slots) else 1

    @property
    def stopping(self) -> bool:
        return self._signals > 0 or self._usage_error

    # -- the worker processes ------------------------------------------------------

    def _start(self, slot: _Slot, now: float) -> None:
        slot.process = subprocess.Popen(list(self.command(slot.number)),
                                        preexec_fn=_in_own_group_dying_with(os.getpid()))
        slot.started, slot.exit_code = now, None
        log.info("supervisor: started worker process %s (%s of %s)", slot.process.pid, slot.number,
                 len(self.slots))

    def _reap(self, slot: _Slot, now: float) -> None:
        """Take the exit of ``slot``'s process, if it exited; plan its restart."""
        if slot.process is None:
            return
        code = slot.process.poll()
        if code is None:
            return
        pid, slot.process, slot.exit_code = slot.process.pid, None, code
        if self.stopping:
            log.info("supervisor: worker process %s (%s of %s) stopped, %s", pid, slot.number, len(self.slots),
                     _how(code))
            return
        if code == USAGE_ERROR:
            log.error("supervisor: worker process %s (%s of %s) exited with a usage error; not restarting it, "
                      "stopping the others", pid, slot.number, len(self.slots))
            self._usage_error = True
            self._forward(signal.SIGTERM)
            return
        slot.failures = self.backoff.failures(slot.failures, now - slot.started)
        delay = self.backoff.delay(slot.failures)
        slot.restart_at = now + delay
        log.warning("supervisor: worker process %s (%s of %s) %s after %.0f s; restarting it in %g s", pid,
                    slot.number, len(self.slots), _how(code), now - slot.started, delay)

    # -- signals -------------------------------------------------------------------

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._signals += 1
        name = signal.Signals(signum).name
        if self._signals == 1:
            log.info("supervisor: %s received, stopping the worker processes (a second signal stops them at "
                     "once)", name)
        else:
            log.warning("supervisor: %s received again, stopping the worker processes at once", name)
        self._forward(signal.Signals(signum))

    def _forward(self, signum: signal.Signals) -> None:
        for slot in self.slots:
            if slot.process is not None and slot.process.poll() is None:
                try:
                    slot.process.send_signal(signum)
                except ProcessLookupError:  # exited meanwhile: reaped at the next look
                    pass


def _how(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _in_own_group_dying_with(parent: int) -> Callable[[], None]:
    """What a worker process runs between fork and exec: a process group of
    its own, and (Linux) SIGTERM when ``parent`` dies."""

    def setup() -> None:
        os.setpgid(0, 0)
        if sys.platform.startswith("linux"):
            pr_set_pdeathsig = 1
            ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGTERM))
            if os.getppid() != parent:  # the supervisor died before the prctl took effect
                os.kill(os.getpid(), signal.SIGTERM)

    return setup
