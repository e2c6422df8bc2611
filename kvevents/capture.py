"""Capture files: every received frame, kept losslessly, append-only and streamable.

Layout (all integers big-endian)::

    file    = header record*
    header  = MAGIC (8 bytes, b"KVEVCAP\\x00") version:u16 meta_len:u32 meta
    meta    = msgpack map {"format_version", "created", "tool", ...user keys}
    record  = body_len:u32 crc32(body):u32 body
    body    = msgpack array [recv_ts: float, source: str, topic: bin, seq: int, payload: bin,
                             replayed: bool]

``payload`` is the raw payload frame exactly as received (never re-encoded); ``seq`` is
the live seq, or -1 when the frame had none.  A record is written with one ``write``
call and the file is flushed per record by default, so a crash leaves at most one
truncated record at the tail.  :class:`CaptureReader` stops at the first truncated or
corrupt record, keeps every good record before it and reports the problem in
:attr:`CaptureReader.tail_error`.
"""

from __future__ import annotations

import os
import struct
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, Any

import msgspec

from kvevents.errors import CaptureError

__all__ = [
    "CAPTURE_FORMAT_VERSION",
    "CAPTURE_MAGIC",
    "CaptureContents",
    "CaptureReader",
    "CaptureRecord",
    "CaptureWriter",
    "read_capture",
]

CAPTURE_MAGIC = b"KVEVCAP\x00"
CAPTURE_FORMAT_VERSION = 1
_HEADER = struct.Struct(">8sHI")
_RECORD = struct.Struct(">II")
_MAX_RECORD = 1 << 30  # 1 GiB: anything larger is a corrupt length


class CaptureRecord(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """One received frame.

    ``recv_ts`` is the receive wall-clock time (seconds since the epoch); ``source`` the
    endpoint (or other source name) it came from; ``seq`` the live seq or -1;
    ``replayed`` is true for batches obtained through replay rather than live.
    """

    recv_ts: float
    source: str
    topic: bytes
    seq: int
    payload: bytes
    replayed: bool = False


_ENC = msgspec.msgpack.Encoder()
_REC_DEC = msgspec.msgpack.Decoder(CaptureRecord)


class CaptureWriter:
    """Append records to a capture file.

    A new file gets a header; ``append=True`` on an existing capture continues it after
    its last good record (a corrupt tail is cut off).  Each record is flushed when
    ``flush_every`` records have been written (default: every record).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        append: bool = False,
        meta: dict[str, Any] | None = None,
        flush_every: int = 1,
    ) -> None:
        self.path = Path(path)
        self.records_written = 0
        self._flush_every = max(1, flush_every)
        self._pending = 0
        if append and self.path.exists() and self.path.stat().st_size > 0:
            with CaptureReader(self.path) as reader:
                for _ in reader:
                    pass
                good = reader.good_bytes
            self._fh: IO[bytes] = open(self.path, "r+b")  # noqa: SIM115 - closed in close()
            self._fh.truncate(good)
            self._fh.seek(good)
        else:
            self._fh = open(self.path, "wb")  # noqa: SIM115 - closed in close()
            header_meta = {
                "format_version": CAPTURE_FORMAT_VERSION,
                "created": time.time(),
                "tool": "kvevents",
            }
            header_meta.update(meta or {})
            blob = _ENC.encode(header_meta)
            self._fh.write(_HEADER.pack(CAPTURE_MAGIC, CAPTURE_FORMAT_VERSION, len(blob)) + blob)
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
    ) -> None:
        """Append one frame.  ``payload`` is stored byte for byte."""
        rec = CaptureRecord(
            time.time() if recv_ts is None else recv_ts,
            source,
            bytes(topic),
            seq,
            bytes(payload),
            replayed,
        )
        self.write_record(rec)

    def write_record(self, rec: CaptureRecord) -> None:
        """Append one :class:`CaptureRecord`."""
        body = _ENC.encode(rec)
        self._fh.write(_RECORD.pack(len(body), zlib.crc32(body)) + body)
        self.records_written += 1
        self._pending += 1
        if self._pending >= self._flush_every:
            self.flush()

    def flush(self) -> None:
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
    """Iterate the records of a capture file, streaming.

    Raises :class:`CaptureError` if the file is not a capture (bad magic or an
    unsupported version).  A truncated or corrupt record ends iteration; the reason is
    then in :attr:`tail_error` and :attr:`good_bytes` is the offset after the last good
    record.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.tail_error: str | None = None
        self.records_read = 0
        try:
            self._fh: IO[bytes] = open(self.path, "rb")  # noqa: SIM115 - closed in close()
        except OSError as exc:
            raise CaptureError(f"{self.path}: cannot open: {exc.strerror or exc}") from exc
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
        blob = self._fh.read(meta_len)
        try:
            meta = msgspec.msgpack.decode(blob)
        except msgspec.DecodeError as exc:
            self._fh.close()
            raise CaptureError(f"{self.path}: corrupt header: {exc}") from exc
        self.meta: dict[str, Any] = meta if isinstance(meta, dict) else {}
        self.version = version
        self.good_bytes = _HEADER.size + meta_len

    def __iter__(self) -> Iterator[CaptureRecord]:
        fh = self._fh
        while True:
            head = fh.read(_RECORD.size)
            if not head:
                return
            where = f"record {self.records_read + 1} at byte {self.good_bytes}"
            if len(head) < _RECORD.size:
                self.tail_error = f"truncated {where}: incomplete record header"
                return
            length, crc = _RECORD.unpack(head)
            if length > _MAX_RECORD:
                self.tail_error = f"corrupt {where}: implausible length {length}"
                return
            body = fh.read(length)
            if len(body) < length:
                self.tail_error = f"truncated {where}: {len(body)} of {length} bytes"
                return
            if zlib.crc32(body) != crc:
                self.tail_error = f"corrupt {where}: checksum mismatch"
                return
            try:
                rec = _REC_DEC.decode(body)
            except msgspec.MsgspecError as exc:
                self.tail_error = f"corrupt {where}: {exc}"
                return
            self.records_read += 1
            self.good_bytes += _RECORD.size + length
            yield rec

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


def read_capture(path: str | os.PathLike[str]) -> CaptureContents:
    """Read a whole capture into memory."""
    with CaptureReader(path) as reader:
        records = list(reader)
        return CaptureContents(reader.meta, records, reader.tail_error)
