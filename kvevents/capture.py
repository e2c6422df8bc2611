"""Capture files: every received frame, kept losslessly, append-only and streamable.

Layout (all integers big-endian)::

    file    = header record*
    header  = MAGIC (8 bytes, b"KVEVCAP\\x00") version:u16 meta_len:u32 meta
    meta    = msgpack map {"format_version", "created", "tool", ...user keys}
    record  = body_len:u32 crc32(body):u32 body
    body    = msgpack array [recv_ts: float, source: str, topic: bin, seq: int, payload: bin,
                             replayed: bool, flags: int]

``payload`` is the raw payload frame exactly as received (never re-encoded); ``seq`` is
the live seq, or -1 when the frame had none; ``flags`` (format version 2) marks records
such as a payload that did not decode (:data:`FLAG_UNDECODABLE`) or a message without
the ``[topic, seq, payload]`` shape, whose ``payload`` then holds every part of it
(:data:`FLAG_MALFORMED`).  Version-1 bodies have
no ``flags`` element (read as 0).

A record is written with one ``write`` call and the file is flushed per record by
default, so a crash leaves at most one torn record at the tail.  :class:`CaptureReader`
never stops at damage: after a truncated or corrupt record it scans forward for the next
valid record (a plausible header whose CRC matches a body that decodes) and goes on,
reporting each skipped byte range in :attr:`CaptureReader.skipped`.
"""

from __future__ import annotations

import os
import struct
import time
import zlib
from collections.abc import Generator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO, Any

import msgspec

from kvevents.errors import CaptureError

__all__ = [
    "CAPTURE_FORMAT_VERSION",
    "CAPTURE_MAGIC",
    "FLAG_MALFORMED",
    "FLAG_UNDECODABLE",
    "CaptureContents",
    "CaptureReader",
    "CaptureRecord",
    "CaptureWriter",
    "SkippedRange",
    "pack_parts",
    "read_capture",
    "unpack_parts",
]

CAPTURE_MAGIC = b"KVEVCAP\x00"
CAPTURE_FORMAT_VERSION = 2
"""Written by this version; versions 1 and 2 are read."""
FLAG_UNDECODABLE = 1
"""Record flag: the payload did not decode as a KV event batch (kept byte for byte)."""
FLAG_MALFORMED = 2
"""Record flag: the message was not ``[topic, seq (8 bytes), payload]`` (a wrong number
of parts, a seq part of the wrong size, or a replay reply of the wrong shape).  ``seq``
is -1 and ``payload`` holds every part as received, packed by :func:`pack_parts`
(:func:`unpack_parts` gives them back)."""
_HEADER = struct.Struct(">8sHI")
_RECORD = struct.Struct(">II")
_MAX_RECORD = 1 << 30  # 1 GiB: anything larger is a corrupt length
_SCAN_CHUNK = 1 << 20  # bytes read at a time while resynchronising
# A record body is a msgpack fixarray of 6 (version 1) or 7 (version 2) elements.
_BODY_MARKERS = (b"\x96", b"\x97")


class CaptureRecord(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """One received frame.

    ``recv_ts`` is the receive wall-clock time (seconds since the epoch); ``source`` the
    endpoint (or other source name) it came from; ``seq`` the live seq or -1;
    ``replayed`` is true for batches obtained through replay rather than live;
    ``flags`` is a bit set (:data:`FLAG_UNDECODABLE`).
    """

    recv_ts: float
    source: str
    topic: bytes
    seq: int
    payload: bytes
    replayed: bool = False
    flags: int = 0

    @property
    def undecodable(self) -> bool:
        """True if the recorder could not decode the payload (it is kept as received)."""
        return bool(self.flags & FLAG_UNDECODABLE)

    @property
    def replay_end(self) -> bool:
        """True for a recorded end of a replay: seq -1, an empty payload, flagged
        ``replayed`` and nothing else (a reader of the capture ends the replay there)."""
        return self.seq < 0 and self.replayed and not self.payload and not self.flags

    @property
    def malformed(self) -> bool:
        """True if the message did not have the ``[topic, seq, payload]`` shape; its parts
        are in :attr:`payload` (see :func:`unpack_parts`)."""
        return bool(self.flags & FLAG_MALFORMED)


def pack_parts(parts: list[bytes]) -> bytes:
    """The parts of a malformed multipart message as one payload (a msgpack array of
    bin; never empty, so it is never mistaken for a recorded end-of-replay marker)."""
    return _ENC.encode([bytes(p) for p in parts])


def unpack_parts(payload: bytes) -> list[bytes]:
    """The parts :func:`pack_parts` packed, byte for byte.  Raises :class:`CaptureError`
    when ``payload`` is not such a packing."""
    try:
        return _PARTS_DEC.decode(payload)
    except msgspec.DecodeError as exc:
        raise CaptureError(f"not a packed multipart message: {exc}") from None


@dataclass(frozen=True)
class SkippedRange:
    """Bytes ``start`` (inclusive) to ``end`` (exclusive) of a capture that held no
    readable record, and why reading the record at ``start`` failed."""

    start: int
    end: int
    reason: str

    def __str__(self) -> str:
        return (
            f"skipped bytes {self.start}..{self.end} ({self.end - self.start} bytes): {self.reason}"
        )


_ENC = msgspec.msgpack.Encoder()
_REC_DEC = msgspec.msgpack.Decoder(CaptureRecord)
_PARTS_DEC = msgspec.msgpack.Decoder(list[bytes])


def _header(meta: dict[str, Any] | None) -> bytes:
    header_meta = {
        "format_version": CAPTURE_FORMAT_VERSION,
        "created": time.time(),
        "tool": "kvevents",
    }
    header_meta.update(meta or {})
    blob = _ENC.encode(header_meta)
    return _HEADER.pack(CAPTURE_MAGIC, CAPTURE_FORMAT_VERSION, len(blob)) + blob


class CaptureWriter:
    """Append records to a capture file.

    A new file gets a header.  ``append=True`` on an existing capture continues it at its
    end: nothing already in the file is cut or rewritten (a damaged region or torn tail
    stays where it is and readers skip it), except that a version-1 header's version
    field becomes 2.  Without ``append``, an existing file is replaced, or refused with
    :class:`CaptureError` when ``overwrite=False``.  Records are flushed every
    ``flush_every`` records (default: every record).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        append: bool = False,
        meta: dict[str, Any] | None = None,
        flush_every: int = 1,
        overwrite: bool = True,
    ) -> None:
        self.path = Path(path)
        self.records_written = 0
        self._flush_every = max(1, flush_every)
        self._pending = 0
        if append and self.path.exists() and self.path.stat().st_size > 0:
            with CaptureReader(self.path) as reader:  # refuses a file that is no capture
                for _ in reader:
                    pass
                version = reader.version
                torn = reader.torn_tail()
            self._fh: IO[bytes] = open(self.path, "r+b")  # noqa: SIM115 - closed in close()
            if version < CAPTURE_FORMAT_VERSION:
                self._fh.seek(8)
                self._fh.write(CAPTURE_FORMAT_VERSION.to_bytes(2, "big"))
            if torn is not None:
                # An incomplete last record (a write cut short) holds no intact record and
                # would swallow the first appended bytes; it is the only thing cut.
                self._fh.truncate(torn)
            self._fh.seek(0, os.SEEK_END)
        else:
            try:
                self._fh = open(self.path, "wb" if overwrite else "xb")  # noqa: SIM115
            except FileExistsError:
                raise CaptureError(f"{self.path} already exists") from None
            self._fh.write(_header(meta))
            self._fh.flush()

    def write(
        self,
        source: str,
        topic: bytes,
        seq: int,
        payload: bytes,
        *,
        recv_ts: float | None = None,
        replayed: bool = False,
        flags: int = 0,
    ) -> None:
        """Append one frame.  ``payload`` is stored byte for byte."""
        rec = CaptureRecord(
            time.time() if recv_ts is None else recv_ts,
            source,
            bytes(topic),
            seq,
            bytes(payload),
            replayed,
            flags,
        )
        self.write_record(rec)

    def write_record(self, rec: CaptureRecord) -> None:
        """Append one :class:`CaptureRecord` (:class:`CaptureError` after :meth:`close`)."""
        if self._fh.closed:
            raise CaptureError(f"{self.path}: the capture writer is closed")
        body = _ENC.encode(rec)
        self._fh.write(_RECORD.pack(len(body), zlib.crc32(body)) + body)
        self.records_written += 1
        self._pending += 1
        if self._pending >= self._flush_every:
            self.flush()

    def flush(self) -> None:
        """Write buffered records to the file (no-op after :meth:`close`)."""
        if self._fh.closed:
            return
        self._fh.flush()
        self._pending = 0

    def close(self) -> None:
        if not self._fh.closed:
            self._fh.flush()
            self._fh.close()

    def __enter__(self) -> CaptureWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class CaptureReader:
    """Iterate the records of a capture file, streaming, past any damage.

    Raises :class:`CaptureError` if the file is not a capture (bad magic or an
    unsupported version).  A damaged metadata blob is reported as a skipped range (and
    :attr:`meta` is empty).  After a record that is truncated, has an implausible length,
    fails its checksum or does not decode, the reader scans forward for the next valid
    record and continues there; every skipped range is appended to :attr:`skipped` as it
    is found.  :attr:`tail_error` describes a damaged or torn end of file (the last
    skipped range reaches the end), else None.  :attr:`good_bytes` is the offset just
    after the last good record read.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.tail_error: str | None = None
        self.skipped: list[SkippedRange] = []
        self.records_read = 0
        try:
            self._fh: IO[bytes] = open(self.path, "rb")  # noqa: SIM115 - closed in close()
        except OSError as exc:
            raise CaptureError(f"{self.path}: cannot open: {exc.strerror or exc}") from exc
        self._size = os.fstat(self._fh.fileno()).st_size
        head = self._fh.read(_HEADER.size)
        if len(head) < _HEADER.size or head[:8] != CAPTURE_MAGIC:
            self._fh.close()
            raise CaptureError(f"{self.path}: not a kvevents capture (bad magic)")
        _, version, meta_len = _HEADER.unpack(head)
        if version > CAPTURE_FORMAT_VERSION:
            self._fh.close()
            raise CaptureError(
                f"{self.path}: capture format version {version} is newer than this kvevents "
                f"reads ({CAPTURE_FORMAT_VERSION})"
            )
        self.version = version
        self.meta: dict[str, Any] = {}
        self._resync_from: int | None = None
        self._damage = ""
        blob = self._fh.read(meta_len) if meta_len <= _MAX_RECORD else b""
        try:
            if len(blob) < meta_len or meta_len > _MAX_RECORD:
                raise msgspec.DecodeError("truncated")
            meta = msgspec.msgpack.decode(blob)
            if not isinstance(meta, dict):
                raise msgspec.DecodeError("not a map")
            self.meta = meta
            self.good_bytes = _HEADER.size + meta_len
        except msgspec.DecodeError as exc:
            # the records may still be intact: find the first one
            self.good_bytes = _HEADER.size
            self._resync_from = _HEADER.size
            self._damage = f"corrupt header metadata: {exc}"

    def __iter__(self) -> Iterator[CaptureRecord]:
        if self._fh.closed:
            raise CaptureError(f"{self.path}: the capture reader is closed")
        return self._records()

    def _records(self) -> Iterator[CaptureRecord]:
        fh = self._fh
        pos = self.good_bytes
        if self._resync_from is not None:
            pos = yield from self._resync(self._resync_from, self._damage)
            if pos < 0:
                return
        fh.seek(pos)
        while True:
            head = fh.read(_RECORD.size)
            if not head:
                return
            where = f"record {self.records_read + 1} at byte {pos}"
            problem = None
            body = b""
            if len(head) < _RECORD.size:
                problem = f"truncated {where}: incomplete record header"
            else:
                length, crc = _RECORD.unpack(head)
                if length > _MAX_RECORD:
                    problem = f"corrupt {where}: implausible length {length}"
                else:
                    body = fh.read(length)
                    if len(body) < length:
                        problem = f"truncated {where}: {len(body)} of {length} bytes"
                    elif zlib.crc32(body) != crc:
                        problem = f"corrupt {where}: checksum mismatch"
            rec = None
            if problem is None:
                try:
                    rec = _REC_DEC.decode(body)
                except msgspec.MsgspecError as exc:
                    problem = f"corrupt {where}: {exc}"
            if rec is None:
                pos = yield from self._resync(pos, problem or "corrupt")
                if pos < 0:
                    return
                fh.seek(pos)
                continue
            self.records_read += 1
            pos += _RECORD.size + len(body)
            self.good_bytes = pos
            yield rec

    def _resync(self, start: int, reason: str) -> Generator[CaptureRecord, None, int]:
        """Scan from ``start + 1`` for the next valid record; yield it, record the skipped
        range, and return the offset after it (or -1 at the end of the file)."""
        fh = self._fh
        size = max(self._size, os.fstat(fh.fileno()).st_size)
        base = start + 1
        while base < size:
            fh.seek(base)
            window = fh.read(_SCAN_CHUNK + _RECORD.size)
            if not window:
                break
            limit = min(len(window), _SCAN_CHUNK)
            # candidates: a body marker byte at offset 8 from a record start
            cands: list[int] = []
            for marker in _BODY_MARKERS:
                i = window.find(marker, _RECORD.size)
                while i != -1 and i - _RECORD.size < limit:
                    cands.append(i - _RECORD.size)
                    i = window.find(marker, i + 1)
            for off in sorted(cands):
                cand = base + off
                found = self._try_record(cand, size)
                if found is not None:
                    rec, end = found
                    self.skipped.append(SkippedRange(start, cand, reason))
                    self.records_read += 1
                    self.good_bytes = end
                    yield rec
                    return end
            base += limit
        self.skipped.append(SkippedRange(start, size, reason))
        self.tail_error = reason
        return -1

    def torn_tail(self) -> int | None:
        """After iterating: the offset where an incomplete last record starts (its header
        is short or its length runs past the end of the file and no valid record follows
        it), or None.  A complete but corrupt last record is not torn."""
        if not self.skipped or self.tail_error is None:
            return None
        start = self.skipped[-1].start
        size = os.fstat(self._fh.fileno()).st_size
        if self.skipped[-1].end != size or start < self.good_bytes:
            return None
        self._fh.seek(start)
        head = self._fh.read(_RECORD.size)
        if len(head) < _RECORD.size:
            return start
        length, _ = _RECORD.unpack(head)
        return start if start + _RECORD.size + length > size else None

    def _try_record(self, pos: int, size: int) -> tuple[CaptureRecord, int] | None:
        fh = self._fh
        fh.seek(pos)
        head = fh.read(_RECORD.size)
        if len(head) < _RECORD.size:
            return None
        length, crc = _RECORD.unpack(head)
        if length > _MAX_RECORD or pos + _RECORD.size + length > size:
            return None
        body = fh.read(length)
        if len(body) < length or zlib.crc32(body) != crc:
            return None
        try:
            rec = _REC_DEC.decode(body)
        except msgspec.MsgspecError:
            return None
        return rec, pos + _RECORD.size + length

    def close(self) -> None:
        self._fh.close()

    def __enter__(self) -> CaptureReader:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


@dataclass
class CaptureContents:
    """Everything in a capture, read at once (for small files and tests)."""

    meta: dict[str, Any]
    records: list[CaptureRecord]
    tail_error: str | None
    skipped: list[SkippedRange] = field(default_factory=list)


def read_capture(path: str | os.PathLike[str]) -> CaptureContents:
    """Read a whole capture into memory (past any damage; see :attr:`CaptureContents.skipped`)."""
    with CaptureReader(path) as reader:
        records = list(reader)
        return CaptureContents(reader.meta, records, reader.tail_error, list(reader.skipped))
