"""``kvevents serve --nats``: the service's index fed from JetStream (what ``kvevents
relay`` wrote), and two services on one stream agree on every engine's tiers."""

from __future__ import annotations

import pytest

pytest.importorskip("starlette")

from kvevents.consumers import Router
from kvevents.jetstream import JetStreamRelay, LocalNatsServer
from kvevents.serve.config import ServeConfig, load_config
from kvevents.serve.fleet import Fleet

from .helpers import Engine, holdings, run_relay_thread, wait_until


def test_two_services_on_one_stream_hold_the_same_index(
    nats_server: LocalNatsServer, engine: Engine
) -> None:
    relay = JetStreamRelay(nats_server.url, [engine.spec("e0")])
    stop, t = run_relay_thread(relay)
    try:
        engine.publish(40)
        assert relay.wait_appended(40, 20)
    finally:
        stop.set()
        t.join(10)
        relay.close()
    config = load_config(engines=["e0=http://127.0.0.1:9"], options={"nats_url": nats_server.url})
    assert config.nats_url == nats_server.url and config.engines[0].events_endpoint is None
    fleets = [Fleet(config), Fleet(config)]
    try:
        for f in fleets:
            f.start()
        assert wait_until(lambda: all(f.ranks[0].batches == 40 for f in fleets), 20)
        a, b = (f.index for f in fleets)
        assert holdings(a) == holdings(b) == holdings(engine.truth("e0"))
        # the batches land on the engine's rank, as the service routes to it
        assert fleets[0].rank_for("e0", 0) is fleets[0].ranks[0]
        prompt = list(range(390, 423))  # batch 39's two 16-token blocks and one more token
        ra, rb = Router(a).find_matches(prompt), Router(b).find_matches(prompt)
        assert ra == rb and ra[("e0", 0)].gpu == 32
        assert fleets[0].not_ready() == []
    finally:
        for f in fleets:
            f.close()


def test_engines_without_events_need_nats() -> None:
    from kvevents.errors import ConfigError

    with pytest.raises(ConfigError, match="no events endpoint"):
        load_config(engines=["e0=http://127.0.0.1:9"])
    assert ServeConfig().nats_stream == "KV_EVENTS"


def test_a_rank_spec_is_relayed_and_followed_under_its_global_rank(
    nats_server: LocalNatsServer,
) -> None:
    """``;rank=2`` (an API server started with ``--data-parallel-rank 2``): the relay reads
    vLLM's endpoints moved up by 2 and stores ``kvevents.e2.2``; ``serve --nats`` with the
    same ``;rank=2`` follows it as worker ``(e2, 2)``, nothing unexpected."""
    from kvevents.engines import parse_engine_spec
    from kvevents.publishers import ZmqEventPublisher

    from .helpers import batch, free_port

    events, replay = free_port(), free_port()  # what rank 2 binds: vLLM's ports + 2
    pub = ZmqEventPublisher(
        data_parallel_rank=2,
        endpoint=f"tcp://*:{events - 2}",
        replay_endpoint=f"tcp://*:{replay - 2}",
    )
    assert pub.endpoint.endswith(f":{events}")
    spec = parse_engine_spec(f"e2=tcp://127.0.0.1:{events - 2},tcp://127.0.0.1:{replay - 2};rank=2")
    relay = JetStreamRelay(nats_server.url, [spec])
    stop, t = run_relay_thread(relay)
    try:
        for i in range(10):
            b = batch(i)
            b.data_parallel_rank = None  # the publisher tags its own rank: 2
            pub.publish(b)
        assert relay.wait_appended(10, 20)
    finally:
        stop.set()
        t.join(10)
        relay.close()
        pub.shutdown()
    config = load_config(
        engines=["e2=http://127.0.0.1:9;rank=2"], options={"nats_url": nats_server.url}
    )
    fleet = Fleet(config)
    try:
        fleet.start()
        (st,) = fleet.ranks
        assert (st.rank, st.worker) == (2, ("e2", 2))
        assert wait_until(lambda: st.batches == 10, 20)
        assert st.unexpected == {} and fleet.unexpected == {}
        assert set(fleet.index.summary()) == {("e2", 2)}
    finally:
        fleet.close()
