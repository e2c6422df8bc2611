"""Peer bootstrap: the document ``GET /snapshot`` answers and ``--bootstrap-from``
reads.

A :class:`PeerSnapshot` is a service's index snapshot (:meth:`BlockIndex.snapshot`
bytes) and, taken at the same instant, every stream's resume point: per engine rank,
its worker id, the seq of the last batch the index applied and that batch's payload
fingerprint (xxh3-64), and whether the rank's history was complete.  A service started
with it restores the index and follows each stream from its resume point (the
subscriber checks the point by replay first), instead of from the start of the
engine's replay ring, which may have wrapped.

One job: the document's format, fetching it, and who may ask for it
(:func:`is_loopback`).  Imports msgspec and httpx only.
"""

from __future__ import annotations

import ipaddress
import logging
from dataclasses import dataclass

import msgspec

from kvevents.errors import ConfigError

__all__ = [
    "SNAPSHOT_MEDIA_TYPE",
    "PeerSnapshot",
    "StreamPoint",
    "fetch_snapshot",
    "is_loopback",
]

logger = logging.getLogger(__name__)

SNAPSHOT_MEDIA_TYPE = "application/vnd.kvevents.snapshot+msgpack"
_FORMAT = "kvevents-serve-snapshot"
_VERSION = 1


@dataclass(frozen=True)
class StreamPoint:
    """One engine rank's resume point: ``engine`` and ``rank`` as configured, the
    index's ``worker`` id, the last applied ``seq`` and its payload ``fingerprint``, and
    whether the rank's history was ``complete`` when the snapshot was taken."""

    engine: str
    rank: int
    worker: tuple[str, int]
    seq: int
    fingerprint: int
    complete: bool


@dataclass(frozen=True)
class PeerSnapshot:
    """What ``GET /snapshot`` answers: the ``index`` bytes and the ``streams``' resume
    points, taken at one instant (``taken_at``, wall-clock seconds)."""

    index: bytes
    streams: tuple[StreamPoint, ...]
    taken_at: float

    def encode(self) -> bytes:
        """The document as bytes (msgpack)."""
        return msgspec.msgpack.encode(
            {
                "format": _FORMAT,
                "version": _VERSION,
                "taken_at": self.taken_at,
                "streams": [
                    [p.engine, p.rank, p.worker[0], p.worker[1], p.seq, p.fingerprint, p.complete]
                    for p in self.streams
                ],
                "index": self.index,
            }
        )

    @classmethod
    def decode(cls, data: bytes) -> PeerSnapshot:
        """A document from :meth:`encode` bytes; :class:`ConfigError` if it is not one."""
        try:
            doc = msgspec.msgpack.decode(data)
            if not isinstance(doc, dict) or doc.get("format") != _FORMAT:
                raise ConfigError("not a kvevents serve snapshot")
            if doc.get("version") != _VERSION:
                raise ConfigError(f"snapshot version {doc.get('version')!r}, expected {_VERSION}")
            streams = tuple(
                StreamPoint(str(e), int(r), (str(ws), int(wr)), int(q), int(fp), bool(c))
                for e, r, ws, wr, q, fp, c in doc["streams"]
            )
            index = doc["index"]
            if not isinstance(index, bytes):
                raise ConfigError("the snapshot's index is not bytes")
            return cls(index, streams, float(doc["taken_at"]))
        except ConfigError:
            raise
        except (msgspec.DecodeError, KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"not a kvevents serve snapshot: {exc}") from None


def fetch_snapshot(url: str, token: str | None = None, timeout_s: float = 60.0) -> PeerSnapshot:
    """``GET {url}/snapshot`` of a running ``kvevents serve`` (``url`` may already end
    in ``/snapshot``), with ``token`` as a bearer token when given.  Raises
    :class:`ConfigError` with the reason when it cannot be had."""
    import httpx

    base = url.rstrip("/")
    target = base if base.endswith("/snapshot") else base + "/snapshot"
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        r = httpx.get(target, headers=headers, timeout=timeout_s)
    except httpx.HTTPError as exc:
        raise ConfigError(f"cannot bootstrap from {target}: {exc}") from None
    if r.status_code != 200:
        raise ConfigError(
            f"cannot bootstrap from {target}: HTTP {r.status_code} {r.text[:200].strip()}"
        )
    return PeerSnapshot.decode(r.content)


def is_loopback(host: str) -> bool:
    """Whether listening on ``host`` is reachable from this machine only."""
    if host in ("localhost", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
