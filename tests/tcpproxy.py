"""A small TCP proxy on loopback that can cut its connections or go half-open.

::

    with TcpProxy(("127.0.0.1", 5432)) as proxy:
        url = f"postgresql://postgres@127.0.0.1:{proxy.port}/db"
        ...
        proxy.cut()        # reset every open connection, both legs
        proxy.half_open()  # stop forwarding on every open connection, sockets kept open

One thread runs a ``selectors`` loop; the other threads talk to it through a
command queue and a wake-up socket pair, so no socket is closed under the
loop's feet.

``cut()`` closes both legs of every connection with ``SO_LINGER 0`` (a TCP
reset): the client and the server each see the connection fail at once, as
after a middlebox reset. ``half_open()`` freezes the open connections: the
proxy stops reading and writing them but keeps their sockets open, so each
side's kernel still acknowledges what the other sends and answers its TCP
keepalives, and nothing ever arrives. That is a stalled middlebox or a silent
drop of flows somewhere past the next hop, and only a deadline of the
client's own (or the server's idle timeouts, for the server's side) can end
it. New connections are forwarded normally in both cases; frozen ones stay
frozen until :meth:`stop`.
"""

from __future__ import annotations

import os
import queue
import selectors
import socket
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType

_CHUNK = 65536


@dataclass
class _Pair:
    client: socket.socket
    server: socket.socket
    # Bytes read from one side and not yet written to the other, by target socket.
    pending: dict[socket.socket, bytearray] = field(default_factory=dict)
    closing: bool = False

    def peer(self, sock: socket.socket) -> socket.socket:
        return self.server if sock is self.client else self.client


@dataclass
class ProxyStats:
    accepted: int = 0
    cut: int = 0
    frozen: int = 0


class TcpProxy:
    """Forward ``127.0.0.1:<port>`` to ``upstream``; see the module docstring."""

    def __init__(self, upstream: tuple[str, int] | str, *, host: str = "127.0.0.1", port: int = 0) -> None:
        """``upstream``: ``(host, port)``, or the path of a Unix socket."""
        self.upstream = upstream
        self._listener = socket.create_server((host, port), backlog=128)
        self._listener.setblocking(False)
        self.host, self.port = self._listener.getsockname()[:2]
        self._selector = selectors.DefaultSelector()
        self._pairs: dict[socket.socket, _Pair] = {}
        self._frozen: list[_Pair] = []
        self._commands: queue.Queue[tuple[Callable[[], object], queue.Queue[object]]] = queue.Queue()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="tcpproxy", daemon=True)
        self.stats = ProxyStats()

    # -- control, from any thread ---------------------------------------------

    def start(self) -> TcpProxy:
        self._selector.register(self._listener, selectors.EVENT_READ, "accept")
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._thread.start()
        return self

    def cut(self) -> int:
        """Reset every open connection (both legs); return how many were cut."""
        return int(self._call(self._cut))  # type: ignore[call-overload]

    def half_open(self, upstream_ports: set[int] | None = None, *, client_ports: set[int] | None = None) -> int:
        """Stop forwarding on every open connection, keeping its sockets open;
        return how many were frozen. New connections are forwarded.

        ``upstream_ports``: freeze only the connections whose proxy-to-server
        leg has one of these local ports: PostgreSQL shows that port as the
        backend's ``client_port`` in ``pg_stat_activity``, so a test can stall
        one chosen backend's connection. Only for a TCP upstream: over a Unix
        socket the server sees no port (``client_port`` is -1).

        ``client_ports``: freeze only the connections whose client leg comes
        from one of these ports (the client's own local port, see
        :func:`local_port`); works for either kind of upstream.
        """
        if upstream_ports is not None and isinstance(self.upstream, str):
            raise ValueError("upstream_ports needs a TCP upstream; this proxy forwards to a Unix socket")
        return int(self._call(lambda: self._half_open(upstream_ports, client_ports)))  # type: ignore[call-overload]

    def open_connections(self) -> int:
        return int(self._call(lambda: len({id(p) for p in self._pairs.values()})))  # type: ignore[call-overload]

    def stop(self) -> None:
        """Close every socket, frozen ones included, and end the thread."""
        if not self._thread.is_alive():
            return
        self._call(self._stop)
        self._thread.join(10)
        self._wake_r.close()
        self._wake_w.close()

    def __enter__(self) -> TcpProxy:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def _call(self, fn: Callable[[], object], timeout: float = 10.0) -> object:
        reply: queue.Queue[object] = queue.Queue(maxsize=1)
        self._commands.put((fn, reply))
        self._wake_w.send(b"x")
        outcome = reply.get(timeout=timeout)
        if isinstance(outcome, _Raised):
            raise outcome.error
        return outcome

    # -- the loop (proxy thread only) ------------------------------------------

    def _run(self) -> None:
        while not self._stopping:
            for key, events in self._selector.select(timeout=1.0):
                if key.data == "accept":
                    self._accept()
                elif key.data == "wake":
                    self._run_commands()
                else:
                    self._service(key.fileobj, events)  # type: ignore[arg-type]
        self._selector.close()

    def _run_commands(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except BlockingIOError:
            pass
        while True:
            try:
                fn, reply = self._commands.get_nowait()
            except queue.Empty:
                return
            # A failing command fails its caller, not the loop: a dead loop
            # would leave every connection through the proxy hanging.
            try:
                outcome: object = fn()
            except Exception as exc:
                outcome = _Raised(exc)
            reply.put(outcome)

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except BlockingIOError:
                return
            try:
                server = _connect(self.upstream)
            except OSError:
                _reset(client)
                continue
            for sock in (client, server):
                sock.setblocking(False)
                if sock.family != socket.AF_UNIX:
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            pair = _Pair(client, server)
            pair.pending = {client: bytearray(), server: bytearray()}
            self._pairs[client] = self._pairs[server] = pair
            self._selector.register(client, selectors.EVENT_READ)
            self._selector.register(server, selectors.EVENT_READ)
            self.stats.accepted += 1

    def _service(self, sock: socket.socket, events: int) -> None:
        pair = self._pairs.get(sock)
        if pair is None:
            return
        if events & selectors.EVENT_WRITE:
            self._flush(pair, sock)
        if events & selectors.EVENT_READ and sock in self._pairs:
            try:
                data = sock.recv(_CHUNK)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                data = b""
            if not data:
                self._close(pair)
                return
            target = pair.peer(sock)
            pair.pending[target] += data
            self._flush(pair, target)

    def _flush(self, pair: _Pair, target: socket.socket) -> None:
        buf = pair.pending[target]
        try:
            while buf:
                sent = target.send(buf)
                del buf[:sent]
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            self._close(pair)
            return
        mask = selectors.EVENT_READ | (selectors.EVENT_WRITE if buf else 0)
        self._selector.modify(target, mask)

    def _detach(self, pair: _Pair) -> None:
        for sock in (pair.client, pair.server):
            self._pairs.pop(sock, None)
            try:
                self._selector.unregister(sock)
            except (KeyError, ValueError):
                pass

    def _close(self, pair: _Pair) -> None:
        self._detach(pair)
        for sock in (pair.client, pair.server):
            sock.close()

    def _unique_pairs(self) -> list[_Pair]:
        seen: dict[int, _Pair] = {}
        for pair in self._pairs.values():
            seen[id(pair)] = pair
        return list(seen.values())

    def _cut(self) -> int:
        pairs = self._unique_pairs()
        for pair in pairs:
            self._detach(pair)
            _reset(pair.client)
            _reset(pair.server)
        self.stats.cut += len(pairs)
        return len(pairs)

    def _half_open(self, upstream_ports: set[int] | None, client_ports: set[int] | None) -> int:
        pairs = [p for p in self._unique_pairs()
                 if (upstream_ports is None or p.server.getsockname()[1] in upstream_ports)
                 and (client_ports is None or p.client.getpeername()[1] in client_ports)]
        for pair in pairs:
            self._detach(pair)  # never read or written again; the sockets stay open
        self._frozen.extend(pairs)
        self.stats.frozen += len(pairs)
        return len(pairs)

    def _stop(self) -> None:
        for pair in self._unique_pairs() + self._frozen:
            self._detach(pair)
            pair.client.close()
            pair.server.close()
        self._frozen.clear()
        self._selector.unregister(self._listener)
        self._listener.close()
        self._stopping = True


def local_port(fd: int) -> int:
    """The local port of the TCP socket ``fd`` (a client's side of a
    connection to the proxy, e.g. a psycopg connection's ``fileno()``)."""
    with socket.socket(fileno=os.dup(fd)) as sock:
        return int(sock.getsockname()[1])


@dataclass
class _Raised:
    error: Exception


def _connect(upstream: tuple[str, int] | str) -> socket.socket:
    if isinstance(upstream, str):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(5)
        try:
            sock.connect(upstream)
        except OSError:
            sock.close()
            raise
        return sock
    return socket.create_connection(upstream, timeout=5)


def _reset(sock: socket.socket) -> None:
    """Close with a TCP reset rather than a FIN."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    sock.close()
