"""The relay's size option: ``chunk_batches`` bounds one append burst; ``chunk`` is its
deprecated name."""

from __future__ import annotations

import warnings

import pytest

from kvevents.jetstream import JetStreamRelay, LocalNatsServer

from .helpers import Engine, run_relay_thread, stream_seqs


@pytest.mark.parametrize("old_name", [False, True])
def test_small_bursts_relay_every_batch_once(
    nats_server: LocalNatsServer, engine: Engine, old_name: bool
) -> None:
    if old_name:
        with pytest.warns(DeprecationWarning, match="chunk_batches"):
            relay = JetStreamRelay(nats_server.url, [engine.spec()], chunk=3)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("error", DeprecationWarning)
            relay = JetStreamRelay(nats_server.url, [engine.spec()], chunk_batches=3)
    stop, t = run_relay_thread(relay)
    try:
        engine.publish(20)
        assert relay.wait_appended(20, 20), relay.stats
    finally:
        stop.set()
        t.join(10)
        relay.close()
    assert stream_seqs(nats_server.url) == [(0, s) for s in range(20)]
