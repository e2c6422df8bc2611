"""A capture file (:mod:`kvevents.capture`) as a subscriber input.

One job: :class:`CaptureSource`.  A file cannot be asked for a replay; instead the
replayed frames that were recorded answer the gaps *in band* (``replay_inband``), so a
capture of a session that replayed reads back as the same applied stream.  May import
:mod:`kvevents.capture`, :mod:`kvevents.errors` and the source protocol.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvevents.capture import CaptureReader, SkippedRange
from kvevents.consumers.source_protocol import BAD_FRAME, LIVE, REPLAY_END, SourceMessage
from kvevents.errors import ConfigError

__all__ = ["CaptureSource"]


class CaptureSource:
    """The records of a capture file, as a source that is always ready until the end.

    Each record keeps its recorded ``source`` (as ``origin``), ``topic``, ``seq``, raw
    ``payload``, ``recv_ts`` and ``replayed`` flag.  A record with seq -1 and an empty
    payload that was flagged replayed is read as a recorded end-of-replay marker.  A
    damaged record is skipped (see :attr:`skipped`); a damaged or torn end is also in
    :attr:`tail_error`.
    """

    def __init__(self, path: str, *, name: str | None = None) -> None:
        self._reader = CaptureReader(path)
        self._iter = iter(self._reader)
        self._name = name or f"capture:{path}"
        self._done = False

    @property
    def name(self) -> str:
        return self._name

    @property
    def can_replay(self) -> bool:
        return False

    @property
    def replay_inband(self) -> bool:
        return True

    @property
    def exhausted(self) -> bool:
        return self._done

    @property
    def tail_error(self) -> str | None:
        """Why reading stopped early (truncated/corrupt tail), or None."""
        return self._reader.tail_error

    @property
    def bytes_read(self) -> int:
        """Bytes of the file read so far (header and good records): progress over the
        file's size."""
        return int(self._reader.good_bytes)

    @property
    def skipped(self) -> list[SkippedRange]:
        """Damaged byte ranges of the file skipped so far (reading goes on after each)."""
        return self._reader.skipped

    def sockets(self) -> Sequence[Any]:
        return []

    def receive(self, limit: int) -> list[SourceMessage]:
        out: list[SourceMessage] = []
        if self._done:
            return out
        for _ in range(limit):
            rec = next(self._iter, None)
            if rec is None:
                self._done = True
                self._reader.close()
                break
            if rec.seq < 0:
                if rec.replay_end:
                    out.append(
                        SourceMessage(REPLAY_END, rec.topic, -1, b"", rec.recv_ts, rec.source)
                    )
                else:
                    out.append(
                        SourceMessage(
                            BAD_FRAME,
                            recv_ts=rec.recv_ts,
                            origin=rec.source,
                            detail="capture record has no seq",
                        )
                    )
                continue
            out.append(
                SourceMessage(
                    LIVE, rec.topic, rec.seq, rec.payload, rec.recv_ts, rec.source, rec.replayed
                )
            )
        return out

    def request_replay(self, start: int) -> None:
        raise ConfigError(f"{self._name}: a capture answers replays in band")

    def cancel_replay(self) -> None:
        return None

    def close(self) -> None:
        if not self._done:
            self._done = True
            self._reader.close()

    def __repr__(self) -> str:
        return f"CaptureSource({self._reader.path!s})"
