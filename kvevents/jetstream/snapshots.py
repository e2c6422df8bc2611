"""Index snapshots in a JetStream object store, so a late router skips most of the stream.

A snapshot is one object in bucket ``KV_SNAPSHOTS`` (by default) named
``<stream>-<stream_seq:020d>``: a versioned msgspec envelope holding the stream name, the
:class:`~kvevents.jetstream.StreamPosition` the index reflects, when it was taken, and the
index's own snapshot bytes (:meth:`kvevents.consumers.BlockIndex.snapshot`).  Names sort
by position, so the newest snapshot is the last name.

* :class:`SnapshotStore` puts and gets snapshots;
* :class:`Snapshotter` follows the stream with an index of its own and stores a snapshot
  every ``every`` batches (``kvevents relay --snapshot-every N``);
* :func:`restore_latest` gives a router the newest snapshot's index and a reader that
  resumes right after it.
"""

from __future__ import annotations

import logging
import threading
import time
import zlib
from dataclasses import dataclass
from typing import Any

import msgspec

from kvevents.consumers.index import BlockIndex
from kvevents.consumers.subscriber import Anomaly, ReceivedBatch
from kvevents.errors import ConfigError
from kvevents.jetstream.connection import connect_jetstream
from kvevents.jetstream.loop import LoopThread
from kvevents.jetstream.naming import DEFAULT_STREAM
from kvevents.jetstream.reader import JetStreamSubscriber, StreamPosition

__all__ = [
    "DEFAULT_BUCKET",
    "SNAPSHOT_FORMAT_VERSION",
    "SnapshotEnvelope",
    "SnapshotStore",
    "Snapshotter",
    "restore_latest",
]

logger = logging.getLogger(__name__)

DEFAULT_BUCKET = "KV_SNAPSHOTS"
SNAPSHOT_FORMAT_VERSION = 1


class SnapshotEnvelope(msgspec.Struct, frozen=True):
    """What one stored snapshot holds (msgpack; ``version`` first)."""

    version: int
    stream: str
    stream_seq: int
    workers: list[tuple[str, int, int, int]]
    """``(engine, rank, epoch, seq)`` of the last batch applied per worker."""
    created_ts: float
    index: bytes
    """The index's :meth:`~kvevents.consumers.BlockIndex.snapshot` bytes, zlib-compressed."""

    @property
    def position(self) -> StreamPosition:
        return StreamPosition(self.stream_seq, {(s, r): (e, q) for s, r, e, q in self.workers})


_CHUNK = 1024 * 1024
_ENC = msgspec.msgpack.Encoder()
_DEC = msgspec.msgpack.Decoder(SnapshotEnvelope)


def _object_name(stream: str, stream_seq: int) -> str:
    return f"{stream}-{stream_seq:020d}"


class SnapshotStore:
    """Snapshots of stream ``stream`` in JetStream object-store bucket ``bucket``."""

    def __init__(
        self, url: str, stream: str = DEFAULT_STREAM, bucket: str = DEFAULT_BUCKET
    ) -> None:
        self.url = url
        self.stream = stream
        self.bucket = bucket
        self._loop = LoopThread("kvevents-snapshots")
        try:
            self._nc, self._obs = self._loop.run(self._open(), timeout_s=15)
        except BaseException:
            self._loop.close()
            raise

    async def _open(self) -> tuple[Any, Any]:
        from nats.js.errors import BucketNotFoundError

        nc = (await connect_jetstream(self.url)).nc  # one-line errors, quiet reconnects
        js = nc.jetstream()
        try:
            obs = await js.object_store(self.bucket)
        except BucketNotFoundError:
            obs = await js.create_object_store(self.bucket)
        return nc, obs

    def put(self, index: BlockIndex, position: StreamPosition) -> str:
        """Store a snapshot of ``index`` taken at ``position``; returns its object name."""
        env = SnapshotEnvelope(
            SNAPSHOT_FORMAT_VERSION,
            self.stream,
            position.stream_seq,
            [(s, r, e, q) for (s, r), (e, q) in sorted(position.workers.items())],
            time.time(),
            zlib.compress(index.snapshot(), 1),
        )
        name = _object_name(self.stream, position.stream_seq)
        self._loop.run(self._put(name, _ENC.encode(env)), timeout_s=120)
        return name

    async def _put(self, name: str, data: bytes) -> None:
        from nats.js import api

        # 1 MiB chunks (NATS' default max payload) instead of 128 KiB: reading a large
        # snapshot back is several times faster with fewer chunks
        options = api.ObjectMetaOptions(max_chunk_size=_CHUNK)
        await self._obs.put(name, data, meta=api.ObjectMeta(name=name, options=options))

    def names(self) -> list[str]:
        """Stored snapshot names of this stream, oldest first."""

        async def listing() -> list[str]:
            from nats.js.errors import NotFoundError

            try:
                infos = await self._obs.list()
            except NotFoundError:
                return []
            return sorted(
                i.name for i in infos if i.name.startswith(self.stream + "-") and not i.deleted
            )

        return self._loop.run(listing(), timeout_s=15)

    def get(self, name: str) -> SnapshotEnvelope:
        """Read snapshot ``name``; :class:`ConfigError` if it is not a snapshot we can read."""
        res = self._loop.run(self._obs.get(name), timeout_s=60)
        try:
            env = _DEC.decode(res.data)
        except msgspec.DecodeError as exc:
            raise ConfigError(f"snapshot {name} is not a kvevents snapshot: {exc}") from exc
        if env.version != SNAPSHOT_FORMAT_VERSION:
            raise ConfigError(
                f"snapshot {name} has format version {env.version}; this kvevents reads "
                f"{SNAPSHOT_FORMAT_VERSION}"
            )
        return env

    def latest(self) -> SnapshotEnvelope | None:
        """The newest snapshot, or None when there is none."""
        names = self.names()
        return self.get(names[-1]) if names else None

    def prune(self, keep: int) -> int:
        """Delete all but the newest ``keep`` snapshots; returns how many were deleted."""
        names = self.names()
        doomed = names[: max(0, len(names) - keep)]
        for name in doomed:
            self._loop.run(self._obs.delete(name), timeout_s=15)
        return len(doomed)

    def close(self) -> None:
        try:
            self._loop.run(self._nc.close(), timeout_s=5)
        except Exception:
            logger.debug("NATS close failed", exc_info=True)
        self._loop.close()

    def __enter__(self) -> SnapshotStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def apply_item(index: BlockIndex, item: ReceivedBatch | Anomaly) -> None:
    """What a router does with one reader item: apply a batch, reset on a reset anomaly."""
    if isinstance(item, Anomaly):
        if item.needs_reset and item.dp_rank is not None:
            index.reset_worker((item.source, item.dp_rank))
        return
    index.apply(item.source, item.dp_rank, item.batch)


@dataclass
class RestoredRouterState:
    """An index restored from a snapshot and a reader positioned right after it."""

    index: BlockIndex
    subscriber: JetStreamSubscriber
    snapshot: str | None


def restore_latest(
    url: str, stream: str = DEFAULT_STREAM, bucket: str = DEFAULT_BUCKET, **index_options: Any
) -> RestoredRouterState:
    """The newest readable snapshot's index and a reader that resumes after it.

    A snapshot this kvevents cannot read (another envelope or index format, as after an
    upgrade that changed the index's layout, or damaged bytes) is skipped with a warning
    naming it and why, and the next older one is tried; with none readable (or none at
    all) the index is empty (``index_options``) and the reader starts from the stream's
    first batch.  ``index_options`` apply only then: a restored index keeps the options
    it was snapshotted with."""
    with SnapshotStore(url, stream, bucket) as store:
        for name in reversed(store.names()):
            try:
                env = store.get(name)
                index = BlockIndex.restore(_inflate(name, env.index))
            except ConfigError as exc:
                logger.warning("skipping snapshot %s: %s", name, exc)
                continue
            reader = JetStreamSubscriber(url, stream, position=env.position)
            return RestoredRouterState(index, reader, name)
    return RestoredRouterState(BlockIndex(**index_options), JetStreamSubscriber(url, stream), None)


def _inflate(name: str, data: bytes) -> bytes:
    try:
        return zlib.decompress(data)
    except zlib.error as exc:
        raise ConfigError(f"snapshot {name} is damaged: {exc}") from exc


class Snapshotter:
    """Follow ``stream`` with an index and store a snapshot every ``every`` batches.

    The index is fed exactly as a router feeds it (:func:`apply_item`), so a restored
    snapshot equals what a router that read the stream up to the same position holds.
    Run :meth:`run` on a thread; set ``stop`` to end it.  Keeps the newest ``keep``.
    """

    def __init__(
        self,
        url: str,
        every: int,
        *,
        stream: str = DEFAULT_STREAM,
        bucket: str = DEFAULT_BUCKET,
        keep: int = 3,
        **index_options: Any,
    ) -> None:
        if every < 1:
            raise ConfigError(f"--snapshot-every must be >= 1 batch, not {every}")
        self.every = every
        self.keep = keep
        self.store = SnapshotStore(url, stream, bucket)
        state = restore_latest(url, stream, bucket, **index_options)
        self.index = state.index
        self.reader = state.subscriber
        self.taken = 0

    def run(self, stop: threading.Event) -> None:
        since = 0
        try:
            while not stop.is_set():
                item = self.reader.receive(timeout=0.2)
                if item is None:
                    continue
                apply_item(self.index, item)
                if isinstance(item, ReceivedBatch):
                    since += 1
                    if since >= self.every:
                        self.store.put(self.index, self.reader.position)
                        self.store.prune(self.keep)
                        self.taken += 1
                        since = 0
        finally:
            self.reader.close()
            self.store.close()
