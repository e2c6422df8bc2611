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

from kvevents.seqtrack import (
    DISOWNED_SEQ,
    DUPLICATE,
    GAP,
    HISTORY_MISSED,
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
            forged = "f" if isinstance(a.item, tuple) and a.item[0] == 99 else ""
            out.append(f"D{a.seq}{'r' if a.replayed else ''}{forged}")
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


def test_gap_replay_starts_at_the_last_applied_seq_and_merges_with_live():
    t: StreamTracker[Item] = StreamTracker()
    live(t, 0)
    assert live(t, 3) == ["gap:1-2", "replay@0#1"]
    assert live(t, 4) == []  # buffered while replaying
    assert rep(t, 1, 0) == ["drop:replay_overlap"]  # identity checked
    assert rep(t, 1, 1) == ["D1r"]
    assert rep(t, 1, 2) == ["D2r", "D3", "D4"]
    assert rep(t, 1, 3) == ["drop:replay_overlap"]
    assert live(t, 5) == ["D5"]
    assert kinds(t.replay_end(1)) == []
    assert not t.replaying and t.last == 5


def test_ring_skipping_seqs_the_live_path_passed_is_unrecoverable_loss():
    t: StreamTracker[Item] = StreamTracker()
    live(t, 0)
    live(t, 9)
    assert rep(t, 1, 6) == ["unrecoverable_loss:1-5", "D6r"]
    assert rep(t, 1, 8) == ["unrecoverable_loss:7-7", "D8r", "D9"]
    t2: StreamTracker[Item] = StreamTracker()
    live(t2, 0)
    live(t2, 9)
    assert rep(t2, 1, 0) == ["drop:replay_overlap"]
    assert kinds(t2.replay_end(1)) == ["unrecoverable_loss:1-8", "D9"]


def test_backlog_deeper_than_the_ring_invents_no_loss():
    # The live path still holds 7..19999 when the ring already starts at 20000.
    t: StreamTracker[Item] = StreamTracker()
    for s in range(5):
        live(t, s)
    assert live(t, 6) == ["gap:5-5", "replay@4#1"]
    assert rep(t, 1, 20_000) == ["unrecoverable_loss:5-5", "D6", "drop:replay_ahead"]
    assert rep(t, 1, 20_001) == ["drop:replay_ahead"]
    assert kinds(t.replay_end(1)) == []
    assert [live(t, s) for s in (7, 8)] == [["D7"], ["D8"]]
    assert not t.replaying


def test_hole_inside_a_replay_is_reported_lost():
    # vLLM consumes a seq whose send failed without buffering it.
    t: StreamTracker[Item] = StreamTracker()
    live(t, 0)
    live(t, 5)
    assert rep(t, 1, 1) == ["D1r"]
    assert rep(t, 1, 3) == ["unrecoverable_loss:2-2", "D3r"]
    assert rep(t, 1, 4) == ["D4r", "D5"]


def test_late_batch_after_its_loss_is_dropped_and_reordering_is_repaired():
    t: StreamTracker[Item] = StreamTracker()
    live(t, 0)
    live(t, 2)
    assert live(t, 1) == ["D1", "D2"]  # reordered: filled before the replay answered
    assert rep(t, 1, 0) == ["drop:replay_overlap"]
    assert kinds(t.replay_end(1)) == []
    live(t, 4)
    assert kinds(t.replay_failed(t.replay_id, "timed out")) == ["unrecoverable_loss:3-3", "D4"]
    assert live(t, 3) == ["drop:late"]  # no second loss, no restart
    assert live(t, 5) == ["D5"]


def test_duplicate_is_dropped_and_a_contradicting_batch_is_checked_not_trusted():
    t: StreamTracker[Item] = StreamTracker()
    for s in range(5):
        live(t, s)
    assert live(t, 3) == [f"{DUPLICATE}:3-3"]
    # Same seq, other content: a forged batch or a new process; the replay decides.
    assert live(t, 1, epoch=1) == ["drop:mismatch", "replay@4#1"]
    assert live(t, 5) == []  # held until the identity is checked
    assert rep(t, 1, 4) == [
        "D5",
        "drop:replay_overlap",
        f"{DISOWNED_SEQ}:1-1",
    ]  # same fingerprint: the old publisher; nothing reset, the contradicting 1 disowned
    assert kinds(t.replay_end(1)) == []


def test_restart_is_detected_by_fingerprint_even_when_seq_passes_the_old_last():
    t: StreamTracker[Item] = StreamTracker()
    for s in range(5):
        live(t, s)
    assert kinds(t.verify()) == ["replay@4#1"]  # the caller saw a reconnect
    assert live(t, 5, epoch=1) == []  # held
    out = rep(t, 1, 4, epoch=1)
    assert out[0] == f"{PUBLISHER_RESTART}:None-4" and out[1] == "replay@0#2"
    assert [rep(t, 2, s, epoch=1) for s in range(6)] == [
        ["D0r"],
        ["D1r"],
        ["D2r"],
        ["D3r"],
        ["D4r"],
        ["D5r"],
    ]
    assert kinds(t.replay_end(2)) == []


def test_a_replay_holding_nothing_from_the_last_seq_is_a_restart():
    t: StreamTracker[Item] = StreamTracker()
    for s in range(5):
        live(t, s)
    assert live(t, 1, epoch=1) == ["drop:mismatch", "replay@4#1"]
    out = kinds(t.replay_end(1))
    assert out[0] == f"{PUBLISHER_RESTART}:None-4" and out[1] == "replay@0#2"
    assert rep(t, 2, 0, epoch=1) == ["D0r"]
    assert rep(t, 2, 1, epoch=1) == ["D1r"]


def test_without_replay_a_seq_going_back_is_a_restart():
    t: StreamTracker[Item] = StreamTracker(replayable=False)
    for s in range(3):
        live(t, s)
    assert live(t, 0, epoch=1) == [f"{PUBLISHER_RESTART}:0-2", "D0"]
    assert live(t, 1, epoch=1) == ["D1"]
    assert live(t, 3, epoch=1) == ["gap:2-2", "unrecoverable_loss:2-2", "D3"]
    t2: StreamTracker[Item] = StreamTracker(replayable=False)
    assert live(t2, 4) == ["history_missed:0-3", "D4"]


def test_restart_during_replay_discards_the_buffer_and_ignores_old_replies():
    t: StreamTracker[Item] = StreamTracker()
    live(t, 0)
    live(t, 4)
    report, replay = t.replayed(1, 0, (1, 0), (1, 0))
    assert isinstance(report, Report) and report.kind == PUBLISHER_RESTART
    assert "1 buffered batch(es) discarded" in report.detail
    assert isinstance(replay, StartReplay) and replay.start == 0
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
    live(t, 2)  # replay 1 from 0
    live(t, 5)  # 3, 4 lost on the live path while replay 1 runs
    assert rep(t, 1, 0) == ["drop:replay_overlap"]
    assert rep(t, 1, 1) == ["D1r", "D2"]
    assert kinds(t.replay_end(1)) == ["gap:3-4", "replay@2#2"]
    assert rep(t, 2, 2) == ["drop:replay_overlap"]
    assert rep(t, 2, 3) == ["D3r"]
    assert rep(t, 2, 4) == ["D4r", "D5"]


def test_a_new_stream_is_caught_up_and_missed_history_is_reported():
    t: StreamTracker[Item] = StreamTracker()
    assert live(t, 7) == ["replay@0#1"]
    assert rep(t, 1, 4) == ["history_missed:0-3", "D4r"]
    assert rep(t, 1, 5) == ["D5r"]
    # Stopped short of seq 7 (which the ring must hold): cut short, asked again.
    assert kinds(t.replay_end(1)) == ["replay@5#2"]
    assert rep(t, 2, 5) == ["drop:replay_overlap"]
    assert kinds(t.replay_end(2)) == ["unrecoverable_loss:6-6", "D7"]
    off: StreamTracker[Item] = StreamTracker(catch_up=False)
    assert live(off, 7) == ["history_missed:0-6", "D7"]


def test_catch_up_before_any_live_batch_and_an_empty_ring():
    t: StreamTracker[Item] = StreamTracker()
    assert kinds([t.catch_up()]) == ["replay@0#1"]
    assert rep(t, 1, 3) == ["history_missed:0-2", "D3r"]
    assert kinds(t.replay_end(1)) == []
    empty: StreamTracker[Item] = StreamTracker()
    live(empty, 5)
    assert kinds(empty.replay_end(1)) == ["history_missed:0-4", "D5"]


def test_a_live_copy_arriving_after_its_replay_is_an_overlap_not_a_duplicate():
    # A catch-up replay can deliver batches whose live copies are still on their way
    # (the ring holds a batch as soon as it is published, and the two connections are
    # read in whatever order they arrive): the live copy is the expected overlap.
    t: StreamTracker[Item] = StreamTracker()
    assert kinds([t.catch_up()]) == ["replay@0#1"]
    assert rep(t, 1, 0) == ["D0r"]
    assert rep(t, 1, 1) == ["D1r"]
    assert kinds(t.replay_end(1)) == []
    assert live(t, 0) == ["drop:replay_overlap"]
    assert live(t, 0) == [f"{DUPLICATE}:0-0"]  # now seen live: a second send
    assert live(t, 1) == ["drop:replay_overlap"]
    assert live(t, 2) == ["D2"]
    # A batch the live path delivered, sent again, is a duplicate.
    assert live(t, 2) == [f"{DUPLICATE}:2-2"]
    assert live(t, 1) == [f"{DUPLICATE}:1-1"]


def test_probe_delivers_what_the_quiet_live_path_lost_and_checks_identity():
    t: StreamTracker[Item] = StreamTracker()
    for s in range(3):
        live(t, s)
    assert kinds([t.probe()]) == ["replay@2#1"]
    assert rep(t, 1, 2) == ["drop:replay_overlap"]
    assert rep(t, 1, 3) == ["D3r"]
    assert rep(t, 1, 5) == ["unrecoverable_loss:4-4", "D5r"]  # nothing can be in flight
    assert kinds(t.replay_end(1)) == []
    assert kinds([t.probe()]) == ["replay@5#3"]
    assert kinds(t.replay_end(3))[0].startswith(PUBLISHER_RESTART)


def test_an_identity_check_without_any_answer_is_taken_as_a_restart():
    t: StreamTracker[Item] = StreamTracker()
    for s in range(3):
        live(t, s)
    t.verify()
    assert live(t, 3, epoch=1) == []  # held
    out = kinds(t.replay_failed(t.replay_id, "timed out"))
    assert out == [f"{PUBLISHER_RESTART}:None-2", "history_missed:0-2", "D3"]
    # An endpoint that answers but whose connection keeps dropping is not conclusive.
    t2: StreamTracker[Item] = StreamTracker()
    for s in range(3):
        live(t2, s)
    t2.verify()
    assert live(t2, 3) == []
    assert kinds(t2.replay_failed(t2.replay_id, "dropped", conclusive=False)) == ["D3"]
    assert live(t2, 4) == ["D4"]


def test_too_much_buffered_abandons_the_replay():
    t: StreamTracker[Item] = StreamTracker(max_pending=3)
    live(t, 0)
    live(t, 2)
    live(t, 3)
    live(t, 4)
    assert live(t, 5) == ["unrecoverable_loss:1-1", "D2", "D3", "D4", "D5"]
    assert not t.replaying


# --- frames the publisher never sent (vouch_jumps: a stream with a replay endpoint) ------


def forged(t: StreamTracker[Item], seq: int) -> list[str]:
    return kinds(t.live(seq, (9, seq), (9, seq)))


def test_a_forged_seq_far_ahead_is_disowned_by_the_replay_not_a_loss():
    t: StreamTracker[Item] = StreamTracker(vouch_jumps=True)
    for s in range(5):
        live(t, s)
    assert forged(t, 1 << 62) == [f"gap:5-{(1 << 62) - 1}", "replay@4#1"]
    assert live(t, 5) == ["D5"]  # the stream goes on in order meanwhile
    assert rep(t, 1, 4) == ["drop:replay_overlap"]
    assert rep(t, 1, 5) == ["drop:replay_overlap"]
    # The ring held nothing beyond 5 when it answered: the jump is disowned, nothing lost.
    assert kinds(t.replay_end(1)) == [f"{DISOWNED_SEQ}:{1 << 62}-{1 << 62}"]
    assert not t.replaying and t.next_seq == 6
    assert live(t, 6) == ["D6"]


def test_a_forged_seq_just_ahead_waits_and_the_real_one_wins():
    t: StreamTracker[Item] = StreamTracker(vouch_jumps=True)
    for s in range(5):
        live(t, s)
    assert forged(t, 7) == ["gap:5-6", "replay@4#1"]
    assert live(t, 5) == ["D5"]
    assert live(t, 6) == ["D6"]  # the forged 7 is not released on its own
    assert live(t, 7) == ["drop:mismatch"]  # the real 7 collides: the replay decides
    for s in (4, 5, 6):
        assert rep(t, 1, s) == ["drop:replay_overlap"]
    assert rep(t, 1, 7) == ["drop:replay_mismatch", f"{DISOWNED_SEQ}:7-7", "D7r"]
    assert kinds(t.replay_end(1)) == []
    assert t.next_seq == 8 and not t.replaying


def test_a_real_jump_is_vouched_for_by_its_replay():
    t: StreamTracker[Item] = StreamTracker(vouch_jumps=True)
    live(t, 0)
    assert live(t, 3) == ["gap:1-2", "replay@0#1"]
    assert live(t, 4) == []
    assert rep(t, 1, 0) == ["drop:replay_overlap"]
    assert rep(t, 1, 1) == ["D1r"]
    assert rep(t, 1, 2) == ["D2r"]  # 3 waits for the replay's word
    assert rep(t, 1, 3) == ["drop:replay_overlap", "D3"]
    # 4 came after the request and follows the newest seq the ring held: the stream going on.
    assert kinds(t.replay_end(1)) == ["D4"]


def test_a_catch_up_answered_before_the_first_live_batch_reached_the_ring_reports_no_gap():
    # The first live batch (17) arrives before the ring held it: the catch-up's reply stops
    # at 16, and 17 waits for a second round to vouch for it.  Nothing was lost in between,
    # so no gap is reported (an empty "17..16" range was, once).
    t: StreamTracker[Item] = StreamTracker(vouch_jumps=True)
    assert live(t, 17) == ["replay@0#1"]
    for s in range(17):
        assert rep(t, 1, s) == [f"D{s}r"]
    assert kinds(t.replay_end(1)) == ["replay@16#2"]
    assert rep(t, 2, 16) == ["drop:replay_overlap"]
    assert rep(t, 2, 17) == ["drop:replay_overlap", "D17"]
    assert kinds(t.replay_end(2)) == []
    assert live(t, 18) == ["D18"]


def test_a_forged_seq_behind_is_disowned_once_the_replay_shows_the_same_stream():
    t: StreamTracker[Item] = StreamTracker(vouch_jumps=True)
    for s in range(5):
        live(t, s)
    assert forged(t, 2) == ["drop:mismatch", "replay@4#1"]
    assert rep(t, 1, 4) == ["drop:replay_overlap", f"{DISOWNED_SEQ}:2-2"]
    assert kinds(t.replay_end(1)) == []
    assert live(t, 5) == ["D5"]


def test_invalid_sizes_are_rejected():
    with pytest.raises(ValueError):
        StreamTracker(history=0)


# --- the model check -------------------------------------------------------------------


@st.composite
def scenarios(draw: st.DrawFn) -> dict[str, Any]:
    """A publisher schedule (epochs of lengths) with a fate for each published batch."""
    epochs = draw(st.lists(st.integers(1, 25), min_size=1, max_size=4))
    fates = [
        draw(st.sampled_from(["ok", "ok", "ok", "drop", "dup", "swap"])) for _ in range(sum(epochs))
    ]
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


_ALLOWED_DROPS = {
    "replay_overlap",
    "replay_ahead",
    "stale_replay",
    "stale_replay_end",
    "replay_mismatch",
    "late",
    "mismatch",
    "unvouched",
}


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sc=scenarios(), data=st.data())
def test_model_never_loses_invents_or_misattributes(sc: dict[str, Any], data: st.DataObject):
    """A publisher with a bounded ring restarts (the caller sees each reconnect and calls
    ``verify``), the network drops, duplicates and swaps, replays are served late,
    interleaved or never.  Checked per lifetime segment (between restart reports):
    strictly increasing seqs of one publisher lifetime, each the batch published with
    that seq; nothing both delivered and lost; no silent loss; every loss a replay
    proved is truly absent from the ring that answered; no restart without one."""
    epochs, buffer_steps = sc["epochs"], sc["buffer"]
    fast = data.draw(st.booleans(), label="live_in_order first")
    vouch = data.draw(st.booleans(), label="vouch_jumps")
    # Frames the publisher never sent (epoch 99), with a tracker that can vouch for seqs.
    # (one publisher lifetime: a forged frame among a restart's own contradictions is
    # left out of this model)
    forge = vouch and len(epochs) == 1 and data.draw(st.booleans(), label="forge")
    pubs = [(e, s) for e, n in enumerate(epochs) for s in range(n)]
    tracker: StreamTracker[Item] = StreamTracker(history=sc["history"], vouch_jumps=vouch)
    out: list[Any] = []
    # Replays waiting to be served: [replay_id, start, replies or None (not yet sent), mode].
    in_flight: deque[list[Any]] = deque()
    published_upto = -1

    def ring(start: int) -> deque[int]:
        """What the publisher's replay buffer holds >= start right now."""
        e = pubs[published_upto][0]
        seqs = [s for (pe, s) in pubs[: published_upto + 1] if pe == e][-buffer_steps:]
        return deque(s for s in seqs if s >= start)

    def apply(actions: list[Any], ring_seqs: set[int] | None = None) -> None:
        # (the subscriber's outbox schedules a request after the other actions)
        starts = [i for i, a in enumerate(actions) if isinstance(a, StartReplay)]
        assert starts in ([], [len(actions) - 1]), f"a request not last: {kinds(actions)}"
        for a in actions:
            out.append(a)
            if isinstance(a, StartReplay):
                # (forged frames: the guarantee is that of a replay service that answers)
                modes = ["ok"] if forge else ["ok", "ok", "ok", "fail"]
                mode = data.draw(st.sampled_from(modes), label="mode")
                in_flight.append([a.replay_id, a.start, None, mode])
            if (
                isinstance(a, Report)
                and a.first_seq is not None
                and a.last_seq is not None
                and a.kind != PUBLISHER_RESTART
            ):
                assert a.first_seq <= a.last_seq, f"an empty range reported: {kinds(out)}"
            if (
                isinstance(a, Report)
                and a.kind in (UNRECOVERABLE_LOSS, HISTORY_MISSED)
                and ring_seqs is not None
                and "exhausted" not in a.detail
            ):
                assert a.first_seq is not None and a.last_seq is not None
                assert a.last_seq - a.first_seq < 1_000, f"a loss far beyond: {kinds(out)}"
                invented = set(range(a.first_seq, a.last_seq + 1)) & ring_seqs
                assert not invented, f"reported lost but in the ring: {invented}: {kinds(out)}"

    def serve(everything: bool) -> None:
        if not in_flight:
            return
        job = in_flight[0]
        rid, start, replies, mode = job[:4]
        if mode == "fail":
            in_flight.popleft()
            apply(tracker.replay_failed(rid, "timed out"))
            return
        if replies is None:
            replies = job[2] = ring(start)
            job.append(set(replies))
        n = len(replies) if everything else data.draw(st.integers(0, 3), label="replies")
        epoch = pubs[published_upto][0]
        for _ in range(n):
            if not replies:
                break
            s = replies.popleft()
            apply(tracker.replayed(rid, s, (epoch, s), (epoch, s)), job[4])
        if not replies and (everything or data.draw(st.booleans(), label="end")):
            in_flight.popleft()
            apply(tracker.replay_end(rid), job[4])

    epoch_seen = 0
    for e, s, idx in arrivals(epochs, sc["fates"]):
        published_upto = max(published_upto, idx)
        if e != epoch_seen:
            # The subscriber saw the connection drop and come back: requests in flight
            # went to the dead process (resent), identity is checked at once.
            # It reconnects at once: the new process has published only its first batch
            # (a new ring that already evicted the old last seq cannot be told apart:
            # documented).
            epoch_seen = e
            for job in in_flight:
                if job[3] == "ok":
                    job[2] = None
                    del job[4:]
            now, published_upto = published_upto, pubs.index((e, 0))
            apply(tracker.verify())
            while in_flight:
                serve(True)
            published_upto = now
        elif in_flight and data.draw(st.booleans(), label="serve first"):
            serve(False)
        # A forged frame once the stream is followed, under a seq far beyond what the
        # publisher sends, or one already applied.  (Not the next seq the live path
        # expects, nor one the publisher sends soon after a replay's snapshot: those,
        # sent before the publisher's own, cannot be told from the stream going on.)
        nxt = tracker.next_seq
        if forge and nxt is not None and data.draw(st.integers(0, 5), label="forge") == 0:
            newest = pubs[published_upto][1]
            kind = data.draw(st.sampled_from(["far", "huge", "behind"]), label="kind")
            if kind == "behind":  # (an applied seq: below the next one expected)
                f = data.draw(st.integers(0, max(nxt - 1, 0)), label="behind")
            else:
                f = newest + 5_000 if kind == "far" else (1 << 64) - 1
            if f != nxt:
                apply(tracker.live(f, (99, f), (99, f)))
            if in_flight and data.draw(st.booleans(), label="serve after forging"):
                serve(False)
        if fast and tracker.live_in_order(s, (e, s)):  # the subscriber's usual path
            apply([Deliver(s, (e, s), False)])
        else:
            apply(tracker.live(s, (e, s), (e, s)))
    published_upto = len(pubs) - 1
    for _ in range(1000):  # finish every replay (each may ask for another)
        if not in_flight:
            break
        serve(True)
    assert not tracker.replaying

    # --- check the output against the model ---------------------------------------
    published = set(pubs)
    segments: list[list[Any]] = [[]]
    for a in out:
        if isinstance(a, Report) and a.kind == PUBLISHER_RESTART:
            segments.append([])
        else:
            segments[-1].append(a)
    assert len(segments) <= len(epochs), f"a restart reported without one: {kinds(out)}"
    lifetimes = []
    for i, seg in enumerate(segments):
        delivered = [a for a in seg if isinstance(a, Deliver)]
        seqs = [a.seq for a in delivered]
        assert seqs == sorted(set(seqs)), f"order/duplicates in segment {i}: {kinds(seg)}"
        assert len({a.item[0] for a in delivered}) <= 1, f"mixed lifetimes: {kinds(seg)}"
        lifetimes += sorted({a.item[0] for a in delivered})
        for a in delivered:
            assert a.item[1] == a.seq and a.item in published
        lost: set[int] = set()
        for a in seg:
            if isinstance(a, Report) and a.kind in (UNRECOVERABLE_LOSS, HISTORY_MISSED):
                assert a.first_seq is not None and a.last_seq is not None
                lost.update(range(a.first_seq, a.last_seq + 1))
        assert not lost & set(seqs), f"delivered and lost: {kinds(seg)}"
        top = max(seqs, default=-1)
        if i == len(segments) - 1:
            top = max(top, epochs[-1] - 1)
            assert delivered and delivered[-1].item == (len(epochs) - 1, epochs[-1] - 1)
        missing = set(range(top + 1)) - set(seqs) - lost
        assert not missing, f"silent loss of {sorted(missing)} in segment {i}: {kinds(seg)}"
    assert lifetimes == sorted(set(lifetimes)), f"a lifetime split by a false restart: {lifetimes}"
    kinds_ok = {GAP, DUPLICATE, PUBLISHER_RESTART, UNRECOVERABLE_LOSS, HISTORY_MISSED}
    if forge:
        kinds_ok.add(DISOWNED_SEQ)  # (never without a forged frame: no false disowning)
    for a in out:
        assert not isinstance(a, Drop) or a.reason in _ALLOWED_DROPS, a
        assert not isinstance(a, Report) or a.kind in kinds_ok, (a, kinds(out))


@settings(max_examples=300, deadline=None)
@given(
    steps=st.lists(
        st.tuples(
            st.sampled_from(["live", "live", "live", "verify", "replayed", "end"]),
            st.integers(0, 12),
        ),
        max_size=60,
    ),
    replayable=st.booleans(),
)
def test_live_in_order_is_live_without_the_actions(
    steps: list[tuple[str, int]], replayable: bool
) -> None:
    """Where ``live_in_order`` takes a batch, ``live`` would have answered exactly one
    ``Deliver`` of it and left the same state; where it declines, it changes nothing."""
    ref: StreamTracker[int] = StreamTracker(replayable=replayable, history=8)
    fast: StreamTracker[int] = StreamTracker(replayable=replayable, history=8)
    replay_id = None

    def state(t: StreamTracker[int]) -> tuple[Any, ...]:
        return (t.last, t._next, t._front, t._quiet, t._hold, list(t._ring), dict(t._pending))

    for kind, seq in steps:
        if kind == "live":
            before = state(fast)
            if fast.live_in_order(seq, seq):
                assert ref.live(seq, seq, seq) == [Deliver(seq, seq, False)]
            else:
                assert state(fast) == before
                got = fast.live(seq, seq, seq)
                assert got == ref.live(seq, seq, seq)
                replay_id = next(
                    (a.replay_id for a in got if isinstance(a, StartReplay)), replay_id
                )
        elif kind == "verify":
            got = fast.verify()
            assert got == ref.verify()
            replay_id = next((a.replay_id for a in got if isinstance(a, StartReplay)), replay_id)
        elif replay_id is not None and kind == "replayed":
            assert fast.replayed(replay_id, seq, seq, seq) == ref.replayed(replay_id, seq, seq, seq)
        elif replay_id is not None:
            assert fast.replay_end(replay_id) == ref.replay_end(replay_id)
        assert state(fast) == state(ref)


def test_a_resume_point_still_in_the_ring_is_checked_then_followed():
    t: StreamTracker[Item] = StreamTracker()
    t.resume_at(5, (0, 5))
    assert kinds([t.check_resume()]) == ["replay@5#1"]
    assert live(t, 8) == []  # held until the check answers
    assert rep(t, 1, 5) == ["drop:replay_overlap"]
    assert rep(t, 1, 6) == ["D6r"]
    assert rep(t, 1, 7) == ["D7r", "D8"]
    assert kinds(t.replay_end(1)) == []
    assert live(t, 9) == ["D9"]
    # an idle publisher: the check answers with the point alone
    idle: StreamTracker[Item] = StreamTracker()
    idle.resume_at(5, (0, 5))
    rid = idle.check_resume().replay_id  # type: ignore[union-attr]
    assert rep(idle, rid, 5) == ["drop:replay_overlap"]
    assert kinds(idle.replay_end(rid)) == [] and not idle.replaying
    assert live(idle, 6) == ["D6"]


def test_a_resume_point_the_ring_left_behind_or_that_differs_starts_over():
    gone: StreamTracker[Item] = StreamTracker()
    gone.resume_at(5, (0, 5))
    rid = gone.check_resume().replay_id  # type: ignore[union-attr]
    assert rep(gone, rid, 9) == ["unrecoverable_loss:6-8", "D9r"]
    # another payload under the point's seq: a new publisher process, caught up from 0
    other: StreamTracker[Item] = StreamTracker()
    other.resume_at(5, (0, 5))
    rid = other.check_resume().replay_id  # type: ignore[union-attr]
    assert rep(other, rid, 5, epoch=1) == [f"{PUBLISHER_RESTART}:None-5", f"replay@0#{rid + 1}"]
    # a ring that holds nothing from the point on: a new process too
    behind: StreamTracker[Item] = StreamTracker()
    behind.resume_at(5, (0, 5))
    rid = behind.check_resume().replay_id  # type: ignore[union-attr]
    assert kinds(behind.replay_end(rid))[0].startswith(PUBLISHER_RESTART)
    # only a fresh stream takes a resume point; without replay nothing is checked
    with pytest.raises(ValueError):
        gone.resume_at(3, (0, 3))
    blind: StreamTracker[Item] = StreamTracker(replayable=False)
    blind.resume_at(5, (0, 5))
    assert blind.check_resume() is None and live(blind, 6) == ["D6"]


@settings(max_examples=300, deadline=None)
@given(
    lo=st.integers(0, 40),
    size=st.integers(1, 20),
    point=st.integers(0, 70),
    same=st.booleans(),
    live_during=st.integers(0, 3),
)
def test_a_resume_point_against_any_ring_continues_or_reports_exactly(
    lo: int, size: int, point: int, same: bool, live_during: int
):
    """A resume point ``point`` checked against a ring holding ``lo..hi`` (live batches
    above ``hi`` may arrive during the check): the stream continues exactly when the ring
    still holds the point with the same payload, or starts at ``point + 1``; otherwise
    the gap is reported (loss) or the stream is taken as a new process (restart)."""
    hi = lo + size - 1
    t: StreamTracker[Item] = StreamTracker()
    t.resume_at(point, (0, point) if same else (9, point))
    req = t.check_resume()
    assert req is not None and req.start == point
    # the ring's process: the point's own (epoch 0), or a new one when the ring holds
    # nothing from the point on or another payload under it
    epoch = 1 if point > hi or (lo <= point and not same) else 0
    out: list[str] = []
    for s in range(hi + 1, hi + 1 + live_during):  # published after the ring was read
        out += live(t, s, epoch)
    for s in range(max(point, lo), hi + 1):
        out += rep(t, req.replay_id, s, epoch)
    out += kinds(t.replay_end(req.replay_id))
    delivered = [int(x[1:].rstrip("r")) for x in out if x.startswith("D")]
    reports = [x for x in out if ":" in x and not x.startswith("drop:")]
    if epoch:
        # nothing from the point on, or another payload under it: a new process
        assert reports and reports[0].startswith(PUBLISHER_RESTART)
        return
    newest = hi + live_during
    if point + 1 >= lo:  # the ring still holds what follows the point
        assert reports == [] and delivered == list(range(point + 1, newest + 1))
    else:  # the ring moved past it: what it no longer holds is lost, the rest follows
        assert reports == [f"{UNRECOVERABLE_LOSS}:{point + 1}-{lo - 1}"]
        assert delivered == list(range(lo, newest + 1))
