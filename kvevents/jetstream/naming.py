"""How batches are laid out in a JetStream stream: subjects, headers and message ids.

Each batch is one message whose data is the batch's raw payload bytes exactly as the
engine published them (never re-encoded), on subject ``kvevents.<engine>.<rank>``, with
headers:

* ``Kvevents-Source``: the engine name; ``Kvevents-Topic``: the ZMQ topic it came with;
* ``Kvevents-Rank``: the batch's ``data_parallel_rank``; ``Kvevents-Seq``: its ZMQ seq;
* ``Kvevents-Epoch``: which life of that publisher the seq belongs to (bumped on every
  detected publisher restart);
* ``Nats-Msg-Id = <engine>:<rank>:<epoch>:<seq>``, so JetStream drops a batch that a
  restarted or redundant relay appends again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvevents.errors import ConfigError

__all__ = [
    "DEFAULT_STREAM",
    "HDR_EPOCH",
    "HDR_RANK",
    "HDR_SEQ",
    "HDR_SOURCE",
    "HDR_TOPIC",
    "SUBJECT_PREFIX",
    "BatchHeaders",
    "msg_id",
    "subject_for",
]

DEFAULT_STREAM = "KV_EVENTS"
SUBJECT_PREFIX = "kvevents"
HDR_SOURCE = "Kvevents-Source"
HDR_TOPIC = "Kvevents-Topic"
HDR_RANK = "Kvevents-Rank"
HDR_SEQ = "Kvevents-Seq"
HDR_EPOCH = "Kvevents-Epoch"
HDR_MSG_ID = "Nats-Msg-Id"


def subject_for(engine: str, rank: int) -> str:
    """``kvevents.<engine>.<rank>``."""
    return f"{SUBJECT_PREFIX}.{engine}.{rank}"


def msg_id(engine: str, rank: int, epoch: int, seq: int) -> str:
    """JetStream's de-duplication id of one batch: ``<engine>:<rank>:<epoch>:<seq>``."""
    return f"{engine}:{rank}:{epoch}:{seq}"


@dataclass(frozen=True, slots=True)
class BatchHeaders:
    """The kvevents headers of one stored batch."""

    source: str
    topic: bytes
    rank: int
    seq: int
    epoch: int

    def to_nats(self) -> dict[str, str]:
        """Header map for ``js.publish`` (topic bytes are written as latin-1 text)."""
        return {
            HDR_SOURCE: self.source,
            HDR_TOPIC: self.topic.decode("latin-1"),
            HDR_RANK: str(self.rank),
            HDR_SEQ: str(self.seq),
            HDR_EPOCH: str(self.epoch),
            HDR_MSG_ID: msg_id(self.source, self.rank, self.epoch, self.seq),
        }

    @classmethod
    def from_nats(cls, headers: dict[str, Any] | None) -> BatchHeaders:
        """Read the headers of a stored batch; :class:`ConfigError` if any is missing or bad."""
        if not headers:
            raise ConfigError("message has no kvevents headers")
        try:
            return cls(
                source=str(headers[HDR_SOURCE]),
                topic=str(headers.get(HDR_TOPIC, "")).encode("latin-1"),
                rank=int(headers[HDR_RANK]),
                seq=int(headers[HDR_SEQ]),
                epoch=int(headers[HDR_EPOCH]),
            )
        except (KeyError, ValueError, UnicodeEncodeError) as exc:
            raise ConfigError(f"bad kvevents headers {headers!r}: {exc}") from exc
