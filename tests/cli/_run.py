"""Run the command line as a user does: ``python -m kvevents ...`` in a subprocess."""

from __future__ import annotations

import fcntl
import os
import pty
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), **extra}


def kvevents(
    *args: str, timeout: float = 120, python: str | None = None
) -> subprocess.CompletedProcess[str]:
    """``python -m kvevents ARGS`` with stdout and stderr captured (not terminals)."""
    return subprocess.run(
        [python or sys.executable, "-m", "kvevents", *args],
        capture_output=True,
        text=True,
        env=env(),
        timeout=timeout,
        cwd=REPO,
    )


def without(module: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``kvevents ARGS`` in a Python where ``import MODULE`` fails, as in an install without
    that optional dependency."""
    code = (
        "import sys; sys.modules[sys.argv[1]] = None; from kvevents.cli import main; "
        "sys.exit(main(sys.argv[2:]))"
    )
    return subprocess.run(
        [sys.executable, "-c", code, module, *args],
        capture_output=True,
        text=True,
        env=env(),
        timeout=timeout,
        cwd=REPO,
    )


def on_terminal(*args: str, timeout: float = 120) -> tuple[int, str, str]:
    """``kvevents ARGS`` with stderr on a pseudo-terminal: (exit status, stdout, what the
    terminal showed)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # 120 columns
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvevents", *args],
        stdout=subprocess.PIPE,
        stderr=slave,
        env=env(),
        cwd=REPO,
    )
    os.close(slave)
    shown = bytearray()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 0.1)
        if ready:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # the terminal closed: the command has exited
                break
            if not chunk:
                break
            shown += chunk
        elif proc.poll() is not None:
            break
    os.close(master)
    assert proc.stdout is not None
    with proc.stdout:
        out = proc.stdout.read().decode()
    rc = proc.wait(timeout=timeout)
    return rc, out, shown.decode(errors="replace")
