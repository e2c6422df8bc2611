"""The one engine spec (``kvevents.engines``) that ``serve``, ``relay`` and the CLI share:
one parser and one set of errors."""

from __future__ import annotations

import pytest

import kvevents.serve
import kvevents.serve.config
from kvevents.engines import EngineSpec, parse_engine_spec
from kvevents.errors import ConfigError, KVEventsError


def test_serve_and_relay_share_one_type_and_one_parser() -> None:
    assert kvevents.serve.EngineSpec is EngineSpec is kvevents.serve.config.EngineSpec
    assert kvevents.serve.parse_engine_spec is parse_engine_spec


def test_spec_round_trips_through_its_text() -> None:
    for text in (
        "a=http://h:1/,tcp://h:2,tcp://h:3;dp=2;topic=kv",
        "b=tcp://h:2",
        "c=http://h:1",
        "d=https://h:1,ipc:///tmp/e",
        "e=http://h:1,tcp://h:5557,tcp://h:5600;rank=2",
        "f=tcp://h:5557;dp=2;rank=4;topic=kv;role=decode",
    ):
        spec = parse_engine_spec(text)
        assert parse_engine_spec(spec.spec()) == spec
    assert parse_engine_spec("a=http://h:1/,tcp://h:2").http_url == "http://h:1"


def test_rank_endpoints_follow_vllm_offsets() -> None:
    spec = parse_engine_spec("a=tcp://h:5557,tcp://h:5558;dp=3")
    assert spec.rank_endpoints() == [
        (0, "tcp://h:5557", "tcp://h:5558"),
        (1, "tcp://h:5558", "tcp://h:5559"),
        (2, "tcp://h:5559", "tcp://h:5560"),
    ]
    assert spec.endpoints_for_rank(2) == ("tcp://h:5559", "tcp://h:5560")


def test_rank_sets_the_global_ranks_their_offsets_and_the_front_index() -> None:
    """``;rank=R``: the spec's ranks are R..R+N-1, each at vLLM's endpoint moved up by its
    global rank (what ``ZmqEventPublisher`` binds for ``data_parallel_index``), and the
    ``X-data-parallel-rank`` value is its index among the front's ranks."""
    ext = parse_engine_spec("e=http://h:1,tcp://h:5557,tcp://h:5600;rank=2")
    assert (ext.first_rank, ext.dp_size, list(ext.ranks)) == (2, 1, [2])
    assert ext.rank_endpoints() == [(2, "tcp://h:5559", "tcp://h:5602")]
    assert ext.http_rank(2) == 0
    hybrid = parse_engine_spec("h=http://h:1,tcp://h:5557;dp=2;rank=2")
    assert hybrid.rank_endpoints() == [(2, "tcp://h:5559", None), (3, "tcp://h:5560", None)]
    assert [hybrid.http_rank(r) for r in hybrid.ranks] == [0, 1]
    with pytest.raises(ValueError, match="no data-parallel rank 1"):
        hybrid.http_rank(1)
    assert parse_engine_spec("a=tcp://h:5557;dp=2") == parse_engine_spec(
        "a=tcp://h:5557;dp=2;rank=0"
    )
    assert parse_engine_spec("a=inproc://kv;rank=3").rank_endpoints() == [
        (3, "inproc://kv_dp3", None)
    ]


@pytest.mark.parametrize(
    ("text", "kwargs", "message"),
    [
        ("a=tcp://h:2", {"require_http": True}, "missing the HTTP URL"),
        ("a=http://h:1", {"require_events": True}, "missing the events endpoint"),
        ("a=http://h:1,h:2", {}, "is not a ZMQ endpoint"),
        ("a b=tcp://h:2", {}, "may contain only"),
        ("a=tcp://h:2;dp=0", {}, "dp must be >= 1"),
        ("a=tcp://h:2;dp=x", {}, "dp must be a positive integer"),
        ("a=tcp://h:2;rank=-1", {}, "rank must be a non-negative integer"),
        ("a=tcp://h:2;rank=x", {}, "rank must be a non-negative integer"),
        ("a=tcp://h:2;rank=", {}, "rank must be a non-negative integer"),
        ("a=tcp://h:2;rank=1.5", {}, "rank must be a non-negative integer"),
        ("a=tcp://h:2;rank=\u00b2", {}, "rank must be a non-negative integer"),
        ("a=ipc:///tmp/kv;rank=1", {}, "cannot derive an endpoint for data-parallel rank 1"),
        ("a=tcp://h:65534;dp=2;rank=1", {}, "port 65536 is above 65535"),
        ("a=tcp://h:2;ranks=1", {}, "unknown option"),
    ],
)
def test_one_set_of_errors(text: str, kwargs: dict[str, bool], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        parse_engine_spec(text, **kwargs)
    assert isinstance(info.value, KVEventsError) and isinstance(info.value, ValueError)


def test_constructor_checks_what_the_parser_checks() -> None:
    with pytest.raises(ConfigError, match="must start with http"):
        EngineSpec("a", "ftp://h:1")
    with pytest.raises(ConfigError, match="not a ZMQ endpoint"):
        EngineSpec("a", None, "h:2")
    with pytest.raises(ConfigError, match="needs an events endpoint"):
        EngineSpec("a", "http://h:1", None, "tcp://h:3")
    with pytest.raises(ConfigError, match="missing the HTTP URL"):
        EngineSpec("a", None, "tcp://h:2").http_base()
    with pytest.raises(ConfigError, match="rank must be >= 0"):
        EngineSpec("a", None, "tcp://h:2", first_rank=-1)
    for bad in (True, 1.0, "1"):
        with pytest.raises(ConfigError, match="rank must be an integer"):
            EngineSpec("a", None, "tcp://h:2", first_rank=bad)  # type: ignore[arg-type]


def test_an_empty_endpoint_means_none() -> None:
    spec = EngineSpec("a", "http://h:1", "")
    assert spec.events_endpoint is None and spec.replay_endpoint is None
    assert not hasattr(spec, "dp") and not hasattr(spec, "url")
