"""The ZeroMQ context and sockets of one ``ZmqEventPublisher``.

One job: open the PUB socket (bound or connected, with its HWM, CURVE and a cap on
subscription frames; an XPUB, wire-compatible with a PUB, that hands every
subscription and unsubscription to the sender) and, when asked, the ROUTER replay
socket (always bound, ``ROUTER_MANDATORY``, with a disconnect monitor), resolve the
addresses they got, re-create the PUB socket with another HWM at the same address
(:meth:`PublisherSockets.reopen_pub`), and close them again.  Imports pyzmq, :mod:`kvevents.endpoints` and
:mod:`kvevents.security`; nothing of ``publishers``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import zmq

from kvevents.endpoints import enable_ipv6_if_needed
from kvevents.errors import ConfigError
from kvevents.security import CurveServerConfig, apply_curve_server

__all__ = ["PublisherSockets"]


def _noop() -> None:
    pass


def _attach(sock: zmq.Socket[Any], endpoint: str, *, bind: bool, what: str) -> str:
    """Bind or connect ``sock``; return the resolved address (the real port for port 0)."""
    try:
        if bind:
            sock.bind(endpoint)
        else:
            sock.connect(endpoint)
    except zmq.ZMQError as exc:
        verb = "bind" if bind else "connect"
        raise ConfigError(f"cannot {verb} the {what} socket to {endpoint!r}: {exc}") from exc
    last = sock.getsockopt(zmq.LAST_ENDPOINT)
    resolved = last.decode("utf-8") if isinstance(last, bytes) else str(last)
    return resolved or endpoint


class PublisherSockets:
    """Opens a publisher's sockets in the constructor; :meth:`close` closes them.

    ``context``: a context to use (never terminated here), or ``None`` for one of our
    own, except with an ``inproc://`` endpoint, whose peers must share
    ``zmq.Context.instance()``.  ``bind`` says whether the PUB socket binds or connects.
    ``hwm_messages`` is the PUB socket's HWM; ``max_subscription_bytes`` its
    ``ZMQ_MAXMSGSIZE`` (it receives only subscriptions); ``replay_sndhwm_messages`` and
    ``replay_max_message_bytes`` the ROUTER's.  Raises :class:`ConfigError` (after
    closing what it opened) when a socket cannot be bound or connected or the CURVE
    keys cannot be read.
    """

    def __init__(
        self,
        *,
        context: zmq.Context[Any] | None,
        endpoint: str,
        replay_endpoint: str | None,
        bind: bool,
        hwm_messages: int,
        max_subscription_bytes: int,
        replay_sndhwm_messages: int,
        replay_max_message_bytes: int,
        curve: CurveServerConfig | None,
    ) -> None:
        inproc = endpoint.startswith("inproc://") or (replay_endpoint or "").startswith("inproc://")
        self.own_context = context is None and not inproc
        """Whether :attr:`context` is ours (then :meth:`close` may terminate it)."""
        if context is not None:
            self.context: zmq.Context[Any] = context
        elif self.own_context:
            self.context = zmq.Context(io_threads=1)
        else:
            self.context = zmq.Context.instance()
        self._releases: list[Callable[[], None]] = []
        self.router: zmq.Socket[Any] | None = None
        self.monitor: zmq.Socket[Any] | None = None
        self.bind = bind
        self.hwm_messages = hwm_messages
        """The PUB socket's ``SNDHWM`` (messages)."""
        self._max_subscription_bytes = max_subscription_bytes
        self._curve = curve
        self.attach_pending = False
        """Whether a re-created PUB socket still has to bind (its address was busy)."""
        try:
            self.pub, self._pub_release = self._open_pub(endpoint, hwm_messages)
        except BaseException:
            if self.own_context:
                self.context.term()
            raise
        try:
            self.endpoint = _attach(self.pub, endpoint, bind=bind, what="PUB")
            """The PUB socket's resolved address."""
            self.replay_endpoint: str | None = None
            """The ROUTER socket's resolved address (``None``: no replay)."""
            if replay_endpoint is not None:
                self.router = self.context.socket(zmq.ROUTER)
                self.router.setsockopt(zmq.SNDHWM, replay_sndhwm_messages)
                self.router.setsockopt(zmq.MAXMSGSIZE, replay_max_message_bytes)
                # Report a full or vanished peer instead of dropping silently.
                self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)
                self._releases.append(apply_curve_server(self.router, curve))
                enable_ipv6_if_needed(self.router, replay_endpoint)
                self.monitor = self.router.get_monitor_socket(zmq.EVENT_DISCONNECTED)
                self.replay_endpoint = _attach(
                    self.router, replay_endpoint, bind=True, what="replay ROUTER"
                )
        except BaseException:
            self.close(linger_ms=0)
            if self.own_context:
                self.context.term()
            raise

    def _open_pub(
        self, endpoint: str, hwm_messages: int
    ) -> tuple[zmq.Socket[Any], Callable[[], None]]:
        """A PUB socket configured but not yet bound or connected, and the release of
        its CURVE resources.  Raises :class:`ConfigError` (the socket closed) when the
        CURVE keys cannot be read."""
        # An XPUB speaks PUB's protocol; with XPUB_VERBOSER it also delivers every
        # subscription and unsubscription (including those of a peer that went away),
        # which :mod:`~kvevents.publishers.subscriptions` counts.
        pub: zmq.Socket[Any] = self.context.socket(zmq.XPUB)
        try:
            pub.setsockopt(zmq.XPUB_VERBOSER, 1)
            pub.set_hwm(hwm_messages)
            # Subscribers only send subscriptions (a topic prefix): a bigger frame makes
            # ZeroMQ drop that peer before allocating it.
            pub.setsockopt(zmq.MAXMSGSIZE, self._max_subscription_bytes)
            release = apply_curve_server(pub, self._curve)
        except BaseException:
            pub.close(linger=0)
            raise
        try:
            enable_ipv6_if_needed(pub, endpoint)
        except BaseException:
            pub.close(linger=0)
            release()
            raise
        return pub, release

    def reopen_pub(self, hwm_messages: int) -> None:
        """Replace the PUB socket by a new one with ``SNDHWM`` ``hwm_messages``, bound or
        connected to the same address.

        The old socket is closed with linger 0 (what its queues held is dropped; its
        peers reconnect to the new one by themselves).  The mark is never changed on a
        socket with peers: libzmq would push it to pipes being torn down.  When the
        address is still held by the old listener, :attr:`attach_pending` is set and
        :meth:`retry_attach` binds later.  Raises :class:`ConfigError` (the old socket
        kept) when the new one cannot be configured."""
        new, release = self._open_pub(self.endpoint, hwm_messages)
        self.pub.close(linger=0)
        self._pub_release()
        self.pub, self._pub_release = new, release
        self.hwm_messages = hwm_messages
        self.attach_pending = True
        self.retry_attach()

    def retry_attach(self) -> bool:
        """Bind or connect a re-created PUB socket; True once it is (or was)."""
        if not self.attach_pending:
            return True
        try:
            _attach(self.pub, self.endpoint, bind=self.bind, what="PUB")
        except ConfigError:
            return False
        self.attach_pending = False
        return True

    def close(self, linger_ms: int) -> None:
        """Close the monitor and ROUTER at once and the PUB with ``linger_ms``; release
        the CURVE resources.  The context is left to the caller."""
        try:
            if self.monitor is not None and self.router is not None:
                with contextlib.suppress(zmq.ZMQError):
                    self.router.disable_monitor()
                self.monitor.close(linger=0)
            if self.router is not None:
                self.router.close(linger=0)
            self.pub.close(linger=linger_ms)
        finally:
            for release in [self._pub_release, *self._releases]:
                with contextlib.suppress(Exception):
                    release()
            self._releases.clear()
            self._pub_release = _noop
