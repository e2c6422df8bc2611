"""A loopback TCP proxy whose links a test can cut (shared by the test folders)."""

from __future__ import annotations

import socket
import threading

__all__ = ["CutProxy"]


class CutProxy:
    """A loopback TCP proxy to ``target`` (``tcp://HOST:PORT``) whose links can be cut:
    :meth:`cut` closes every connection and refuses new ones (closed as soon as
    accepted) until :meth:`restore`; :meth:`drop_links` closes every connection and
    forwards new ones (a peer that reconnects gets through); :meth:`refuse_once` closes
    every connection and refuses only the next one.  :attr:`refused` and :attr:`forwarded` count the
    connections refused and forwarded.  :attr:`endpoint` is the proxy's ``tcp://``."""

    def __init__(self, target: str) -> None:
        host, port = target.removeprefix("tcp://").rsplit(":", 1)
        self.target = (host, int(port))
        self.lsock = socket.socket()
        self.lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.lsock.bind(("127.0.0.1", 0))
        self.lsock.listen(64)
        self.endpoint = f"tcp://127.0.0.1:{self.lsock.getsockname()[1]}"
        self.open = True
        self.closed = False
        self.lsock.settimeout(0.05)  # the accept loop checks ``closed`` this often
        self.refused = 0
        self.forwarded = 0
        self._refuse = 0
        self._links: list[socket.socket] = []
        self._lock = threading.Lock()
        self._pumps: list[threading.Thread] = []
        self._acceptor = threading.Thread(target=self._accept, daemon=True)
        self._acceptor.start()

    def _accept(self) -> None:
        while not self.closed:
            try:
                conn, _ = self.lsock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conn.settimeout(None)
            with self._lock:
                refuse = not self.open or self._refuse > 0
                if refuse:
                    self._refuse = max(0, self._refuse - 1)
                    self.refused += 1
            if refuse:
                conn.close()
                continue
            try:
                up = socket.create_connection(self.target, timeout=5)
            except OSError:  # the target is gone (refused, reset): drop this peer
                conn.close()
                continue
            up.settimeout(None)
            with self._lock:
                if self.closed:
                    conn.close()
                    up.close()
                    return
                self._links += [conn, up]
                self.forwarded += 1
                for src, dst in ((conn, up), (up, conn)):
                    t = threading.Thread(target=self._pump, args=(src, dst), daemon=True)
                    self._pumps.append(t)
                    t.start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def cut(self) -> None:
        self.open = False
        self.drop_links()

    def drop_links(self) -> None:
        """Close every link; new connections are still forwarded."""
        with self._lock:
            links, self._links = self._links, []
        for s in links:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def refuse_once(self) -> None:
        """Close every link and refuse the next connection only."""
        with self._lock:
            self._refuse = 1
        self.drop_links()

    def restore(self) -> None:
        self.open = True

    def close(self) -> None:
        """Stop accepting, cut every link and join every thread (5 s each at most), so
        that nothing of the proxy outlives its test."""
        with self._lock:
            self.closed = True
        self._acceptor.join(5)
        self.lsock.close()
        self.cut()
        with self._lock:
            pumps, self._pumps = self._pumps, []
        for t in pumps:
            t.join(5)
