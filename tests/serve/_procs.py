"""Helpers for tests that run ``kvevents`` subprocesses: a process whose output lines
are read on threads, a condition wait, and a TCP proxy that can cut its links (a
firewall between an engine's publisher and the service)."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def wait_until(cond: Callable[[], bool], timeout: float = 60.0, what: str = "condition") -> None:
    """Wait for ``cond()`` (an HTTP error counts as False) for up to ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if cond():
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


class Proc:
    """A ``kvevents`` subprocess; its stdout and stderr lines are collected on threads."""

    def __init__(self, *args: str) -> None:
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.p = subprocess.Popen(
            [sys.executable, "-m", "kvevents.cli", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=ROOT,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.errors: list[str] = []
        self._readers = [
            threading.Thread(target=self._read, daemon=True),
            threading.Thread(target=self._read_err, daemon=True),
        ]
        for t in self._readers:
            t.start()

    def _read(self) -> None:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            self.lines.put(line.rstrip("\n"))

    def _read_err(self) -> None:
        assert self.p.stderr is not None
        for line in self.p.stderr:
            self.errors.append(line.rstrip("\n"))

    def read_lines(self, n: int, timeout: float = 60.0) -> list[str]:
        out = []
        deadline = time.monotonic() + timeout
        while len(out) < n:
            try:
                out.append(self.lines.get(timeout=max(0.01, deadline - time.monotonic())))
            except queue.Empty:
                raise AssertionError(f"no output from {self.p.args}: {self.errors[-20:]}") from None
        return out

    def stderr_has(self, text: str) -> bool:
        return any(text in line for line in list(self.errors))

    def stop(self, sig: int = signal.SIGTERM) -> int:
        """Send ``sig`` (SIGKILL after 15 s), close the pipes; the exit status."""
        if self.p.poll() is None:
            self.p.send_signal(sig)
            try:
                self.p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()
        for t, pipe in zip(self._readers, (self.p.stdout, self.p.stderr)):
            t.join(timeout=15)  # each pipe ends with the process
            if pipe is not None and not t.is_alive():
                pipe.close()
        return self.p.returncode


def sim_engines(n: int, *args: str) -> tuple[Proc, list[str]]:
    """``kvevents sim serve --engines n ARGS``: the process and its ``--engine`` specs."""
    proc = Proc("sim", "serve", "--engines", str(n), *args)
    lines = proc.read_lines(n)
    return proc, [line.removeprefix("--engine ") for line in lines]


def serve(specs: list[str], *args: str) -> tuple[Proc, str]:
    """``kvevents serve`` in front of ``specs`` on a free loopback port: the process and
    its URL."""
    argv = [a for s in specs for a in ("--engine", s)]
    proc = Proc("serve", *argv, "--port", "0", "--scrape-interval", "0.2", *args)
    (line,) = proc.read_lines(1)
    m = re.search(r"http://127\.0\.0\.1:\d+", line)
    assert m, line
    return proc, m.group(0)


def spec_parts(spec: str) -> tuple[str, str, str, str]:
    """``NAME=HTTP,EVENTS,REPLAY`` as its four parts."""
    name, rest = spec.split("=", 1)
    http, events, replay = rest.split(",")
    return name, http, events, replay
