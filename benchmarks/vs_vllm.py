"""Side by side with vLLM's own ``kv_events`` classes: decode, encode, publish → subscribe.

The reference is ``vllm.distributed.kv_events`` when it imports (install it by hand,
``pip install --no-deps vllm``, never as a project extra: its dependencies pull a CUDA
torch).  Without it the script says so in one line and runs against a stand-in: msgspec
Structs with vLLM 0.33's definitions and settings (``EventBatch`` array_like +
omit_defaults, events tagged maps with omit_defaults, gc=False), which is what vLLM's
typed decoder and encoder are, and a publisher thread doing what vLLM's
``ZmqEventPublisher`` does (blocking ``Queue.put``, encode on the thread, three-frame
``send_multipart``, replay deque).  The table's last column says which ran.

Workloads (batches of 64 events, 16-token blocks, u64 hashes, token ids < 150,000):
  gpu_1blk   64 GPU ``BlockStored`` of 1 block (16 token ids)
  gpu_4blk   64 GPU ``BlockStored`` of 4 blocks (64 token ids)
  mixed      32 GPU stores of 1 block + 16 CPU placeholders + 16 one-hash removals

Rows:
  decode      ``BatchDecoder.decode`` vs vLLM's ``msgspec.msgpack.Decoder(KVEventBatch)``
              of the same bytes (ours are byte-identical to vLLM's, checked)
  decode raw  ``BatchDecoder.decode_raw_tokens`` (token ids kept as msgpack) vs the same
  encode      ``encode_batch`` vs ``msgspec.msgpack.Encoder().encode`` of vLLM's objects
  e2e         events/s from a publisher process (``ZmqEventPublisher.publish`` in a
              tight loop) to a subscriber (ours: ``Subscriber``, receive + decode + seq
              tracking; vLLM's: a SUB socket + its typed decoder, vLLM has no subscriber),
              and each process's CPU per batch (every thread, user + kernel) and the
              cores both kept busy: on a small machine the pipeline may be bound by
              the cores rather than by either side

Codec rows are CPU time (``time.process_time``), ours and the reference interleaved rep by
rep, best of the reps: the machine may be shared.

Run: python benchmarks/vs_vllm.py [--quick]
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import resource
import sys
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import _vllm_standin
import msgspec
import zmq
from _common import parse_args, report, result

from kvevents import BatchDecoder, BlockRemoved, BlockStored, KVEventBatch, encode_batch

EVENTS = 64


# --- the reference ------------------------------------------------------------------------


def reference(verbose: bool = True) -> tuple[SimpleNamespace, str]:
    """vLLM's module when importable, else the stand-in; and its label."""
    try:
        import vllm
        from vllm.distributed import kv_events

        return SimpleNamespace(
            KVEventBatch=kv_events.KVEventBatch,
            BlockStored=kv_events.BlockStored,
            BlockRemoved=kv_events.BlockRemoved,
            ZmqEventPublisher=kv_events.ZmqEventPublisher,
        ), f"vllm {vllm.__version__}"
    except Exception as exc:  # vLLM absent, or present without its dependencies
        if verbose:
            print(
                f"vllm.distributed.kv_events not importable ({type(exc).__name__}: {exc}); "
                "baseline: msgspec stand-in of vLLM 0.33's classes"
            )
        return _vllm_standin.NAMESPACE, "stand-in (vLLM 0.33 classes)"


# --- workloads ----------------------------------------------------------------------------


def workloads(rng: random.Random) -> dict[str, list[tuple[str, tuple[Any, ...], dict[str, Any]]]]:
    """Each workload as (class name, args, kwargs) per event, built for either side."""

    def gpu(blocks: int) -> tuple[str, tuple[Any, ...], dict[str, Any]]:
        args = (
            [rng.getrandbits(64) for _ in range(blocks)],
            rng.getrandbits(64),
            [rng.randrange(150_000) for _ in range(16 * blocks)],
            16,
            None,
            "GPU",
            None,
        )
        return "BlockStored", args, {"group_idx": 0, "kv_cache_spec_kind": "full_attention"}

    def cpu() -> tuple[str, tuple[Any, ...], dict[str, Any]]:
        return "BlockStored", ([rng.getrandbits(64)], None, [], 0, None, "CPU", None), {}

    def rem() -> tuple[str, tuple[Any, ...], dict[str, Any]]:
        return "BlockRemoved", ([rng.getrandbits(64)], "GPU"), {"group_idx": 0}

    return {
        "gpu_1blk": [gpu(1) for _ in range(EVENTS)],
        "gpu_4blk": [gpu(4) for _ in range(EVENTS)],
        "mixed": [gpu(1) for _ in range(32)]
        + [cpu() for _ in range(16)]
        + [rem() for _ in range(16)],
    }


def build(ns: Any, spec: list[tuple[str, tuple[Any, ...], dict[str, Any]]], ts: float) -> Any:
    classes = {"BlockStored": ns.BlockStored, "BlockRemoved": ns.BlockRemoved}
    return ns.KVEventBatch(ts, [classes[c](*a, **k) for c, a, k in spec], 0)


OURS = SimpleNamespace(
    KVEventBatch=KVEventBatch, BlockStored=BlockStored, BlockRemoved=BlockRemoved
)


# --- timing -------------------------------------------------------------------------------


def interleaved(fns: dict[str, Callable[[], int]], reps: int, min_cpu: float) -> dict[str, float]:
    """Best items per CPU second of each fn (which returns the items it did), rep by rep."""
    best = dict.fromkeys(fns, 0.0)
    for _ in range(reps):
        for name, fn in fns.items():
            items = 0
            t0 = time.process_time()
            while True:
                items += fn()
                spent = time.process_time() - t0
                if spent >= min_cpu:
                    break
            best[name] = max(best[name], items / spent)
    return best


def loop(fn: Callable[[Any], Any], arg: Any, n: int = 20) -> Callable[[], int]:
    def run() -> int:
        for _ in range(n):
            fn(arg)
        return n * EVENTS

    return run


def bench_codec(ref: Any, label: str, quick: bool) -> list[dict[str, Any]]:
    reps, min_cpu = (3, 0.05) if quick else (9, 0.3)
    out = []
    vdec = msgspec.msgpack.Decoder(ref.KVEventBatch)
    venc = msgspec.msgpack.Encoder()
    for name, spec in workloads(random.Random(0)).items():
        ours, theirs = build(OURS, spec, 1.7e9), build(ref, spec, 1.7e9)
        payload = encode_batch(ours)
        same = venc.encode(theirs) == payload
        dec = BatchDecoder()
        assert dec.decode(payload) == ours and len(vdec.decode(payload).events) == EVENTS
        rates = interleaved(
            {
                "ref_decode": loop(vdec.decode, payload),
                "decode": loop(dec.decode, payload),
                "decode_raw": loop(dec.decode_raw_tokens, payload),
                "ref_encode": loop(venc.encode, theirs),
                "encode": loop(encode_batch, ours),
            },
            reps,
            min_cpu,
        )
        assert dec.stats.tolerant_batches == 0
        tag = f"{name}, vs {label}" + ("" if same else ", bytes differ")
        out += [
            result(f"decode {tag}", rates["decode"], "events/s", rates["ref_decode"]),
            result(
                f"decode raw tokens {tag}", rates["decode_raw"], "events/s", rates["ref_decode"]
            ),
            result(f"encode {tag}", rates["encode"], "events/s", rates["ref_encode"]),
        ]
    return out


# --- end to end ---------------------------------------------------------------------------


def _publisher(
    which: str, endpoint: str, n: int, spec: Any, go: Any, stop: Any, status: Any
) -> None:
    try:
        if which == "ours":
            from kvevents.publishers import ZmqEventPublisher

            ns: Any = OURS
            pub: Any = ZmqEventPublisher(0, endpoint)
        else:
            ns = reference(verbose=False)[0]
            pub = ns.ZmqEventPublisher(data_parallel_rank=0, endpoint=endpoint)
    except Exception as exc:  # the port was taken meanwhile: the parent picks another
        status.put(f"{type(exc).__name__}: {exc}")
        return
    status.put("ok")
    batches = [build(ns, spec, 1.0) for _ in range(8)]
    while not go.wait(0.01):  # probes until the subscriber has seen one
        pub.publish(ns.KVEventBatch(0.0, [], 0))
    before = _cpu()
    for i in range(n):
        pub.publish(batches[i % 8])
    stop.wait(120)  # (blocked: no CPU until the subscriber has everything)
    status.put(_cpu() - before)
    pub.shutdown()


def _cpu() -> float:
    """CPU seconds of this process so far, every thread (its ZMQ I/O threads too) and
    the kernel's work for them."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _run_e2e(which: str, spec: Any, n: int, ref_ns: Any) -> tuple[float, float, float, float]:
    """(events/s delivered, fraction delivered, the publisher process's CPU µs per
    batch, the subscriber process's) for one side."""
    ctx: zmq.Context[Any] = zmq.Context.instance()
    for _attempt in range(5):
        probe = ctx.socket(zmq.PUB)
        port = probe.bind_to_random_port("tcp://127.0.0.1")
        probe.close(0)
        endpoint = f"tcp://127.0.0.1:{port}"
        go, stop = mp.Event(), mp.Event()
        status: Any = mp.Queue()
        # "*" makes vLLM's (and our) publisher bind; a plain host:port would connect out.
        bind = f"tcp://*:{port}"
        proc = mp.Process(target=_publisher, args=(which, bind, n, spec, go, stop, status))
        proc.start()
        state = status.get(timeout=60)
        if state == "ok":
            break
        proc.join(10)
    else:
        raise RuntimeError(f"no free port for the publisher: {state}")
    got = 0
    first = last = 0.0
    try:
        if which == "ours":
            from kvevents.consumers import Subscriber, SubscriberOptions
            from kvevents.consumers.subscriber import ReceivedBatch

            sub = Subscriber(endpoint, options=SubscriberOptions(rcvhwm=0))
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                item = sub.receive(0.5)
                if isinstance(item, ReceivedBatch):
                    if not got:  # (a cross-process Event: set once, not per batch)
                        go.set()
                    if item.batch.ts == 1.0:
                        got += 1
                        last = time.perf_counter()
                        if got == 1:
                            first, cpu_first = last, _cpu()
                        if got == n:
                            break
                elif item is None and got:
                    break
            sub.close()
        else:
            dec = msgspec.msgpack.Decoder(ref_ns.KVEventBatch)
            s = ctx.socket(zmq.SUB)
            s.setsockopt(zmq.RCVHWM, 0)
            s.setsockopt(zmq.SUBSCRIBE, b"")
            s.connect(endpoint)
            while got < n:
                if not s.poll(30_000 if not got else 500):
                    break
                _topic, _seq, payload = s.recv_multipart()
                if not got:
                    go.set()
                batch = dec.decode(payload)
                if batch.ts == 1.0:
                    got += 1
                    last = time.perf_counter()
                    if got == 1:
                        first, cpu_first = last, _cpu()
            s.close(0)
        sub_cpu = _cpu() - cpu_first if got else 0.0
    finally:
        stop.set()
        pub_cpu = status.get(timeout=60) if got else 0.0
        proc.join(30)
    rate = (got - 1) * EVENTS / (last - first) if got > 1 and last > first else 0.0
    per_batch = 1e6 / max(1, got)
    return rate, got / n, pub_cpu * per_batch, sub_cpu * per_batch


def bench_e2e(ref: Any, label: str, quick: bool) -> list[dict[str, Any]]:
    n = 2_000 if quick else 20_000
    spec = workloads(random.Random(1))["gpu_1blk"]
    best = {"ours": (0.0, 0.0, 0.0, 0.0), "ref": (0.0, 0.0, 0.0, 0.0)}
    for _ in range(1 if quick else 3):
        for which in ("ref", "ours"):
            r = _run_e2e(which, spec, n, ref)
            best[which] = max(best[which], r)
    ours, theirs = best["ours"], best["ref"]
    return [
        result(f"e2e publish -> subscriber, gpu_1blk, vs {label}", ours[0], "events/s", theirs[0]),
        result("e2e delivered fraction (ours)", ours[1], "fraction", theirs[1]),
        # Where the time goes (the best run's): each process's CPU, all its threads and
        # the kernel's work for them, per 64-event batch delivered.  Over the wall time
        # per batch, their sum says how many cores the pipeline kept busy.
        result("e2e publisher process CPU per batch", ours[2], "us", theirs[2]),
        result("e2e subscriber process CPU per batch", ours[3], "us", theirs[3]),
        result(
            "e2e cores busy (both processes)",
            _cores(ours),
            "cores",
            _cores(theirs),
        ),
    ]


def _cores(run: tuple[float, float, float, float]) -> float:
    """CPU time of both processes over wall time, for a run of ``_run_e2e``."""
    rate, _, pub_us, sub_us = run
    return (pub_us + sub_us) * rate / EVENTS / 1e6 if rate else 0.0


def main() -> None:
    args = parse_args(__doc__ or "")
    ref, label = reference()
    results = bench_codec(ref, label, args.quick)
    results += bench_e2e(ref, label, args.quick)
    report("vs_vllm", results)


if __name__ == "__main__":
    main()
