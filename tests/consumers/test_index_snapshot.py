"""BlockIndex.snapshot() / restore(): a restored index is the same index.

The differential state machine of ``test_index_differential`` runs again with one more
rule that swaps the index for ``BlockIndex.restore(index.snapshot())`` at random points;
every later step must still agree with the reference model, so any state a snapshot
dropped (pending joins, retained metadata, refcounts, counted marks, learned chunk size)
shows up.  A simulated engine's stream checks answers and bytes after more events.
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis.stateful import rule
from test_index_differential import IndexVsModel

from kvevents.consumers import BlockIndex, Router
from kvevents.errors import ConfigError
from kvevents.events import BlockStored, KVEventBatch
from kvevents.sim import SimEngineConfig, WorkloadConfig, generate_workload
from kvevents.sim.block_pool import KVCacheGroupSpec
from kvevents.sim.engine import SimEngine


class IndexVsModelAcrossSnapshots(IndexVsModel):
    @rule()
    def snapshot_and_restore(self) -> None:
        self.index = BlockIndex.restore(self.index.snapshot())
        self.router = Router(self.index)


IndexVsModelAcrossSnapshots.TestCase.settings = settings(
    max_examples=100, stateful_step_count=35, deadline=None
)
TestIndexVsModelAcrossSnapshots = IndexVsModelAcrossSnapshots.TestCase


class _Sink:
    def __init__(self) -> None:
        self.batches: list[KVEventBatch] = []

    def publish(self, batch: KVEventBatch) -> None:
        self.batches.append(batch)

    def shutdown(self) -> None:
        return None


def _run(engine: SimEngine, n: int, seed: int) -> None:
    for r in generate_workload(WorkloadConfig(num_requests=n, seed=seed)):
        engine.add_request(r)
    while not engine.idle:
        engine.step()


@pytest.mark.parametrize("block_sizes", [(16,), (16, 32)])
def test_a_restored_index_answers_and_applies_as_the_original(
    block_sizes: tuple[int, ...],
) -> None:
    sink = _Sink()
    groups = tuple(KVCacheGroupSpec(b) for b in block_sizes)
    config = SimEngineConfig(
        groups=groups, num_gpu_blocks=96, num_cpu_chunks=64, blocks_per_chunk=2
    )
    engine = SimEngine(config, sink)
    _run(engine, 200, seed=3)
    original = BlockIndex()
    for b in sink.batches:
        original.apply("e", 0, b)
    data = original.snapshot()
    restored = BlockIndex.restore(data)
    prompts = [r.prompt for r in generate_workload(WorkloadConfig(num_requests=60, seed=9))]
    a, b = Router(original), Router(restored)
    assert restored.resident_count == original.resident_count > 0
    assert [a.find_matches(p) for p in prompts] == [b.find_matches(p) for p in prompts]
    sink.batches.clear()
    _run(engine, 80, seed=4)  # the stream goes on: both indexes apply it
    for batch in sink.batches:
        original.apply("e", 0, batch)
        restored.apply("e", 0, batch)
    assert original.summary() == restored.summary()
    assert [a.find_matches(p) for p in prompts] == [b.find_matches(p) for p in prompts]
    assert restored.snapshot() == original.snapshot()  # deterministic, nothing lost


def test_garbage_is_refused_with_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="not a kvevents index snapshot"):
        BlockIndex.restore(b"\x93garbage")
    good = BlockIndex().snapshot()
    with pytest.raises(ConfigError):
        BlockIndex.restore(good[:-3])


def test_a_snapshot_of_another_field_layout_is_refused_for_slotted_classes_too() -> None:
    """The snapshot names each class's fields; a class whose fields differ now (a slotted
    class included, not only dataclasses) makes the restore refuse, naming it."""
    import msgspec

    index = BlockIndex(max_blocks=100)
    index.apply("e", 0, KVEventBatch(0.0, [BlockStored([1, 2], None, list(range(32)), 16,
                                                       None, "GPU", None)]))  # fmt: skip
    header, state = msgspec.msgpack.decode(index.snapshot())
    slotted = [k for k in header["schema"] if k.endswith("Eviction")]
    assert slotted, header["schema"].keys()
    header["schema"][slotted[0]] = [*header["schema"][slotted[0]], "a_field_gone_since"]
    with pytest.raises(ConfigError, match="Eviction differently"):
        BlockIndex.restore(msgspec.msgpack.encode([header, state]))
