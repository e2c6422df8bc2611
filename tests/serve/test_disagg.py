"""The disaggregation protocol's shapes and the engine role, without servers: the
prefill step's body, the decode step's body carrying the prefill answer's
``kv_transfer_params`` byte for byte, and ``;role=`` in engine specs and config files."""

from __future__ import annotations

import json

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvevents.engines import parse_engine_spec
from kvevents.errors import ConfigError
from kvevents.serve.config import load_config
from kvevents.serve.disagg import PREFILL_PARAMS, answer_params, decode_body, prefill_body

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8)
    | st.floats(allow_nan=False, allow_infinity=False),
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=6), c, max_size=4),
    max_leaves=12,
)  # fmt: skip


def test_prefill_body_follows_the_connector_protocol() -> None:
    raw = (
        b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": true,'
        b' "stream_options": {"include_usage": true}, "max_tokens": 50,'
        b' "max_completion_tokens": 40, "temperature": 0.70}'
    )
    body = json.loads(prefill_body(raw))
    assert body["kv_transfer_params"] == PREFILL_PARAMS
    assert body["max_tokens"] == 1 and body["max_completion_tokens"] == 1
    assert body["stream"] is False and "stream_options" not in body
    assert b'"temperature":0.70' in prefill_body(raw)  # other values keep their bytes
    no_mct = json.loads(prefill_body(b'{"prompt": "x"}'))
    assert "max_completion_tokens" not in no_mct and no_mct["max_tokens"] == 1


@given(st.dictionaries(st.text(max_size=8), json_values, max_size=5), json_values)
def test_decode_body_carries_the_answers_parameters_byte_for_byte(
    body: dict[str, object], params: object
) -> None:
    raw = json.dumps(body).encode()
    params_text = json.dumps(params, indent=1)  # any spacing: copied as it came
    answer = b'{"id": "cmpl-1", "kv_transfer_params": ' + params_text.encode() + b"}"
    got = answer_params(answer)
    if params is None:
        assert got is None
        return
    assert got is not None and bytes(got) == params_text.encode()
    out = decode_body(raw, got)
    assert b'"kv_transfer_params":' + params_text.encode() in out
    decoded = json.loads(out)
    assert decoded["kv_transfer_params"] == params
    assert {k: v for k, v in decoded.items() if k != "kv_transfer_params"} == {
        k: v for k, v in body.items() if k != "kv_transfer_params"
    }


def test_answers_without_parameters() -> None:
    assert answer_params(b'{"id": "x"}') is None
    assert answer_params(b'{"kv_transfer_params": null}') is None
    assert answer_params(b"not json") is None
    assert isinstance(answer_params(b'{"kv_transfer_params": {}}'), msgspec.Raw)


def test_engine_role_in_specs_and_config_files(tmp_path: object) -> None:
    spec = parse_engine_spec("p0=http://h:1,tcp://h:2;role=prefill")
    assert spec.role == "prefill"
    assert parse_engine_spec(spec.spec()) == spec
    assert parse_engine_spec("b=http://h:1,tcp://h:2").role == "both"
    with pytest.raises(ConfigError, match="role must be one of"):
        parse_engine_spec("x=http://h:1,tcp://h:2;role=draft")
    import pathlib

    assert isinstance(tmp_path, pathlib.Path)
    cfg = tmp_path / "serve.toml"
    cfg.write_text(
        "pd_min_uncached_tokens = 128\n"
        '[[engine]]\nname = "d0"\nurl = "http://h:1"\nevents = "tcp://h:2"\nrole = "decode"\n'
    )
    config = load_config(config_file=str(cfg), environ={})
    assert config.engines[0].role == "decode" and config.pd_min_uncached_tokens == 128


def test_loadgen_reports_reuse_and_ttft_per_path() -> None:
    from kvevents.serve.loadgen import LoadgenConfig, LoadgenReport, RequestRecord, format_loadgen

    split = RequestRecord(0, 1, True, 200, "decode-0:0", 0.2, 0.5, 100, 99, 8)
    split.prefill, split.prefill_cached = "prefill-0:0", 64
    whole = RequestRecord(1, 0, True, 200, "decode-1:0", 0.1, 0.3, 50, 16, 8)
    report = LoadgenReport(LoadgenConfig("http://x"), [split, whole], 1.0)
    paths = report.to_json()["paths"]
    # a split request's reuse is its prefill engine's, not the decode's transferred prefix
    assert paths["disaggregated"]["prefix_reuse"] == 0.64
    assert paths["whole"]["prefix_reuse"] == 0.32
    assert paths["disaggregated"]["ttft_p50_s"] == 0.2
    text = format_loadgen(report)
    assert "prefill      prefill-0:0: 1" in text and "disaggregated 1 requests" in text


def test_a_decode_engine_gone_is_failed_over_with_the_same_parameters() -> None:
    pytest.importorskip("uvicorn")
    import httpx

    from kvevents.demo.stack import LocalStack
    from kvevents.serve import ServeConfig

    serve = ServeConfig(scrape_interval_s=60.0, pd_min_uncached_tokens=16)
    with LocalStack(0, serve=serve, prefill=1, decode=2) as stack:
        names = [e.name for e in stack.engines]
        stack.stop_engine(names.index("decode-0"))  # the service has not noticed yet
        for i in range(3):
            body = {
                "messages": [{"role": "user", "content": f"Tell me story {i}. " * 20}],
                "max_tokens": 4,
            }
            r = httpx.post(stack.url + "/v1/chat/completions", json=body, timeout=30)
            assert r.status_code == 200, r.text
            assert r.headers["x-kvevents-prefill"] == "prefill-0:0"
            assert r.headers["x-kvevents-worker"] == "decode-1:0"
        decode1 = stack.engines[names.index("decode-1")]
        assert len(decode1.transfers.received) == 3
        assert decode1.transfers.received.keys() == stack.engines[0].transfers.sent.keys()
