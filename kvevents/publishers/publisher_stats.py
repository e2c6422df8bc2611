"""The counters a :class:`~kvevents.publishers.zmq_publisher.ZmqEventPublisher` keeps.

One job: :class:`PublisherStats` (what was published, dropped, replayed or refused, with
units in the names) and :func:`count_drop`, the one way a lost batch is counted.
Imports only the standard library.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

__all__ = ["REFUSAL_REASONS", "PublisherStats", "count_drop"]

REFUSAL_REASONS = (
    "bad_frame_count",
    "bad_start_frame",
    "too_many_pending",
    "too_many_clients",
    "client_backlog",
    "memory",
)
"""Why a replay request got no reply (keys of ``PublisherStats.replay_refusals``)."""


@dataclass
class PublisherStats:
    """Counters of a :class:`ZmqEventPublisher` (units in the names).

    * ``batches_published`` / ``events_published``: handed to the PUB socket.  (PUB
      itself may still drop for a subscriber above its HWM; that is invisible here and
      shows downstream as a seq gap.)  At ``shutdown()`` the batches ZeroMQ could not
      confirm sent are moved from these counters to ``dropped_*``
      (``shutdown_unflushed``), so after shutdown they count batches that left.
    * ``dropped_batches`` / ``dropped_events``: lost, by reason in ``drop_reasons``:
      ``queue_full`` (``publish()`` found the queue full), ``encode_error``,
      ``send_error``, ``shutdown`` (still queued, or held for a collector that never
      subscribed, when the shutdown budget ran out), ``no_subscriber`` (connect mode:
      published before the collector's first subscription, beyond what may be held),
      ``shutdown_unflushed`` (sent to ZeroMQ but not confirmed taken by every connected
      subscriber's connection when the budget ran out).
    * ``encode_errors`` / ``send_errors``: batches lost to each failure.
    * ``replay_requests``: well-formed requests received (served or refused for
      capacity); ``replays_completed``: end markers sent; ``replay_batches_sent``:
      replayed batches sent; ``replays_truncated``: replies cut at
      ``replay_max_reply_bytes`` (the end marker follows; the client asks again).
    * ``replay_batches_dropped`` by reason in ``replay_drop_reasons``: ``client_gone``
      (disconnected), ``client_stalled`` (no progress for the stall timeout),
      ``shutdown``.  Each counts the replies (batches plus end marker) never sent.
    * ``replay_refusals``: requests that got no reply, by reason
      (:data:`REFUSAL_REASONS`): ``bad_frame_count`` (not 3 frames), ``bad_start_frame``
      (start not 8 bytes), ``too_many_pending`` (``max_pending_replays`` in progress),
      ``too_many_clients`` (``replay_max_clients`` peers being served),
      ``client_backlog`` (this peer has ``replay_max_client_bytes`` not yet taken),
      ``memory`` (``replay_max_bytes_in_flight`` reached).
      ``malformed_requests`` sums the first two, ``replay_requests_refused`` the rest.
    * ``replay_peer_disconnects``: replay peers whose connection ended, including those
      ZeroMQ dropped for a frame above ``replay_max_message_bytes``.
    * ``internal_errors``: unexpected exceptions in the sender thread (logged).
    * The live byte budget (what subscribers that stop reading can pin):
      ``live_subscribers`` (matching subscriptions now), ``live_hwm`` (the PUB socket's
      ``SNDHWM`` now, messages per subscriber), ``live_batch_bytes`` (the batch size
      seen), ``live_pinned_bytes_bound`` (what all subscribers' queues can hold at most
      with that size, bytes), ``live_recreations`` (times the PUB socket was re-created
      with another mark, by reason in ``live_recreation_reasons``: ``subscribers``,
      ``batch_size``, ``grow``) and ``live_budget_overruns`` (times that bound went
      above ``live_max_bytes_in_flight``, or one subscriber's share of it above
      ``live_max_client_bytes``, with no re-creation to fix it; each is a warning, once
      until neither is exceeded).
    * ``head_batches_held``: in connect mode, batches published before the collector's
      first subscription arrived and held until it did.
    * ``replay_buffer_bytes``: payload bytes in the replay ring now (at most
      ``replay_max_buffer_bytes``).
    """

    batches_published: int = 0
    events_published: int = 0
    dropped_batches: int = 0
    dropped_events: int = 0
    drop_reasons: Counter[str] = field(default_factory=Counter)
    encode_errors: int = 0
    send_errors: int = 0
    replay_requests: int = 0
    replays_completed: int = 0
    replay_batches_sent: int = 0
    replays_truncated: int = 0
    replay_batches_dropped: int = 0
    replay_drop_reasons: Counter[str] = field(default_factory=Counter)
    replay_requests_refused: int = 0
    malformed_requests: int = 0
    replay_refusals: Counter[str] = field(default_factory=Counter)
    replay_peer_disconnects: int = 0
    internal_errors: int = 0
    live_subscribers: int = 0
    live_hwm: int = 0
    live_budget_overruns: int = 0
    live_recreations: int = 0
    live_recreation_reasons: Counter[str] = field(default_factory=Counter)
    live_batch_bytes: int = 0
    live_pinned_bytes_bound: int = 0
    head_batches_held: int = 0
    replay_buffer_bytes: int = 0


def count_drop(stats: PublisherStats, reason: str, events: int, batches: int = 1) -> None:
    """Count ``batches`` lost batches holding ``events`` events under ``reason``.

    The caller holds the lock that guards ``stats``' drop counters (``publish()`` callers
    and the sender thread both count drops).
    """
    stats.dropped_batches += batches
    stats.dropped_events += events
    stats.drop_reasons[reason] += batches
