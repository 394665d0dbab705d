"""Hosts of the scale test's own on this machine, and a PgBouncer between them and PostgreSQL.

Used by ``benchmarks/scale.py`` and ``tests/test_scale_out.py``; standard
library only, so both can load it. Needs root, ``ip`` (iproute2) and the
``pgbouncer`` program (Debian's packages ``iproute2`` and ``pgbouncer``).

* :func:`hosts` makes network namespaces, each joined to this machine's own
  namespace by a veth pair on a /30 of its own in 10.241.0.0/16 (a block no
  interface here uses), and deletes them on exit. A process started with
  :meth:`Host.command` runs on that host: its only way out is its veth, so it
  reaches PgBouncer on the host side's address, as a worker on another
  machine would, and nothing else.
* :func:`pgbouncer` runs a PgBouncer of its own (as the ``postgres`` user,
  or the owner of the server's socket directory: PgBouncer refuses to run
  as root) in **transaction** pooling mode,
  listening on the hosts' addresses only, with every database of the given
  server passed through (``* =``), and stops it on exit.
"""

from __future__ import annotations

import os
import pwd
import random
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

BLOCK = "10.241"  # the /16 the hosts' /30 links are taken from


def missing() -> str | None:
    """Why this machine cannot run the scale test, or ``None`` when it can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for program, package in (("ip", "iproute2"), ("pgbouncer", "pgbouncer")):
        if shutil.which(program) is None:
            return f"'{program}' is not installed (Debian package {package})"
    try:
        pwd.getpwnam("postgres")
    except KeyError:
        return "no 'postgres' user to run PgBouncer as (it refuses to run as root)"
    return None


def _ip(*args: str, namespace: str | None = None) -> None:
    command = ["ip", *args] if namespace is None else ["ip", "netns", "exec", namespace, "ip", *args]
    subprocess.run(command, check=True, capture_output=True, text=True, timeout=30)


@dataclass(frozen=True)
class Host:
    """A network namespace; ``address`` is its own end of the link, ``gateway`` this machine's end."""

    namespace: str
    address: str
    gateway: str

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside this host's namespace."""
        return ["ip", "netns", "exec", self.namespace, *argv]


def _free_block() -> int:
    """A third octet under BLOCK that no address of this machine uses."""
    used = subprocess.run(["ip", "-o", "-4", "addr"], check=True, capture_output=True, text=True).stdout
    choices = [n for n in range(256) if f" {BLOCK}.{n}." not in used]
    if not choices:
        raise RuntimeError(f"every {BLOCK}.N.0/24 is in use on this machine")
    return random.choice(choices)


@contextmanager
def hosts(count: int) -> Iterator[list[Host]]:
    """``count`` hosts (network namespaces) linked to this machine; all removed on exit."""
    octet = _free_block()
    tag = f"{os.getpid() % 100000}{random.randrange(100)}"  # interface names stay under 16 bytes
    made: list[tuple[str, str]] = []
    result: list[Host] = []
    try:
        for n in range(count):
            namespace, outside, inside = f"sajq-{tag}-{n}", f"sq{tag}o{n}", f"sq{tag}i{n}"
            gateway, address = f"{BLOCK}.{octet}.{4 * n + 1}", f"{BLOCK}.{octet}.{4 * n + 2}"
            _ip("netns", "add", namespace)
            made.append((namespace, outside))
            _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
            _ip("link", "set", inside, "netns", namespace)
            _ip("addr", "add", f"{gateway}/30", "dev", outside)
            _ip("link", "set", outside, "up")
            _ip("addr", "add", f"{address}/30", "dev", inside, namespace=namespace)
            _ip("link", "set", inside, "up", namespace=namespace)
            _ip("link", "set", "lo", "up", namespace=namespace)
            result.append(Host(namespace, address, gateway))
        yield result
    finally:
        for namespace, outside in reversed(made):
            # Deleting the namespace deletes its end of the pair, and with it the other end.
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True, timeout=30)
            subprocess.run(["ip", "link", "del", outside], capture_output=True, timeout=30)


def _free_port(address: str) -> int:
    with socket.socket() as probe:
        probe.bind((address, 0))
        return int(probe.getsockname()[1])


@dataclass(frozen=True)
class Bouncer:
    """A running PgBouncer: clients connect to ``port`` on a host's ``gateway``."""

    port: int
    log: Path

    def log_tail(self) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-20:])
        except OSError:
            return ""


@contextmanager
def pgbouncer(
    listen: Sequence[str], *, server_host: str, server_port: int, user: str, password: str = "", pool_size: int,
) -> Iterator[Bouncer]:
    """A PgBouncer in transaction mode on ``listen`` (addresses), passing every
    database through to the PostgreSQL at ``server_host``:``server_port`` (a
    Unix socket directory when it starts with ``/``) as ``user`` (with
    ``password``, if the server asks), at most ``pool_size`` server
    connections per database; its clients are trusted. It runs as the owner
    of the socket directory (who alone may use it), else as ``postgres``, and
    is stopped (by its PID) on exit."""
    directory = Path(tempfile.mkdtemp(prefix="sajq-bouncer-"))
    if server_host.startswith("/"):
        account = pwd.getpwuid(os.stat(server_host).st_uid)
        if account.pw_uid == 0:
            raise RuntimeError(f"the server's socket directory {server_host} belongs to root, and PgBouncer "
                               "refuses to run as root")
    else:
        account = pwd.getpwnam("postgres")
    port = _free_port(listen[0])
    (directory / "users.txt").write_text(f'"{user}" "{password}"\n')
    config = directory / "pgbouncer.ini"
    log = directory / "pgbouncer.log"
    config.write_text(
        "[databases]\n"
        f"* = host={server_host} port={server_port} user={user}\n"
        "[pgbouncer]\n"
        f"listen_addr = {','.join(listen)}\n"
        f"listen_port = {port}\n"
        "unix_socket_dir =\n"
        "auth_type = trust\n"
        f"auth_file = {directory / 'users.txt'}\n"
        "pool_mode = transaction\n"
        f"default_pool_size = {pool_size}\n"
        "max_client_conn = 2000\n"
        f"admin_users = {user}\n"  # SHOW POOLS on the admin console (database "pgbouncer")
        f"logfile = {log}\n"
    )
    os.chown(directory, account.pw_uid, account.pw_gid)
    for path in directory.iterdir():
        os.chown(path, account.pw_uid, account.pw_gid)
    process = subprocess.Popen(
        ["runuser", "-u", account.pw_name, "--", "pgbouncer", str(config)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    bouncer = Bouncer(port, log)
    try:
        _wait_listening(listen[0], port, process, bouncer)
        yield bouncer
    finally:
        if process.poll() is None:
            process.terminate()  # runuser passes it on to PgBouncer, which exits at once on SIGTERM
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=30)
        shutil.rmtree(directory, ignore_errors=True)


def _wait_listening(address: str, port: int, process: subprocess.Popen[bytes], bouncer: Bouncer) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"pgbouncer exited with {process.returncode}:\n{bouncer.log_tail()}")
        try:
            with socket.create_connection((address, port), timeout=1):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"pgbouncer did not listen on {address}:{port} within 30 s:\n{bouncer.log_tail()}")
