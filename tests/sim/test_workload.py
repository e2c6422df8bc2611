"""The seeded chat workload: deterministic, shared system prompts, growing sessions."""

from __future__ import annotations

import pytest

from kvevents.errors import ConfigError
from kvevents.sim import SimRequest, WorkloadConfig, generate_workload


def test_same_seed_same_requests_and_a_new_seed_changes_them() -> None:
    cfg = WorkloadConfig(num_requests=50, seed=7)
    assert generate_workload(cfg) == generate_workload(cfg)
    other = generate_workload(WorkloadConfig(num_requests=50, seed=8))
    assert [r.prompt for r in other] != [r.prompt for r in generate_workload(cfg)]


def test_later_turns_extend_the_earlier_prompt_and_answer() -> None:
    reqs = generate_workload(WorkloadConfig(num_requests=120, seed=3))
    last: dict[int, SimRequest] = {}
    followups = 0
    for r in reqs:
        prev = last.get(r.session)
        if prev is None:
            assert r.turn == 0
        else:
            assert r.turn == prev.turn + 1
            history = prev.prompt + prev.output
            assert r.prompt[: len(history)] == history
            assert len(r.prompt) > len(history)
            followups += 1
        last[r.session] = r
    assert followups > 40


def test_every_request_of_a_tenant_starts_with_its_system_prompt() -> None:
    cfg = WorkloadConfig(num_requests=80, num_tenants=3, system_prompt_tokens=(40, 40), seed=1)
    reqs = generate_workload(cfg)
    heads: dict[int, set[tuple[int, ...]]] = {}
    for r in reqs:
        heads.setdefault(r.tenant, set()).add(r.prompt[:40])
    assert len(heads) == 3
    assert all(len(h) == 1 for h in heads.values())
    assert len({next(iter(h)) for h in heads.values()}) == 3


def test_request_count_and_ids_are_exact_and_unique() -> None:
    reqs = generate_workload(WorkloadConfig(num_requests=33, seed=0))
    assert len(reqs) == 33
    assert len({r.request_id for r in reqs}) == 33


@pytest.mark.parametrize(
    "bad",
    [
        {"num_tenants": 0},
        {"output_tokens": (5, 2)},
        {"turns_per_session": (0, 2)},
        {"vocab_size": 1},
    ],
)
def test_bad_configs_are_refused_with_a_clear_error(bad: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        generate_workload(WorkloadConfig(**bad))  # type: ignore[arg-type]
