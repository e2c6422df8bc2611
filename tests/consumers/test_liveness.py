"""Liveness: the scan skipped between due times probes and reports exactly what a scan
on every wake-up would, and never tells the wait to sleep past a due time."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from kvevents.consumers.subscriber.items import STALE, Anomaly, SubscriberStats
from kvevents.consumers.subscriber.liveness import Liveness
from kvevents.consumers.subscriber.outbox import Outbox
from kvevents.consumers.subscriber.streams import Stream
from kvevents.ratelimit import RateLimitedLog

STALE_AFTER = 3.0


class _Tracker:
    """Stands in for a stream's tracker: the probe request is not what is tested."""

    def probe(self) -> object:
        return object()


@dataclass
class _Model:
    """The specification: every check scans every stream."""

    heard: dict[int, float] = field(default_factory=dict)
    probe_at: dict[int, float] = field(default_factory=dict)
    stale: dict[int, bool] = field(default_factory=dict)
    watched: dict[int, bool] = field(default_factory=dict)

    def check(self, now: float) -> list[tuple[str, int]]:
        out = []
        for k in self.heard:
            if not self.watched[k]:
                continue
            if now - max(self.heard[k], self.probe_at[k]) >= STALE_AFTER / 3:
                self.probe_at[k] = now
                out.append(("probe", k))
            if now - self.heard[k] >= STALE_AFTER and not self.stale[k]:
                self.stale[k] = True
                out.append(("stale", k))
        return out

    def next_due(self) -> float | None:
        dues = []
        for k in self.heard:
            if self.watched[k]:
                dues.append(max(self.heard[k], self.probe_at[k]) + STALE_AFTER / 3)
                if not self.stale[k]:
                    dues.append(self.heard[k] + STALE_AFTER)
        return min(dues) if dues else None


steps = st.lists(
    st.one_of(
        st.tuples(st.just("wait"), st.floats(0.0, 2.5)),
        st.tuples(st.just("new"), st.booleans()),
        st.tuples(st.just("heard"), st.integers(0, 30)),
        st.tuples(st.just("check"), st.just(0)),
    ),
    max_size=120,
)


@settings(max_examples=300, deadline=None)
@given(steps)
def test_skipped_scans_act_exactly_like_a_scan_on_every_wake_up(program: list) -> None:
    outbox = Outbox(SubscriberStats(), RateLimitedLog(logging.getLogger("test")))
    streams: dict[tuple[str, int], Stream] = {}
    probes: list[tuple[str, int]] = []
    live = Liveness(
        streams, outbox, STALE_AFTER, lambda key, req: probes.append(("probe", int(key[0])))
    )
    model = _Model()
    now = 100.0
    for op, arg in program:
        if op == "wait":
            now += arg
        elif op == "new":
            k = len(model.heard)
            streams[(str(k), 0)] = Stream(
                (str(k), 0),
                _Tracker(),
                None,
                b"",
                "chan" if arg else None,
                now,
                now,  # type: ignore[arg-type]
            )
            model.heard[k], model.probe_at[k] = now, float("-inf")
            model.stale[k], model.watched[k] = False, arg
        elif op == "heard" and arg < len(model.heard):
            live.heard(streams[(str(arg), 0)], now, live=True)
            model.heard[arg] = now
            model.stale[arg] = False
        else:
            # What the wait would have allowed: never past a due time of the model.
            due = model.next_due()
            if due is not None:
                assert live.check_at <= due + 1e-9
            probes.clear()
            before = [a for a in outbox.items if isinstance(a, Anomaly) and a.kind == STALE]
            live.check(now)
            after = [a for a in outbox.items if isinstance(a, Anomaly) and a.kind == STALE]
            stale_now = [("stale", int(a.source)) for a in after[len(before) :]]
            expected = model.check(now)
            assert sorted(probes + stale_now) == sorted(expected)
    assert {int(k[0]) for k, s in streams.items() if s.stale} == {
        k for k, v in model.stale.items() if v
    }


def test_a_wake_up_before_any_due_time_does_not_scan_the_streams() -> None:
    outbox = Outbox(SubscriberStats(), RateLimitedLog(logging.getLogger("test")))

    class _Counting(dict):  # type: ignore[type-arg]
        scans = 0

        def items(self):  # type: ignore[no-untyped-def, override]
            _Counting.scans += 1
            return super().items()

    streams = _Counting()
    for k in range(1000):
        streams[(str(k), 0)] = Stream((str(k), 0), _Tracker(), None, b"", "chan", 0.0, 0.0)  # type: ignore[arg-type]
    live = Liveness(streams, outbox, STALE_AFTER, lambda key, req: None)
    live.check(0.0)  # the first call scans
    assert _Counting.scans == 1
    for i in range(1, 100):
        live.check(i * 0.009)  # all before the first due time (1 s)
    assert _Counting.scans == 1
    assert live.check_at == 1.0
    live.check(1.0)  # every stream is due for its probe
    assert _Counting.scans == 2
