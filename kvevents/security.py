"""Optional ZeroMQ CURVE authentication and encryption, off by default as in vLLM.

vLLM's publisher has no authentication: anyone who can reach its PUB or ROUTER socket
can read the stream, and anyone who can reach a subscriber's socket can feed it.
CURVE (libzmq's elliptic-curve security, RFC 26) fixes both: the server side (PUB,
ROUTER) holds a secret key, every client (SUB, DEALER) must know the server's public
key, and the server may further accept only clients whose public key it lists.

Keys live in files in the format ``zmq.auth.create_certificates(directory, name)``
writes: ``name.key`` holds the public key, ``name.key_secret`` the public and the
secret key (``zmq.auth.load_certificate`` reads both)::

    python -c "import zmq.auth; zmq.auth.create_certificates('keys', 'server')"
    python -c "import zmq.auth; zmq.auth.create_certificates('keys', 'router-1')"

Server side: :class:`CurveServerConfig` (``secret_key_file`` = ``server.key_secret``,
optionally ``authorized_keys_dir`` = a directory of client ``*.key`` files) applied with
:func:`apply_curve_server`.  Client side: :class:`CurveClientConfig`
(``secret_key_file`` = the client's own ``.key_secret``, ``server_public_key_file`` =
``server.key``) applied with :func:`apply_curve_client`.  Both must be applied *before*
the socket binds or connects.  A client without the right keys completes no handshake:
it receives nothing and nothing it sends is delivered.

Every problem (a missing file, a file without the needed key, a malformed key, a libzmq
built without CURVE) is a :class:`~kvevents.errors.ConfigError` with a one-line message.
"""

from __future__ import annotations

import glob
import itertools
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.auth
from zmq.utils import z85

from kvevents.errors import ConfigError

__all__ = [
    "CurveClientConfig",
    "CurveServerConfig",
    "apply_curve_client",
    "apply_curve_server",
    "load_public_key",
    "load_secret_key",
]

_Z85_KEY_LEN = 40  # a 32-byte CURVE key is 40 characters in Z85


@dataclass(frozen=True)
class CurveServerConfig:
    """CURVE settings of a server socket (PUB, ROUTER).

    * ``secret_key_file``: the server's ``.key_secret`` file (public and secret key).
    * ``authorized_keys_dir``: a directory of client public-key files (``*.key``).  When
      given, only clients whose public key is there may connect (checked by a ZAP
      authenticator thread in the socket's context; the directory is read once, when the
      config is applied).  When ``None``, any client that knows the server's public key
      may connect (traffic is still encrypted).
    """

    secret_key_file: str
    authorized_keys_dir: str | None = None


@dataclass(frozen=True)
class CurveClientConfig:
    """CURVE settings of a client socket (SUB, DEALER).

    * ``secret_key_file``: the client's own ``.key_secret`` file (public and secret key);
      its public key is what a server's ``authorized_keys_dir`` must hold.
    * ``server_public_key_file``: the server's ``.key`` (or ``.key_secret``) file.
    """

    secret_key_file: str
    server_public_key_file: str


def _require_curve() -> None:
    if not zmq.has("curve"):
        raise ConfigError(
            f"CURVE security was asked for but libzmq {zmq.zmq_version()} was built without it"
        )


def _read(path: str, what: str) -> tuple[bytes, bytes | None]:
    if not isinstance(path, (str, os.PathLike)):
        raise ConfigError(f"{what} must be a file path, got {type(path).__name__}")
    if not os.path.isfile(path):
        raise ConfigError(f"{what} {str(path)!r} does not exist or is not a file")
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{what} {str(path)!r} is not a ZMQ certificate: {exc}") from exc
    _check_key(public, path, what, "public")
    if secret is not None:
        _check_key(secret, path, what, "secret")
    return public, secret


def _check_key(key: bytes, path: str, what: str, kind: str) -> None:
    if len(key) != _Z85_KEY_LEN:
        raise ConfigError(
            f"{what} {str(path)!r}: the {kind} key is {len(key)} characters, "
            f"not a {_Z85_KEY_LEN}-character Z85 CURVE key"
        )
    try:
        z85.decode(key)
    except (ValueError, KeyError, IndexError) as exc:
        raise ConfigError(f"{what} {str(path)!r}: the {kind} key is not valid Z85") from exc


def load_public_key(path: str, what: str = "public key file") -> bytes:
    """The Z85 public key in certificate file ``path``; :class:`ConfigError` if none."""
    return _read(path, what)[0]


def load_secret_key(path: str, what: str = "secret key file") -> tuple[bytes, bytes]:
    """``(public, secret)`` Z85 keys from ``path``, which must hold the secret key."""
    public, secret = _read(path, what)
    if secret is None:
        raise ConfigError(
            f"{what} {str(path)!r} holds no secret key: give the .key_secret file "
            "written by zmq.auth.create_certificates, not the public .key"
        )
    return public, secret


def _set(socket: zmq.Socket[Any], option: int, value: Any, what: str) -> None:
    try:
        socket.setsockopt(option, value)
    except zmq.ZMQError as exc:
        raise ConfigError(f"cannot set {what} on the socket: {exc}") from exc


# --- ZAP: one authenticator thread per context, one ZAP domain per socket ---------------
class _ZapRegistry:
    """Shares a :class:`zmq.auth.thread.ThreadAuthenticator` among the sockets of a context.

    libzmq allows one ZAP handler per context (it binds ``inproc://zeromq.zap.01``), so
    each server socket gets its own ZAP domain with its own set of authorized keys, and
    the thread stops when the last socket using it is released.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._auths: dict[int, tuple[Any, set[str]]] = {}
        self._counter = itertools.count()

    def add(self, context: zmq.Context[Any], keys_dir: str) -> tuple[str, Callable[[], None]]:
        from zmq.auth.thread import ThreadAuthenticator

        with self._lock:
            entry = self._auths.get(id(context))
            if entry is None:
                auth = ThreadAuthenticator(context)
                try:
                    auth.start()
                except zmq.ZMQError as exc:
                    raise ConfigError(
                        f"cannot start a ZAP authenticator in this ZMQ context: {exc} "
                        "(is another ZAP handler already running in it?)"
                    ) from exc
                entry = (auth, set())
                self._auths[id(context)] = entry
            auth, domains = entry
            domain = f"kvevents-{os.getpid()}-{next(self._counter)}"
            auth.configure_curve(domain=domain, location=keys_dir)
            domains.add(domain)

        released = False

        def release() -> None:
            nonlocal released
            with self._lock:
                if released:
                    return
                released = True
                current = self._auths.get(id(context))
                if current is None:
                    return
                cur_auth, cur_domains = current
                cur_domains.discard(domain)
                cur_auth.certs.pop(domain, None)
                if not cur_domains:
                    del self._auths[id(context)]
                    cur_auth.stop()

        return domain, release


_ZAP = _ZapRegistry()


def _noop() -> None:
    return None


def apply_curve_server(
    socket: zmq.Socket[Any], cfg: CurveServerConfig | None
) -> Callable[[], None]:
    """Make ``socket`` (PUB or ROUTER, not yet bound or connected) a CURVE server.

    ``cfg=None`` leaves the socket as it is (no security, vLLM's default).  Returns a
    ``release()`` callable to call after closing the socket: it frees the ZAP domain
    (and stops the authenticator thread when no socket of the context uses it); it is a
    no-op when no authenticator was needed.  Raises :class:`ConfigError`.
    """
    if cfg is None:
        return _noop
    _require_curve()
    public, secret = load_secret_key(cfg.secret_key_file, "CURVE server secret key file")
    keys_dir = cfg.authorized_keys_dir
    if keys_dir is not None:
        if not os.path.isdir(keys_dir):
            raise ConfigError(
                f"CURVE authorized keys directory {str(keys_dir)!r} does not exist "
                "or is not a directory"
            )
        found = sorted(glob.glob(os.path.join(keys_dir, "*.key")))
        if not found:
            raise ConfigError(
                f"CURVE authorized keys directory {str(keys_dir)!r} holds no *.key "
                "public-key files, so no client could connect"
            )
        for path in found:
            load_public_key(path, "CURVE authorized client key file")
    _set(socket, zmq.CURVE_SECRETKEY, secret, "the CURVE secret key")
    _set(socket, zmq.CURVE_PUBLICKEY, public, "the CURVE public key")
    _set(socket, zmq.CURVE_SERVER, 1, "CURVE server mode")
    if keys_dir is None:
        return _noop
    domain, release = _ZAP.add(socket.context, keys_dir)
    try:
        _set(socket, zmq.ZAP_DOMAIN, domain.encode(), "the ZAP domain")
    except ConfigError:
        release()
        raise
    return release


def apply_curve_client(socket: zmq.Socket[Any], cfg: CurveClientConfig | None) -> None:
    """Make ``socket`` (SUB or DEALER, not yet connected) a CURVE client of a server.

    ``cfg=None`` leaves the socket as it is.  Raises :class:`ConfigError`.
    """
    if cfg is None:
        return
    _require_curve()
    public, secret = load_secret_key(cfg.secret_key_file, "CURVE client secret key file")
    server = load_public_key(cfg.server_public_key_file, "CURVE server public key file")
    _set(socket, zmq.CURVE_SERVERKEY, server, "the CURVE server key")
    _set(socket, zmq.CURVE_PUBLICKEY, public, "the CURVE public key")
    _set(socket, zmq.CURVE_SECRETKEY, secret, "the CURVE secret key")
