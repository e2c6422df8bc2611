"""The relay's size option: ``chunk_batches`` bounds one append burst."""

from __future__ import annotations

from kvevents.jetstream import JetStreamRelay, LocalNatsServer

from .helpers import Engine, run_relay_thread, stream_seqs


def test_small_bursts_relay_every_batch_once(nats_server: LocalNatsServer, engine: Engine) -> None:
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
