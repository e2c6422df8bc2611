"""Torch block transfers: device KV blocks → host chunks → other device blocks, bit-exact."""

from __future__ import annotations

import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from kvevents.errors import OffloadError  # noqa: E402
from kvevents.publishers.offload import (  # noqa: E402
    CPULoadStoreSpec,
    CPUOffloadingManager,
    GPULoadStoreSpec,
    LookupResult,
    ReqContext,
    make_offload_key,
)
from kvevents.publishers.offload import transfer as transfer_module  # noqa: E402
from kvevents.publishers.offload.transfer import (  # noqa: E402
    CPUTransferWorker,
    HostChunkBuffers,
    OffloadTransferDriver,
)

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.cuda,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
        ],
    ),
]


@pytest.fixture(autouse=True, params=["small-transfer path on", "small-transfer path off"])
def _small_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test runs twice: as is (transfers of up to 256 KiB take the one-call NumPy
    path) and with that path off, so the small tensors here also exercise the torch
    gather, scatter and staged copies."""
    if request.param.endswith("off"):
        monkeypatch.setattr(transfer_module, "_SMALL_TRANSFER_BYTES", 0)


def kv_layers(device: str, num_blocks: int = 16, layers: int = 3, seed: int = 0) -> list:
    """Random KV tensors: (num_blocks, 2 [K,V], block_size 4, heads 2, head_dim 8)."""
    gen = torch.Generator().manual_seed(seed)
    dtypes = [torch.float16, torch.bfloat16, torch.float32]
    return [
        torch.randn((num_blocks, 2, 4, 2, 8), generator=gen).to(dtypes[i % 3]).to(device)
        for i in range(layers)
    ]


def same_bytes(a: object, b: object) -> bool:
    return bool(torch.equal(a.contiguous().view(torch.int8), b.contiguous().view(torch.int8)))  # type: ignore[attr-defined]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bpc", [1, 2, 3])
def test_store_then_load_into_other_blocks_is_bit_identical(device: str, bpc: int) -> None:
    layers = kv_layers(device, num_blocks=24)
    originals = [t.clone() for t in layers]
    worker = CPUTransferWorker(layers, num_chunks=6, blocks_per_chunk=bpc)
    assert worker.buffers.pinned == torch.cuda.is_available()

    src_blocks = [5, 2, 7, 1, 11, 3, 9, 0, 4][: 3 * bpc]  # 3 chunks, scattered blocks
    chunks = CPULoadStoreSpec([4, 0, 2])  # scattered, non-monotone chunk ids
    worker.submit_store(7, src_blocks, chunks)
    worker.wait()
    (res,) = worker.get_finished()
    assert (res.job_id, res.success) == (7, True)
    assert res.bytes == len(src_blocks) * worker.buffers.bytes_per_block
    # vLLM's names for the same figures (C§5.6: TransferResult(job_id, success,
    # transfer_size, transfer_time)).
    assert (res.transfer_size, res.transfer_time) == (res.bytes, res.seconds)

    # host chunk c, sub-block j holds device block src_blocks[c_index * bpc + j]
    for dev, host in zip(layers, worker.buffers.host):
        rows = dev.reshape(dev.shape[0], -1).view(torch.int8).cpu()
        for ci, chunk in enumerate([4, 0, 2]):
            expect = torch.cat([rows[b] for b in src_blocks[ci * bpc : (ci + 1) * bpc]])
            assert torch.equal(host[chunk], expect)

    dst_blocks = [20, 13, 17, 22, 14, 21, 12, 23, 15][: 3 * bpc]
    worker.submit_load(8, chunks, dst_blocks)
    worker.wait()
    assert [r.job_id for r in worker.get_finished()] == [8]
    for dev, orig in zip(layers, originals):
        for s, d in zip(src_blocks, dst_blocks):
            assert same_bytes(dev[d], orig[s])
        untouched = sorted(set(range(24)) - set(dst_blocks))
        assert same_bytes(dev[untouched], orig[untouched])


@pytest.mark.parametrize("device", DEVICES)
def test_driver_runs_manager_through_store_and_load(device: str) -> None:
    bpc = 2
    layers = kv_layers(device, num_blocks=32, layers=2, seed=1)
    originals = [t.clone() for t in layers]
    manager = CPUOffloadingManager(num_chunks=3, cache_policy="arc", enable_events=True)
    driver = OffloadTransferDriver(manager, CPUTransferWorker(layers, 3, bpc))
    ctx = ReqContext("r1")
    keys = [make_offload_key(bytes([i]) * 8, 0) for i in range(4)]
    where = {k: [2 * i + 1, 2 * i + 8] for i, k in enumerate(keys)}

    out = driver.store(keys[:3], where, ctx)
    assert out is not None and out.store_spec.block_ids.tolist() == [0, 1, 2]
    assert manager.lookup(keys[0]) in (LookupResult.HIT_PENDING, LookupResult.HIT)
    results = driver.flush()
    assert [r.success for r in results] == [True]
    assert manager.lookup(keys[0]) == LookupResult.HIT
    assert [e.removed for e in manager.take_events()] == [False]

    # load keys 2 and 0 into fresh blocks; the chunks stay pinned until completion
    dest = {keys[2]: [30, 31], keys[0]: [28, 29]}
    driver.load([keys[2], keys[0]], dest, ctx)
    evicting = manager.prepare_store([keys[3]], ctx)
    assert evicting is not None and evicting.evicted_keys == [keys[1]]  # the only unpinned
    driver.flush()
    assert manager.chunk_status(keys[0]).ref_cnt == 0  # type: ignore[union-attr]
    for dev, orig in zip(layers, originals):
        for k in (keys[2], keys[0]):
            for s, d in zip(where[k], dest[k]):
                assert same_bytes(dev[d], orig[s])


def test_bad_specs_raise_before_copying_and_driver_rolls_back() -> None:
    layers = kv_layers("cpu", num_blocks=8, layers=1)
    worker = CPUTransferWorker(layers, num_chunks=2, blocks_per_chunk=2)
    with pytest.raises(OffloadError, match="do not fill"):
        worker.submit_store(0, [1, 2, 3], CPULoadStoreSpec([0]))
    with pytest.raises(OffloadError, match="device block ids"):
        worker.submit_store(0, [1, 99], CPULoadStoreSpec([0]))
    with pytest.raises(OffloadError, match="chunk ids"):
        worker.submit_store(0, [1, 2], CPULoadStoreSpec([5]))
    with pytest.raises(OffloadError, match="named twice"):
        worker.submit_store(0, [1, 2, 3, 4], CPULoadStoreSpec([1, 1]))
    with pytest.raises(OffloadError, match="named twice"):
        worker.submit_load(0, CPULoadStoreSpec([0]), [3, 3])
    assert worker.num_pending == 0 and worker.stats.stores == worker.stats.loads == 0

    manager = CPUOffloadingManager(2)
    driver = OffloadTransferDriver(manager, worker)
    key = make_offload_key(b"k", 0)
    with pytest.raises(OffloadError, match="device block ids"):
        driver.store([key], {key: [0, 50]})
    assert manager.lookup(key) == LookupResult.MISS  # the failed store was released
    assert manager.num_free_chunks == 2


@pytest.mark.parametrize(
    ("src", "chunk_ids", "dst"),
    [
        # consecutive chunks, scattered blocks: store gathers into host runs, load scatters
        ([9, 2, 14, 5, 0, 11], [0, 1, 2], [13, 3, 8, 1, 15, 6]),
        # consecutive blocks, scattered chunks: store scatters, load gathers into one run
        ([4, 5, 6, 7, 8, 9], [5, 0, 3], [10, 11, 12, 13, 14, 15]),
        # both consecutive: one run either way
        ([0, 1, 2, 3, 4, 5], [1, 2, 3], [10, 11, 12, 13, 14, 15]),
    ],
)
def test_both_copy_strategies_are_exact(
    src: list[int], chunk_ids: list[int], dst: list[int]
) -> None:
    layers = [torch.randn(16, 3, 64).to(torch.bfloat16), torch.randn(16, 5, 7).to(torch.float16)]
    originals = [t.clone() for t in layers]
    worker = CPUTransferWorker(layers, num_chunks=6, blocks_per_chunk=2)
    worker.submit_store(0, src, CPULoadStoreSpec(chunk_ids))
    worker.submit_load(1, CPULoadStoreSpec(chunk_ids), dst)
    assert [r.success for r in worker.get_finished()] == [True, True]
    for dev, orig in zip(layers, originals):
        assert same_bytes(dev[dst], orig[src])
    assert worker.buffers.device_words[0].dtype == torch.complex128  # 384-byte pages
    assert worker.buffers.device_words[1].dtype == torch.int16  # 70-byte pages


def test_every_bit_pattern_survives_the_wide_copies() -> None:
    # NaN payloads (signalling and quiet), infinities, negative zero and all-ones in every
    # 8-byte lane, for pages copied as 16-byte (complex128) and 8-byte elements.
    nans = [0x7FF0000000000001, 0x7FF8000000000001, -0x000FFFFFFFFFFFFF, 0x7FF4000000000000]
    patterns = torch.tensor([*nans, 1, -(2**63), -1, 0x7FF0000000000000], dtype=torch.int64)
    for lanes, wide in ((64, torch.complex128), (3, torch.int64)):
        blocks = patterns.repeat(8 * lanes).view(8 * 8, lanes)[:8].contiguous()
        layers = [torch.cat([blocks, blocks.flip(0)]).clone()]
        originals = [t.clone() for t in layers]
        worker = CPUTransferWorker(layers, num_chunks=8, blocks_per_chunk=1)
        assert worker.buffers.device_words[0].dtype == wide
        src = [13, 2, 7, 0, 9]
        worker.submit_store(0, src, CPULoadStoreSpec([6, 1, 4, 3, 0]))
        dst = [1, 15, 4, 11, 8]
        worker.submit_load(1, CPULoadStoreSpec([6, 1, 4, 3, 0]), dst)
        assert [r.success for r in worker.get_finished()] == [True, True]
        assert torch.equal(layers[0][dst], originals[0][src])


def test_same_device_block_stored_into_two_chunks() -> None:
    # Repeated source blocks (4 and 5 twice) into scattered chunks.
    layers = [torch.randn(8, 32)]
    worker = CPUTransferWorker(layers, num_chunks=8, blocks_per_chunk=1)
    worker.submit_store(0, [4, 5, 4, 5], CPULoadStoreSpec([0, 2, 4, 6]))
    rows = layers[0].view(torch.int8)
    host = worker.buffers.host_rows[0]
    for chunk, block in zip([0, 2, 4, 6], [4, 5, 4, 5]):
        assert torch.equal(host[chunk], rows[block])
    assert not host[[1, 3, 5, 7]].any()


def test_small_pages_scattered_load_uses_one_scatter_and_stays_exact() -> None:
    # 64-byte pages, scattered destinations: the load takes the scatter path.
    layers = [torch.randn(64, 16) for _ in range(2)]
    originals = [t.clone() for t in layers]
    worker = CPUTransferWorker(layers, num_chunks=8, blocks_per_chunk=2)
    src = [9, 3, 40, 41, 7, 60, 2, 33]
    worker.submit_store(0, src, CPULoadStoreSpec([5, 1, 6, 0]))
    dst = [50, 10, 22, 13, 1, 62, 30, 17]
    worker.submit_load(1, CPULoadStoreSpec([5, 1, 6, 0]), dst)
    assert [r.success for r in worker.get_finished()] == [True, True]
    for dev, orig in zip(layers, originals):
        assert same_bytes(dev[dst], orig[src])


def test_load_gathers_when_scattering_needs_many_more_calls() -> None:
    # one chunk per block, 8 scattered chunks loaded into 8 consecutive device blocks:
    # one gather run against 8 scatter runs, so the load gathers
    layers = [torch.randn(32, 24).to(torch.float16), torch.randn(32, 5, 3)]
    originals = [t.clone() for t in layers]
    worker = CPUTransferWorker(layers, num_chunks=10, blocks_per_chunk=1)
    src = [30, 2, 17, 8, 25, 11, 4, 21]
    chunks = CPULoadStoreSpec([7, 0, 9, 3, 5, 1, 8, 2])
    worker.submit_store(0, src, chunks)
    dst = list(range(12, 20))
    worker.submit_load(1, chunks, dst)
    assert [r.success for r in worker.get_finished()] == [True, True]
    for dev, orig in zip(layers, originals):
        assert same_bytes(dev[dst], orig[src])


@pytest.mark.parametrize("page_floats", [16384, 65536, 3 * 16384])
@pytest.mark.parametrize("layers_n", [1, 2])
def test_large_transfers_are_exact(page_floats: int, layers_n: int) -> None:
    # 64, 256 and 192 KiB pages, 160 blocks a transfer: the wide pages are copied as
    # sub-rows (256 KiB as four of 64 KiB, 192 KiB as two of 96 KiB).  Scattered and
    # consecutive chunks; one tensor and several.
    gen = torch.Generator().manual_seed(page_floats + layers_n)
    layers = [torch.randn((320, page_floats), generator=gen) for _ in range(layers_n)]
    originals = [t.clone() for t in layers]
    worker = CPUTransferWorker(layers, num_chunks=100, blocks_per_chunk=2)
    src = torch.randperm(320, generator=gen)[:160].tolist()
    dst = [b for b in range(320) if b not in set(src)][:160]
    for chunk_ids in (torch.randperm(100, generator=gen)[:80].tolist(), list(range(10, 90))):
        worker.submit_store(0, src, CPULoadStoreSpec(chunk_ids))
        worker.submit_load(1, CPULoadStoreSpec(chunk_ids), dst)
        assert [r.success for r in worker.get_finished()] == [True, True]
        for dev, orig in zip(layers, originals):
            assert same_bytes(dev[dst], orig[src])
            assert same_bytes(dev[src], orig[src])  # the sources were not written
            dev[dst] = 0
    worker.close()


def test_wide_pages_stored_twice_from_one_block_are_exact() -> None:
    # A repeated source block with 256 KiB pages: the store gathers sub-rows.
    layers = [torch.randn(6, 65536)]
    worker = CPUTransferWorker(layers, num_chunks=4, blocks_per_chunk=1)
    worker.submit_store(0, [3, 1, 3], CPULoadStoreSpec([2, 0, 1]))
    assert [r.success for r in worker.get_finished()] == [True]
    rows = layers[0].view(torch.int8)
    host = worker.buffers.host_rows[0]
    for chunk, block in zip([2, 0, 1], [3, 1, 3]):
        assert torch.equal(host[chunk], rows[block])
    assert not host[3].any()


def test_scattered_on_both_sides_goes_through_the_reused_staging_buffer_exactly() -> None:
    # Device blocks and host chunks both scattered (several runs on each side): each
    # tensor's share is copied through a staging buffer kept between transfers.  Pages
    # of 384 bytes (complex128 words), 70 bytes (int16) and 256 KiB (split into sub-rows);
    # transfers of growing, then shrinking size; one store repeats a device block.
    gen = torch.Generator().manual_seed(7)
    layers = [
        torch.randn((40, 3, 64), generator=gen).to(torch.bfloat16),
        torch.randn((40, 5, 7), generator=gen).to(torch.float16),
        torch.randn((40, 65536), generator=gen),
    ]
    originals = [t.clone() for t in layers]
    worker = CPUTransferWorker(layers, num_chunks=20, blocks_per_chunk=2)
    for n, seed in ((4, 1), (12, 2), (6, 3)):
        g = torch.Generator().manual_seed(seed)
        src = torch.randperm(20, generator=g)[:n].tolist()  # blocks 0..19 hold data
        chunks = CPULoadStoreSpec(torch.randperm(20, generator=g)[: n // 2].tolist())
        dst = (20 + torch.randperm(20, generator=g)[:n]).tolist()  # blocks 20..39
        worker.submit_store(0, src, chunks)
        worker.submit_load(1, chunks, dst)
        assert [r.success for r in worker.get_finished()] == [True, True]
        for dev, orig in zip(layers, originals):
            assert same_bytes(dev[dst], orig[src])
            assert same_bytes(dev[:20], orig[:20])  # the sources were not written
    assert set(worker._stage) == {torch.complex128, torch.int16}  # the path was taken
    worker.submit_store(2, [3, 9, 3, 14], CPULoadStoreSpec([7, 2]))
    assert [r.success for r in worker.get_finished()] == [True]
    for dev, host in zip(worker.buffers.device_rows, worker.buffers.host_rows):
        for row, block in zip([14, 15, 4, 5], [3, 9, 3, 14]):
            assert torch.equal(host[row], dev[block])


def test_partial_first_chunk_skip() -> None:
    layers = kv_layers("cpu", num_blocks=8, layers=1)
    worker = CPUTransferWorker(layers, num_chunks=2, blocks_per_chunk=4)
    # request-relative block 2 is the first: it lands in sub-block 2 of chunk 1
    worker.submit_store(0, GPULoadStoreSpec([6, 7], block_indices=[2]), CPULoadStoreSpec([1]))
    rows = layers[0].reshape(8, -1).view(torch.int8)
    host_rows = worker.buffers.host_rows[0]
    assert torch.equal(host_rows[1 * 4 + 2], rows[6]) and torch.equal(host_rows[1 * 4 + 3], rows[7])
    assert not host_rows[4].any()  # skipped sub-blocks untouched


def test_buffers_reject_mismatched_tensors() -> None:
    with pytest.raises(OffloadError, match="share one device"):
        HostChunkBuffers([torch.zeros(4, 8), torch.zeros(5, 8)], 2)
    with pytest.raises(OffloadError, match="contiguous"):
        HostChunkBuffers([torch.zeros(8, 4).t()], 2)


def test_package_import_does_not_import_torch() -> None:
    code = (
        "import sys, kvevents.publishers.offload as o; "
        "o.CPUOffloadingManager(2); o.OffloadEventTranslator(); "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
