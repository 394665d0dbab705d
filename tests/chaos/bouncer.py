"""A PgBouncer in transaction pooling mode on a free loopback port, for one test.

Needs the ``pgbouncer`` program (Debian: ``apt-get install -y pgbouncer``).
PgBouncer refuses to run as root: as root it is started with ``-u postgres``
(it switches user itself, so the PID we hold is PgBouncer's own).
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

import psycopg
from pgserver import free_port


class PgBouncer:
    def __init__(self, server_port: int, *, pool_size: int = 40, user: str = "postgres") -> None:
        program = shutil.which("pgbouncer") or ("/usr/sbin/pgbouncer" if Path("/usr/sbin/pgbouncer").exists() else None)
        if program is None:
            raise FileNotFoundError("pgbouncer is not installed (Debian: apt-get install -y pgbouncer)")
        self.program = program
        self.server_port = server_port
        self.port = free_port()
        self.pool_size = pool_size
        self.root = Path(tempfile.mkdtemp(prefix="sajq-chaos-bouncer-"))
        self.log = self.root / "pgbouncer.log"
        self._user = pwd.getpwnam(user) if os.geteuid() == 0 else None
        self.proc: subprocess.Popen[bytes] | None = None

    def url_for(self, database: str) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def start(self) -> PgBouncer:
        ini = self.root / "pgbouncer.ini"
        ini.write_text(
            "[databases]\n"
            f"* = host=127.0.0.1 port={self.server_port} user=postgres\n"
            "[pgbouncer]\n"
            "listen_addr = 127.0.0.1\n"
            f"listen_port = {self.port}\n"
            "unix_socket_dir =\n"
            "auth_type = any\n"
            "pool_mode = transaction\n"
            f"default_pool_size = {self.pool_size}\n"
            "max_client_conn = 500\n"
            "server_login_retry = 1\n"
            "ignore_startup_parameters = extra_float_digits\n"
            f"logfile = {self.log}\n"
            f"pidfile = {self.root / 'pgbouncer.pid'}\n"
        )
        command = [self.program]
        if self._user is not None:
            os.chown(self.root, self._user.pw_uid, self._user.pw_gid)
            os.chown(ini, self._user.pw_uid, self._user.pw_gid)
            command += ["-u", self._user.pw_name]
        self.proc = subprocess.Popen([*command, str(ini)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while True:
            try:
                with psycopg.connect(self.url_for("postgres"), connect_timeout=2, prepare_threshold=None) as conn:
                    conn.execute("SELECT 1")
                return self
            except psycopg.OperationalError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    log = self.log.read_text()[-2000:] if self.log.exists() else ""
                    self.stop()
                    raise RuntimeError(f"pgbouncer did not start: {log}") from None
                time.sleep(0.2)

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # immediate shutdown
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> PgBouncer:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
