"""``kvevents demo --disaggregated``: prefill and decode engines, the KV-aware prefill
choice against round-robin, reuse counted by the prefill engines themselves."""

from __future__ import annotations

import json

import pytest

from kvevents.cli import main

pytest.importorskip("uvicorn")


@pytest.mark.timeout(300)
def test_kv_aware_prefill_choice_reuses_more_than_round_robin(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["demo", "--disaggregated", "--quick", "--prefill", "3", "--decode", "1"]
    assert main([*argv, "--json", "-q"]) == 0
    runs = {r["policy"]: r for r in json.loads(capsys.readouterr().out)["disaggregated"]}
    kv, rr = runs["kv-aware"], runs["round-robin"]
    for r in (kv, rr):
        assert r["failed"] == 0 and r["requests"] == 72
        assert r["disaggregated"] > r["requests"] // 2  # most requests ran in two steps
        assert sum(r["prefills"].values()) == r["disaggregated"]
        assert r["decode_received_tokens"] > 0  # the decode engines took the prefixes
    assert len(rr["prefills"]) == 3  # round-robin spread the prefill steps
    assert kv["prefill_reuse"] > rr["prefill_reuse"] + 0.03
    assert kv["prefill_computed_tokens"] < rr["prefill_computed_tokens"]
    # the prefill engines' reported cached_tokens mostly match the prediction
    assert kv["truth_exact"] >= 0.8 * kv["truth_checks"]
