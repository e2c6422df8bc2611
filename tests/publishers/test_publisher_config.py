"""KVEventsConfig (vLLM names and defaults, C§2.4), the factory and DP offsets (C§8.2)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st
from pubtest_helpers import recv, removed_batch, subscribe, warm_up

from kvevents.codec import decode_batch, pack_seq
from kvevents.errors import ConfigError, PublisherClosedError
from kvevents.events import EventBatch
from kvevents.publishers import (
    EventPublisher,
    KVEventsConfig,
    NullEventPublisher,
    ZmqEventPublisher,
    create_publisher,
    offset_endpoint,
    register_publisher,
    registered_publishers,
)
from kvevents.publishers import factory as factory_module

# --- config ----------------------------------------------------------------------------


def test_defaults_are_vllms() -> None:
    assert KVEventsConfig().to_dict() == {
        "enable_kv_cache_events": False,
        "publisher": "null",
        "endpoint": "tcp://*:5557",
        "replay_endpoint": None,
        "buffer_steps": 10_000,
        "hwm": 100_000,
        "max_queue_size": 100_000,
        "topic": "",
        # kvevents' own, off by default (vLLM has no socket security).
        "curve_secret_key_file": None,
        "curve_authorized_keys_dir": None,
    }


def test_unset_publisher_follows_the_enable_flag() -> None:
    assert KVEventsConfig(enable_kv_cache_events=True).publisher == "zmq"
    assert KVEventsConfig(enable_kv_cache_events=False).publisher == "null"
    assert KVEventsConfig(enable_kv_cache_events=True, publisher="null").publisher == "null"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"publisher": "kafka"}, "unknown publisher 'kafka'.*'zmq'"),
        ({"publisher": 3}, "publisher must be a string"),
        ({"endpoint": "localhost:5557"}, "not a ZMQ endpoint"),
        ({"endpoint": "tcp://*"}, r"must end in ':<port>'"),
        ({"endpoint": "tcp://*:99999"}, "outside 0-65535"),
        ({"endpoint": "tcp://*:abc"}, r"must end in ':<port>'"),
        ({"endpoint": "udp://x:1"}, "unknown transport 'udp'"),
        ({"endpoint": "ipc://"}, "empty address"),
        ({"endpoint": None}, "endpoint must be a string"),
        ({"replay_endpoint": "tcp://host"}, r"replay_endpoint .* must end in ':<port>'"),
        ({"buffer_steps": -1}, "buffer_steps must be >= 0"),
        ({"hwm": 1.5}, "hwm must be an int"),
        ({"max_queue_size": 0}, "max_queue_size must be >= 1"),
        ({"max_queue_size": True}, "max_queue_size must be an int"),
        ({"enable_kv_cache_events": "true"}, "enable_kv_cache_events must be a bool"),
        ({"topic": b"kv"}, "topic must be a string"),
    ],
)
def test_invalid_values_raise_config_error(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        KVEventsConfig(**kwargs)
    assert isinstance(info.value, ValueError)


def test_from_json_reads_vllms_flag_value() -> None:
    text = (
        '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:6000",'
        ' "replay_endpoint": "tcp://*:6100", "buffer_steps": 50, "topic": "kv@pod"}'
    )
    cfg = KVEventsConfig.from_json(text)
    assert (cfg.endpoint, cfg.replay_endpoint, cfg.buffer_steps, cfg.topic) == (
        "tcp://*:6000",
        "tcp://*:6100",
        50,
        "kv@pod",
    )
    assert KVEventsConfig.from_json(cfg.to_json()) == cfg


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"enable_kv_cache_events": true, "endpont": "tcp://*:1"}', "unknown .*'endpont'"),
        ("[1, 2]", "must be a JSON object"),
        ("{not json", "not valid JSON"),
        ('{"buffer_steps": "10"}', "buffer_steps must be an int"),
    ],
)
def test_from_json_errors(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        KVEventsConfig.from_json(text)


def test_unknown_key_message_lists_the_valid_keys() -> None:
    with pytest.raises(ConfigError) as info:
        KVEventsConfig.from_dict({"hwm": 1, "curve_key": "x"})
    assert "curve_key" in str(info.value)
    assert "replay_endpoint" in str(info.value)


def test_from_cli_finds_the_flag_in_both_forms() -> None:
    value = '{"enable_kv_cache_events": true, "topic": "t"}'
    for argv in (
        ["serve", "model", "--kv-events-config", value],
        ["serve", f"--kv-events-config={value}", "--port", "1"],
    ):
        cfg = KVEventsConfig.from_cli(argv)
        assert cfg is not None and cfg.topic == "t" and cfg.publisher == "zmq"
    assert KVEventsConfig.from_cli(["serve", "model"]) is None
    with pytest.raises(ConfigError, match="needs a JSON object"):
        KVEventsConfig.from_cli(["serve", "--kv-events-config"])


# --- DP offsets (C§8.2) ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("endpoint", "expected"),
    [
        ("tcp://*:5557", ["tcp://*:5557", "tcp://*:5558", "tcp://*:5559"]),
        ("tcp://host:5557", ["tcp://host:5557", "tcp://host:5558", "tcp://host:5559"]),
        ("tcp://*:0", ["tcp://*:0", "tcp://*:0", "tcp://*:0"]),
        ("inproc://cache", ["inproc://cache", "inproc://cache_dp1", "inproc://cache_dp2"]),
        ("ipc:///tmp/kv", ["ipc:///tmp/kv", None, None]),
    ],
)
def test_offset_endpoint_matches_vllm(endpoint: str, expected: list[str | None]) -> None:
    for rank, want in enumerate(expected):
        if want is None:
            with pytest.raises(ValueError, match=f"rank {rank}") as info:
                offset_endpoint(endpoint, rank)
            assert isinstance(info.value, ConfigError)
        else:
            assert offset_endpoint(endpoint, rank) == want


def test_offset_endpoint_none_and_overflow() -> None:
    assert offset_endpoint(None, 3) is None
    assert ZmqEventPublisher.offset_endpoint_port("tcp://*:5557", 1) == "tcp://*:5558"
    with pytest.raises(ConfigError, match="above 65535"):
        offset_endpoint("tcp://*:65535", 1)


@settings(max_examples=150, deadline=None)
@given(
    host=st.sampled_from(["*", "127.0.0.1", "[::1]", "node-7.cluster"]),
    port=st.integers(0, 60000),
    rank=st.integers(0, 5000),
)
def test_tcp_offset_is_port_plus_rank_except_port_zero(host: str, port: int, rank: int) -> None:
    out = offset_endpoint(f"tcp://{host}:{port}", rank)
    assert out == f"tcp://{host}:{0 if port == 0 else port + rank}"


def test_create_publisher_offsets_both_endpoints(ctx_instance: zmq.Context[Any]) -> None:
    name = uuid.uuid4().hex
    cfg = KVEventsConfig(
        enable_kv_cache_events=True,
        endpoint=f"inproc://{name}",
        replay_endpoint=f"inproc://{name}-replay",
        topic="kv",
    )
    pubs = [create_publisher(cfg, rank) for rank in range(2)]
    try:
        assert isinstance(pubs[1], ZmqEventPublisher)
        assert [p.endpoint for p in pubs] == [f"inproc://{name}", f"inproc://{name}_dp1"]  # type: ignore[attr-defined]
        assert pubs[1].replay_endpoint == f"inproc://{name}-replay_dp1"  # type: ignore[attr-defined]
        subs = [subscribe(ctx_instance, p.endpoint) for p in pubs]  # type: ignore[attr-defined]
        for p in pubs:
            p.publish(removed_batch(0))
        # Each rank has its own socket, its own seq space, and tags its batches.
        for rank, sub in enumerate(subs):
            frames = recv(sub)
            assert frames[:2] == [b"kv", pack_seq(0)]
            assert decode_batch(frames[2]).data_parallel_rank == rank
        for sub in subs:
            sub.close()
    finally:
        for p in pubs:
            p.shutdown()


def test_connect_endpoint_is_offset_by_rank(ctx_instance: zmq.Context[Any]) -> None:
    """``tcp://127.0.0.1:P`` with rank 2 connects to P+2 (vLLM's rule, connect mode)."""
    sub = ctx_instance.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    for _ in range(50):  # find a bound port >= 2 so that P = port - 2 is valid
        sub.bind("tcp://127.0.0.1:0")
        port = int(sub.getsockopt(zmq.LAST_ENDPOINT).decode().rsplit(":", 1)[1])
        if port >= 2:
            break
    cfg = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://127.0.0.1:{port - 2}")
    pub = create_publisher(cfg, data_parallel_rank=2)
    try:
        assert isinstance(pub, ZmqEventPublisher)
        assert pub.endpoint == f"tcp://127.0.0.1:{port}"
        warm_up(pub, sub)
        pub.publish(removed_batch(1))
        assert decode_batch(recv(sub)[2]).data_parallel_rank == 2
    finally:
        sub.close()
        pub.shutdown()


def test_create_publisher_rejects_ipc_for_rank_one() -> None:
    cfg = KVEventsConfig(enable_kv_cache_events=True, endpoint="ipc:///tmp/kvevents-never")
    with pytest.raises(ValueError, match="ipc:///tmp/kvevents-never"):
        create_publisher(cfg, data_parallel_rank=1)


# --- factory ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cfg",
    [
        None,
        KVEventsConfig(),
        KVEventsConfig(enable_kv_cache_events=False, publisher="zmq"),
        KVEventsConfig(enable_kv_cache_events=True, publisher="null"),
    ],
)
def test_disabled_or_null_gives_a_null_publisher(cfg: KVEventsConfig | None) -> None:
    pub = create_publisher(cfg, 0)
    assert isinstance(pub, NullEventPublisher)
    assert isinstance(pub, EventPublisher)
    pub.publish(removed_batch(0))
    assert pub.stats.batches_ignored == 1
    pub.shutdown()
    pub.shutdown()
    with pytest.raises(PublisherClosedError):
        pub.publish(removed_batch(1))


def test_enabled_with_unset_publisher_gives_zmq() -> None:
    cfg = KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://*:0")
    pub = create_publisher(cfg)
    try:
        assert isinstance(pub, ZmqEventPublisher)
        assert isinstance(pub, EventPublisher)
    finally:
        pub.shutdown()


class _ListPublisher:
    """A publisher kind registered by a test: it records its arguments and batches."""

    def __init__(self, data_parallel_rank: int = 0, **kwargs: Any) -> None:
        self.rank = data_parallel_rank
        self.kwargs = kwargs
        self.batches: list[EventBatch] = []

    def publish(self, batch: EventBatch) -> None:
        self.batches.append(batch)

    def shutdown(self) -> None:
        pass


@pytest.fixture
def list_kind() -> Iterator[str]:
    name = f"list-{uuid.uuid4().hex[:8]}"
    register_publisher(name, _ListPublisher)
    yield name
    with factory_module._REGISTRY_LOCK:
        del factory_module._REGISTRY[name]


def test_registered_kind_is_accepted_and_built_with_the_config(list_kind: str) -> None:
    assert list_kind in registered_publishers()
    cfg = KVEventsConfig(enable_kv_cache_events=True, publisher=list_kind, topic="t")
    pub = create_publisher(cfg, data_parallel_rank=3)
    assert isinstance(pub, _ListPublisher)
    assert pub.rank == 3
    assert pub.kwargs == {
        "endpoint": "tcp://*:5557",
        "replay_endpoint": None,
        "buffer_steps": 10_000,
        "hwm": 100_000,
        "max_queue_size": 100_000,
        "topic": "t",
    }


def test_registering_an_existing_name_raises_key_error(list_kind: str) -> None:
    with pytest.raises(KeyError, match=list_kind):
        register_publisher(list_kind, _ListPublisher)
    with pytest.raises(KeyError, match="zmq"):
        register_publisher("zmq", _ListPublisher)


def test_zmq_publisher_rejects_bad_tuning_and_busy_ports() -> None:
    with pytest.raises(ConfigError, match="replay_slice"):
        ZmqEventPublisher(endpoint="tcp://*:0", replay_slice=0)
    with ZmqEventPublisher(endpoint="tcp://*:0") as first:
        port = first.endpoint.rsplit(":", 1)[1]
        with pytest.raises(ConfigError, match="cannot bind the PUB socket"):
            ZmqEventPublisher(endpoint=f"tcp://*:{port}")


def test_config_json_round_trips_through_the_cli_flag() -> None:
    cfg = KVEventsConfig(enable_kv_cache_events=True, buffer_steps=7, hwm=0)
    assert KVEventsConfig.from_cli(["--kv-events-config", cfg.to_json()]) == cfg
    assert json.loads(cfg.to_json())["publisher"] == "zmq"


def test_curve_fields_reach_the_constructor_only_when_set(list_kind: str) -> None:
    cfg = KVEventsConfig.from_json(
        json.dumps(
            {
                "enable_kv_cache_events": True,
                "publisher": list_kind,
                "curve_secret_key_file": "keys/engine.key_secret",
                "curve_authorized_keys_dir": "allowed",
            }
        )
    )
    pub = create_publisher(cfg)
    assert isinstance(pub, _ListPublisher)
    assert pub.kwargs["curve_secret_key_file"] == "keys/engine.key_secret"
    assert pub.kwargs["curve_authorized_keys_dir"] == "allowed"


def test_curve_field_errors() -> None:
    with pytest.raises(ConfigError, match="needs curve_secret_key_file"):
        KVEventsConfig(curve_authorized_keys_dir="allowed")
    with pytest.raises(ConfigError, match="curve_secret_key_file must be"):
        KVEventsConfig(curve_secret_key_file="")
    # A key file that does not exist is reported when the publisher is built.
    cfg = KVEventsConfig(
        enable_kv_cache_events=True, endpoint="tcp://*:0", curve_secret_key_file="/nonexistent"
    )
    with pytest.raises(ConfigError, match="does not exist"):
        create_publisher(cfg)
