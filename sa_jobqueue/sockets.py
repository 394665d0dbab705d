"""Sockets: a deadline on a blocking call, by shutting its socket down.

A connection stalled behind a half-open path waits forever in a read; the
only way to end the wait from outside is to shut the socket down, which
makes the read fail without closing the file descriptor its owner holds.
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager


def shutdown_socket(fd: int) -> None:
    """Shut down the socket behind ``fd`` (both directions) without closing
    ``fd``: the connection's owner sees its call fail and closes it. The
    caller must know that ``fd`` is still the connection's (not closed)."""
    try:
        sock = socket.socket(fileno=os.dup(fd))
    except OSError:
        return
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        sock.close()


class SocketDeadline:
    """See :func:`socket_deadline`."""

    def __init__(self, fd: int, seconds: float) -> None:
        self._fd = fd
        self._lock = threading.Lock()
        self._over = False
        #: True once the deadline passed and the socket was shut down.
        self.expired = False
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True

    def _expire(self) -> None:
        with self._lock:
            if not self._over:
                shutdown_socket(self._fd)
                self.expired = True

    def start(self) -> None:
        self._timer.start()

    def end(self) -> None:
        with self._lock:
            self._over = True
        self._timer.cancel()


@contextmanager
def socket_deadline(fd: int, seconds: float) -> Iterator[SocketDeadline]:
    """Shut the socket ``fd`` down if the block is still running after
    ``seconds``, so that a read or write waiting on it fails. The block must
    keep ``fd`` open; once the block has ended, ``fd`` is never touched."""
    deadline = SocketDeadline(fd, seconds)
    deadline.start()
    try:
        yield deadline
    finally:
        deadline.end()
