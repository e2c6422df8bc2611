"""Route prompts to the engine that already holds the longest prefix of their tokens.

A KV-aware router in one file: a ``Subscriber`` follows the engines, a ``BlockIndex``
holds what each one caches (GPU blocks, and CPU chunks joined to their GPU metadata),
and a ``Router`` answers, for each prompt, which engine would reuse the most of it and
how many tokens from each tier, counted the way vLLM's engine reuses them (whole GPU
blocks first, then whole CPU chunks after the GPU hit).

The loop is single-threaded: catch up with every event received so far, then answer.
With two engines of ``examples/publish_engine.py`` serving different tenants::

    python examples/publish_engine.py --tenants 0 --requests 0 &
    python examples/publish_engine.py --tenants 1,2 --requests 0 \\
        --endpoint tcp://127.0.0.1:5567 --replay-endpoint tcp://127.0.0.1:5568 &
    python examples/route_prompts.py tcp://127.0.0.1:5557 tcp://127.0.0.1:5567 \\
        --replay-endpoint tcp://127.0.0.1:5558 --replay-endpoint tcp://127.0.0.1:5568

each tenant's prompts go to the engine that serves that tenant.  Prompts come from
``--prompts FILE`` (one JSON list of token ids per line) or, by default, one prompt per
tenant of ``publish_engine.py``: its system prompt plus a new question.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

from follow_loop import add_follow_arguments, catch_up

from kvevents.consumers import BlockIndex, Router, Subscriber


def sample_prompts() -> list[list[int]]:
    """One prompt per tenant of publish_engine.py: its system prompt and a new question."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from publish_engine import system_prompts

    rng = random.Random(99)
    return [p + [rng.randrange(32000, 33000) for _ in range(40)] for p in system_prompts()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_follow_arguments(p, stop=False)
    p.add_argument("--prompts", help="JSON lines, each a list of token ids")
    p.add_argument(
        "--settle",
        type=float,
        default=0.5,
        help="route once every engine was heard from and nothing new came for S seconds "
        "(or, engines busy, 10 S seconds after the last was first heard)",
    )
    p.add_argument(
        "--timeout", type=float, default=30.0, help="give up when an engine is silent for S s"
    )
    p.add_argument("--json", action="store_true", help="one JSON object per prompt")
    args = p.parse_args()

    if args.prompts:
        lines = Path(args.prompts).read_text().splitlines()
        prompts = [json.loads(line) for line in lines if line.strip()]
    else:
        prompts = sample_prompts()

    index = BlockIndex()
    router = Router(index)
    with Subscriber(args.endpoints, replay_endpoints=args.replay_endpoint) as sub:
        print(f"following {', '.join(args.endpoints)}", file=sys.stderr, flush=True)
        # Wait until every engine has been heard from and the stream has settled (or,
        # when engines keep publishing, a while after the last one was first heard).
        deadline = time.monotonic() + args.timeout
        quiet_since = time.monotonic()
        all_heard_at: float | None = None
        while True:
            if catch_up(sub, index, timeout=0.05):
                quiet_since = time.monotonic()
            now = time.monotonic()
            heard = {source.partition("#")[0] for source, _rank in index.workers()}
            if all_heard_at is None and heard >= set(args.endpoints):
                all_heard_at = now
            if all_heard_at is not None and (
                now - quiet_since >= args.settle or now - all_heard_at >= 10 * args.settle
            ):
                break
            if now >= deadline:
                silent = [ep for ep in args.endpoints if ep not in heard]
                sys.exit(
                    f"route_prompts: no KV events from {', '.join(silent)} in "
                    f"{args.timeout:g} s; nothing routed (is the engine running?  An idle "
                    "engine publishes only once it serves a request)"
                )

        for i, tokens in enumerate(prompts):
            catch_up(sub, index)  # the freshest view before each answer
            best = router.score(tokens)[0]  # cheapest first: most reuse, then least load
            m = best.match
            source, rank = best.worker
            if args.json:
                print(
                    json.dumps(
                        {
                            "prompt": i,
                            "tokens": len(tokens),
                            "worker": f"{source}#{rank}",
                            "gpu": m.gpu,
                            "cpu": m.cpu,
                            "storage": m.storage,
                        }
                    ),
                    flush=True,
                )
            else:
                print(
                    f"prompt {i} ({len(tokens)} tokens) -> {source}#{rank}: reuses {m.gpu} "
                    f"GPU + {m.cpu} CPU tokens ({m.total / len(tokens):.0%})",
                    flush=True,
                )


if __name__ == "__main__":
    main()
