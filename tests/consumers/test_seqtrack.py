"""The pure sequence tracker: examples, and a model check under generated faults.

The property test plays a publisher (epochs = process lifetimes, seq from 0 each, a
bounded replay buffer) through a lossy, duplicating, reordering network, serves the
tracker's replay requests late, partially interleaved or not at all, and then checks
what a consumer relies on:

* between two reset reports, delivered seqs strictly increase and come from one
  publisher lifetime, each exactly the batch published with that seq;
* nothing is both delivered and reported lost;
* no silent loss: after each reset, every seq from 0 up to the last one delivered (and,
  at the end, up to the last one published) was delivered or reported lost.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvevents.consumers.seqtrack import (
    DUPLICATE,
    GAP,
    PUBLISHER_RESTART,
    UNRECOVERABLE_LOSS,
    Deliver,
    Drop,
    Report,
    StartReplay,
    StreamTracker,
)

Item = tuple[int, int]  # (epoch, seq): also the fingerprint


def kinds(actions: list[Any]) -> list[str]:
    out = []
    for a in actions:
        if isinstance(a, Deliver):
            out.append(f"D{a.seq}{'r' if a.replayed else ''}")
        elif isinstance(a, Report):
            out.append(f"{a.kind}:{a.first_seq}-{a.last_seq}")
        elif isinstance(a, StartReplay):
            out.append(f"replay@{a.start}#{a.replay_id}")
        else:
            out.append(f"drop:{a.reason}")
    return out


def live(t: StreamTracker[Item], seq: int, epoch: int = 0) -> list[str]:
    return kinds(t.live(seq, (epoch, seq), (epoch, seq)))


def rep(t: StreamTracker[Item], rid: int, seq: int, epoch: int = 0) -> list[str]:
    return kinds(t.replayed(rid, seq, (epoch, seq), (epoch, seq)))


def test_in_order_stream_is_delivered():
    t: StreamTracker[Item] = StreamTracker()
    assert [live(t, s) for s in range(3)] == [["D0"], ["D1"], ["D2"]]
    assert t.last == 2 and not t.replaying


def test_gap_replay_merges_with_live_in_order():
    t: StreamTracker[Item] = StreamTracker()
    live(t, 0)
    assert live(t, 3) == ["gap:1-2", "replay@1#1"]
    assert live(t, 4) == []  # buffered while replaying
    assert rep(t, 1, 1) == ["D1r"]
    assert rep(t, 1, 2) == ["D2r", "D3", "D4"]
    assert rep(t, 1, 3) == ["drop:replay_overlap"]
    assert live(t, 5) == ["D5"]
    assert kinds(t.replay_end(1)) == []
    assert not t.replaying and t.last == 5


def test_first_replayed_seq_above_request_is_unrecoverable_loss():
    t: StreamTracker[Item] = StreamTracker()
    live(t, 0)
    live(t, 9)
    assert rep(t, 1, 6) == ["unrecoverable_loss:1-5", "D6r"]
    assert rep(t, 1, 8) == ["unrecoverable_loss:7-7", "D8r", "D9"]
    t2: StreamTracker[Item] = StreamTracker()
    live(t2, 0)
    live(t2, 9)
    assert kinds(t2.replay_end(1)) == ["unrecoverable_loss:1-8", "D9"]


def test_hole_inside_a_replay_is_reported_lost():
    # vLLM consumes a seq whose send failed without buffering it (C§2.1).
    t: StreamTracker[Item] = StreamTracker()
    live(t, 0)
    live(t, 5)
    assert rep(t, 1, 1) == ["D1r"]
    assert rep(t, 1, 3) == ["unrecoverable_loss:2-2", "D3r"]
    assert rep(t, 1, 4) == ["D4r", "D5"]


def test_duplicate_is_dropped_but_same_seq_with_other_content_is_a_restart():
    t: StreamTracker[Item] = StreamTracker()
    for s in range(5):
        live(t, s)
    assert live(t, 3) == [f"{DUPLICATE}:3-3"]
    assert live(t, 1, epoch=1) == [f"{PUBLISHER_RESTART}:1-4", "replay@0#2"]
    assert rep(t, 2, 0, epoch=1) == ["D0r", "D1"]


def test_restart_to_zero_is_followed_without_replay():
    t: StreamTracker[Item] = StreamTracker()
    for s in range(3):
        live(t, s)
    assert live(t, 0, epoch=1) == [f"{PUBLISHER_RESTART}:0-2", "D0"]
    assert live(t, 1, epoch=1) == ["D1"]


def test_restart_during_replay_discards_old_buffer_and_ignores_old_replies():
    t: StreamTracker[Item] = StreamTracker()
    live(t, 0)
    live(t, 4)
    report, deliver = t.live(0, (1, 0), (1, 0))
    assert isinstance(report, Report) and report.kind == PUBLISHER_RESTART
    assert "1 buffered batch(es) of the old stream discarded" in report.detail
    assert isinstance(deliver, Deliver) and deliver.item == (1, 0)
    assert rep(t, 1, 1) == ["drop:stale_replay"]
    assert kinds(t.replay_end(1)) == ["drop:stale_replay_end"]


def test_replay_failure_reports_holes_and_releases_buffer():
    t: StreamTracker[Item] = StreamTracker()
    live(t, 0)
    live(t, 2)
    live(t, 3)
    assert kinds(t.replay_failed(1, "timed out")) == ["unrecoverable_loss:1-1", "D2", "D3"]
    assert not t.replaying
    assert kinds(t.replay_failed(1, "again")) == []


def test_live_loss_after_the_request_triggers_a_second_replay():
    t: StreamTracker[Item] = StreamTracker()
    live(t, 0)
    live(t, 2)  # replay 1 from 1
    live(t, 5)  # 3, 4 lost on the live path while replay 1 runs
    assert rep(t, 1, 1) == ["D1r", "D2"]
    assert kinds(t.replay_end(1)) == ["gap:3-4", "replay@3#2"]
    assert rep(t, 2, 3) == ["D3r"]
    assert rep(t, 2, 4) == ["D4r", "D5"]


def test_replay_from_start_catches_up_and_reports_what_is_gone():
    t: StreamTracker[Item] = StreamTracker(replay_from_start=True)
    assert live(t, 7) == ["replay@0#1"]
    assert rep(t, 1, 4) == ["unrecoverable_loss:0-3", "D4r"]
    assert rep(t, 1, 5) == ["D5r"]
    assert kinds(t.replay_end(1)) == ["unrecoverable_loss:6-6", "D7"]


def test_too_much_buffered_abandons_the_replay():
    t: StreamTracker[Item] = StreamTracker(max_pending=3)
    live(t, 0)
    live(t, 2)
    live(t, 3)
    live(t, 4)
    assert live(t, 5) == ["unrecoverable_loss:1-1", "D2", "D3", "D4", "D5"]
    assert not t.replaying


def test_invalid_sizes_are_rejected():
    with pytest.raises(ValueError):
        StreamTracker(history=0)


# --- the model check -------------------------------------------------------------------


@st.composite
def scenarios(draw: st.DrawFn) -> dict[str, Any]:
    """A publisher schedule (epochs of lengths) with a fate for each published batch."""
    epochs = draw(st.lists(st.integers(1, 25), min_size=1, max_size=4))
    fates = []
    for e, n in enumerate(epochs):
        for s in range(n):
            # An epoch's seq 0 must reach the subscriber, else a restart is invisible on
            # vLLM's wire (the new stream would look like a continuation): documented.
            if e > 0 and s == 0:
                fates.append("ok")
            else:
                fates.append(draw(st.sampled_from(["ok", "ok", "ok", "drop", "dup", "swap"])))
    return {
        "epochs": epochs,
        "fates": fates,
        "buffer": draw(st.integers(1, 30)),
        "history": draw(st.sampled_from([2, 8, 4096])),
    }


def arrivals(epochs: list[int], fates: list[str]) -> list[tuple[int, int, int]]:
    """Network arrival order: (epoch, seq, publish index).  Swaps never cross epochs."""
    pubs = [(e, s) for e, n in enumerate(epochs) for s in range(n)]
    out: list[tuple[int, int, int]] = []
    held: tuple[int, int, int] | None = None
    for i, ((e, s), fate) in enumerate(zip(pubs, fates)):
        msg = (e, s, i)
        if held is not None and held[0] != e:
            out.append(held)
            held = None
        if fate == "drop":
            pass
        elif fate == "dup":
            out += [msg, msg]
        elif fate == "swap" and held is None:
            held = msg
            continue
        else:
            out.append(msg)
        if held is not None:
            out.append(held)
            held = None
    if held is not None:
        out.append(held)
    # The last batch of the last epoch always arrives last (so the tail is noticed).
    last = (len(epochs) - 1, epochs[-1] - 1, len(pubs) - 1)
    out.append(last)
    return out


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sc=scenarios(), data=st.data())
def test_model_no_silent_loss(sc: dict[str, Any], data: st.DataObject) -> None:
    epochs, buffer_steps = sc["epochs"], sc["buffer"]
    pubs = [(e, s) for e, n in enumerate(epochs) for s in range(n)]
    tracker: StreamTracker[Item] = StreamTracker(replay_from_start=True, history=sc["history"])
    out: list[Any] = []
    # Replays waiting to be served: (replay_id, replies still to feed, serve mode).
    in_flight: deque[tuple[int, deque[int], str, int]] = deque()
    published_upto = -1

    def snapshot(start: int) -> deque[int]:
        """What the publisher's replay buffer holds >= start right now."""
        e = pubs[published_upto][0]
        seqs = [s for (pe, s) in pubs[: published_upto + 1] if pe == e][-buffer_steps:]
        return deque(s for s in seqs if s >= start)

    def apply(actions: list[Any]) -> None:
        for a in actions:
            out.append(a)
            if isinstance(a, StartReplay):
                mode = data.draw(st.sampled_from(["ok", "ok", "ok", "fail"]), label="mode")
                in_flight.append((a.replay_id, snapshot(a.start), mode, pubs[published_upto][0]))

    def serve_some() -> None:
        """Feed part of the oldest replay: a few replies, maybe its end."""
        if not in_flight:
            return
        rid, replies, mode, epoch = in_flight[0]
        if mode == "fail":
            in_flight.popleft()
            apply(tracker.replay_failed(rid, "timed out"))
            return
        for _ in range(data.draw(st.integers(0, 3), label="replies")):
            if not replies:
                break
            s = replies.popleft()
            apply(tracker.replayed(rid, s, (epoch, s), (epoch, s)))
        if not replies and data.draw(st.booleans(), label="end"):
            in_flight.popleft()
            apply(tracker.replay_end(rid))

    for e, s, idx in arrivals(epochs, sc["fates"]):
        published_upto = max(published_upto, idx)
        if in_flight and data.draw(st.booleans(), label="serve first"):
            serve_some()
        apply(tracker.live(s, (e, s), (e, s)))
    published_upto = len(pubs) - 1
    for _ in range(1000):  # finish every replay (each may ask for another)
        if not in_flight:
            break
        rid, replies, mode, epoch = in_flight.popleft()
        if mode == "fail":
            apply(tracker.replay_failed(rid, "timed out"))
            continue
        for s in replies:
            apply(tracker.replayed(rid, s, (epoch, s), (epoch, s)))
        apply(tracker.replay_end(rid))
    assert not tracker.replaying

    # --- check the output against the model ---------------------------------------
    published = set(pubs)
    segments: list[list[Any]] = [[]]
    for a in out:
        if isinstance(a, Report) and a.kind == PUBLISHER_RESTART:
            segments.append([])
        else:
            segments[-1].append(a)
    for i, seg in enumerate(segments):
        delivered = [a for a in seg if isinstance(a, Deliver)]
        seqs = [a.seq for a in delivered]
        assert seqs == sorted(set(seqs)), f"order/duplicates in segment {i}: {kinds(seg)}"
        assert len({a.item[0] for a in delivered}) <= 1, f"mixed lifetimes: {kinds(seg)}"
        for a in delivered:
            assert a.item[1] == a.seq and a.item in published
        lost: set[int] = set()
        for a in seg:
            if isinstance(a, Report) and a.kind == UNRECOVERABLE_LOSS:
                assert a.first_seq is not None and a.last_seq is not None
                lost.update(range(a.first_seq, a.last_seq + 1))
        assert not lost & set(seqs), f"delivered and lost: {kinds(seg)}"
        top = max(seqs, default=-1)
        if i == len(segments) - 1:
            top = max(top, epochs[-1] - 1)
            assert delivered and delivered[-1].item == (len(epochs) - 1, epochs[-1] - 1)
        missing = set(range(top + 1)) - set(seqs) - lost
        assert not missing, f"silent loss of {sorted(missing)} in segment {i}: {kinds(seg)}"
    for a in out:
        assert not isinstance(a, Drop) or a.reason in {
            "replay_overlap",
            "stale_replay",
            "stale_replay_end",
            "replay_mismatch",
        }
        assert not isinstance(a, Report) or a.kind in {
            GAP,
            DUPLICATE,
            PUBLISHER_RESTART,
            UNRECOVERABLE_LOSS,
        }
