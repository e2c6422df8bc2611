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
